"""The measured accuracy cost of each defect (benchmarks/consequences/, ddpdoctor/data/consequences.json): the data
file is the benchmark's output (its statistics recompute from its own runs), it covers every rule that changes
what a run learns, the catalog's severities follow the measured costs (or the rule says why not), and `explain`
and the README show it."""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from itertools import permutations
from pathlib import Path

import pytest

from ddpdoctor.consequences import DATA_FILE, README_BEGIN, README_END, load, render_markdown
from ddpdoctor.rules import RULES

REPO = Path(__file__).resolve().parents[1]
BY_CODE = {r.code: r for r in RULES}
# the rules issue 25 asks a measured cost for: every rule that changes what a run learns
REQUIRED = {"DD101", "DD102", "DD202", "DD204", "DD207", "DD208", "DD209", "DD210", "DD216", "DD301", "DD302",
            "DD304", "DD305", "DD401", "DD402", "DD403", "DD501", "DD503"}
# two costs are ordered when their difference exceeds this many standard errors (the t quantile of a two-sided 5%
# test at 8 degrees of freedom, 5 seeds an arm: stricter than the normal 1.96, as few seeds call for)
ORDER_T = 2.31


@pytest.fixture(scope="module")
def data() -> dict:
    assert DATA_FILE.exists(), "run benchmarks/consequences/run.py to write the data file"
    return load()


def primary_rows(data: dict) -> dict[str, dict]:
    return {code: r for r in data["rows"] if r["primary"] for code in r["rules"]}


def test_the_data_file_is_the_benchmarks_output(data):
    """Every statistic recomputes from the accuracies the runs recorded: no number in the file is hand-written."""
    from scipy import stats

    seeds = len(data["seeds"])
    assert seeds >= 5
    for row in data["rows"]:
        for arm in ("baseline", "defect", "twin"):
            values = row[arm]["values"]
            assert len(values) == row[arm]["n"] == seeds, (row["label"], arm)
            assert all(0.0 <= v <= 100.0 for v in values)
            assert row[arm]["mean"] == pytest.approx(statistics.fmean(values), abs=1e-9)
            assert row[arm]["std"] == pytest.approx(statistics.stdev(values), abs=1e-9)
        d, t = row["defect"]["values"], row["twin"]["values"]
        assert row["cost"] == pytest.approx(statistics.fmean(t) - statistics.fmean(d), abs=1e-9)
        assert row["gap_to_baseline"] == pytest.approx(
            statistics.fmean(d) - statistics.fmean(row["baseline"]["values"]), abs=1e-9)
        se = math.sqrt(statistics.variance(d) / len(d) + statistics.variance(t) / len(t))
        assert row["cost_se"] == pytest.approx(se, abs=1e-9)
        if se > 0:
            assert row["p"] == pytest.approx(stats.ttest_ind(t, d, equal_var=False).pvalue, rel=1e-6)
        assert row["significant"] == (row["p"] < 0.05)
    assert (data["wall_s"] is None or data["wall_s"] > 0) and data["run_seconds"] > 0
    assert data["load_average"]["before"]


def benchmark_rows() -> list:
    pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "benchmarks" / "consequences"))
    try:
        from run import ROWS
    finally:
        sys.path.remove(str(REPO / "benchmarks" / "consequences"))
    return ROWS


def test_every_rule_that_changes_what_a_run_learns_is_measured(data):
    """The benchmark defines a row for each; the data file has it, or names it among the rows whose runs did not
    finish (`unmeasured_rows`: the benchmark was interrupted; rerun it)."""
    defined = {code for row in benchmark_rows() if row.primary for code in row.rules}
    assert REQUIRED <= defined, f"no benchmark row: {sorted(REQUIRED - defined)}"
    measured = set(primary_rows(data))
    pending = {code for text in data["unmeasured_rows"] for code in text.split(":")[0].split("/")}
    assert REQUIRED <= measured | pending, f"neither measured nor pending: {sorted(REQUIRED - measured - pending)}"
    assert measured <= set(BY_CODE), "a row names a rule the catalog does not have"


def test_severities_follow_the_measured_costs(data):
    """A defect that costs significantly more is never ranked lower, unless one of the two rules says why its
    severity differs from its cost on digits (`Rule.cost_note`)."""
    rows = primary_rows(data)
    disagreements = []
    for a, b in permutations(sorted(rows), 2):
        ra, rb = rows[a], rows[b]
        if ra is rb:
            continue
        gap = ra["cost"] - rb["cost"]
        if gap <= ORDER_T * math.hypot(ra["cost_se"], rb["cost_se"]):
            continue  # a does not cost significantly more than b
        sev_a, sev_b = BY_CODE[a].severity, BY_CODE[b].severity
        if sev_a < sev_b and not (BY_CODE[a].cost_note or BY_CODE[b].cost_note):
            disagreements.append(f"{a} ({sev_a.label}) costs {ra['cost']:.1f} points, more than {b} "
                                 f"({sev_b.label}, {rb['cost']:.1f})")
    assert disagreements == []


def test_a_cost_note_belongs_to_a_measured_rule(data):
    measured = set(primary_rows(data))
    noted = {r.code for r in RULES if r.cost_note}
    assert noted <= measured, f"cost_note on a rule the benchmark does not measure: {sorted(noted - measured)}"


def test_explain_shows_the_measured_cost(cli, data):
    row = primary_rows(data)["DD207"]
    out = cli("explain", "DD207")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "Measured cost (benchmarks/consequences/)" in out.stdout
    assert f"measured cost on digits: {-row['cost']:+.1f} points".replace("-", "\u2212") in text  # DD207: a loss
    assert f"{len(data['seeds'])} seeds, {row['setting']}" in text
    # a rule the benchmark does not measure has no such section
    assert "Measured cost" not in cli("explain", "DD902").stdout


def test_explain_shows_a_rules_cost_note(cli):
    noted = [r for r in RULES if r.cost_note]
    if not noted:
        pytest.skip("no rule declares a cost note")
    text = " ".join(cli("explain", noted[0].code).stdout.split())
    assert f"Severity: {' '.join(noted[0].cost_note.split())}" in text


def test_the_readme_table_is_the_data_files(data):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert README_BEGIN in readme and README_END in readme
    table = readme.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
    assert table == render_markdown(data).strip(), (
        "README's consequences table is stale: python benchmarks/consequences/run.py --readme")


def test_each_twin_differs_from_its_defect_by_the_fix_alone():
    """The benchmark's pairs: one shared script, the twin differing from the defect in the fix's flags only (two
    for a row that measures two rules together, or a fix that is a scaled lr with its warmup)."""
    for row in benchmark_rows():
        diff = [f.name for f in dataclasses.fields(row.defect)
                if getattr(row.defect, f.name) != getattr(row.twin, f.name)]
        assert 1 <= len(diff) <= 2, (row.label, diff)
        if len(diff) == 2:
            assert len(row.rules) == 2 or set(diff) == {"lr", "warmup_epochs"}, (row.label, diff)
