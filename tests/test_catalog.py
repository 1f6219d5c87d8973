"""The rule catalog: every code of the contract exactly once, fully documented, and the README table generated
from it. Codes are stable forever, so the expected table is frozen in docs/contract.md (CI has no ../shared),
read from there and checked against SPEC.md whenever SPEC.md sits beside the clone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ddpdoctor.findings import Severity
from ddpdoctor.rules import PACKAGES, RULES, Rule, catalog_markdown_table, get_rule, hooks, select_codes

REPO = Path(__file__).resolve().parents[1]
SPEC = Path(__file__).resolve().parents[2] / "shared" / "SPEC.md"

CONTRACT = REPO / "docs" / "contract.md"
_CONTRACT_ROW = re.compile(
    r"\|\s*(DD\d{3})\s*\|\s*([a-z0-9-]+)\s*\|\s*(\w+)\s*\|\s*(\S+)\s*\|\s*(\S+)\s*\|\s*([^|]*)\|"
)


def contract_rows() -> list[tuple[tuple[str, str, str, bool, bool], str]]:
    """The rule table of docs/contract.md (SPEC's table carried into the repository: CI has no ../shared), the one
    place a rule's contract row is written: ((code, name, default severity, static, probe), status)."""
    rows = []
    for line in CONTRACT.read_text(encoding="utf-8").splitlines():
        m = _CONTRACT_ROW.match(line)
        if m:
            code, name, sev, static, probe, status = m.groups()
            rows.append(((code, name, sev, static == "yes", probe == "yes"), status.strip()))
    return rows


# code, name, default severity, static, probe: the contract's rows whose rule has landed
EXPECTED = [row for row, status in contract_rows() if status != "pending"]

# Rows SPEC.md added for issues still open (trust, triage), status `pending` in the contract. SPEC: "until the
# issue that adds a row lands, a test that holds the implementation against this table treats that row as pending,
# not as a failure." A pending row loses its status when the rule lands in the catalog.
PENDING = [row for row, status in contract_rows() if status == "pending"]

# Halves of a row that the contract lists and no hook implements yet (status `static half pending` / `probe half
# pending`): the rule says what it really does; the column counts as pending until the hook lands.
PENDING_HALVES: set[tuple[str, str]] = {
    (row[0], status.split()[0]) for row, status in contract_rows() if status.endswith("half pending")
}

# Where a newer issue changed a SPEC row (issues are newer than SPEC and win, SPEC says so), the deviation is
# explicit: (code, column) -> why. SPEC's row is adjusted before the comparison.
ISSUE_OVERRIDES = {
    ("DD109", "probe"): "issue 14: measured on multi-node attach runs (a node's device_count() as the world size)",
    ("DD504", "probe"): "issue 13: measured on Horovod's non-in-place allreduce whose result is thrown away",
    ("DD904", "static"): "issue 21: an engine static analysis does not model is 'not analysed: <engine>', never 'No "
                         "findings' (a DD904-style finding)",
}

DOC_PARTS = ("summary", "what", "why", "example", "fix")


def _spec_rows() -> list[tuple[str, str, str, bool, bool]]:
    rows = []
    for line in SPEC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*(DD\d{3})\s*\|\s*([a-z0-9-]+)\s*\|\s*(\w+)\s*\|\s*(\S+)\s*\|\s*(\S+)\s*\|", line)
        if m:
            code, name, sev, static, probe = m.groups()
            row = (code, name, sev, static == "yes", probe == "yes")
            if (code, "static") in ISSUE_OVERRIDES:
                row = (*row[:3], not row[3], row[4])
            if (code, "probe") in ISSUE_OVERRIDES:
                row = (*row[:4], not row[4])
            rows.append(row)
    return rows


def _row(r: Rule) -> tuple[str, str, str, bool, bool]:
    """The rule as a row of SPEC's table, its pending halves counted as there."""
    return (r.code, r.name, r.severity.label, r.static or (r.code, "static") in PENDING_HALVES,
            r.probe or (r.code, "probe") in PENDING_HALVES)


def test_catalog_matches_the_frozen_contract():
    actual = [_row(r) for r in RULES]
    assert actual == EXPECTED
    landed = [(code, half) for code, half in PENDING_HALVES if getattr(get_rule(code), half)]
    assert not landed, "a landed half leaves PENDING_HALVES"


def test_found_by_is_which_hooks_the_rule_package_has():
    for r in RULES:
        package = REPO.joinpath(*r.package.split("."))
        assert (r.static, r.probe) == ((package / "static.py").is_file(), (package / "probe.py").is_file()), r.code
    assert [m.CODE for m in hooks("static")] == [r.code for r in RULES if r.static]
    assert [m.CODE for m in hooks("probe")] == [r.code for r in RULES if r.probe]
    assert all(callable(m.check) for m in hooks("static")) and all(callable(m.analyze) for m in hooks("probe"))


def test_one_package_per_rule_named_after_it():
    assert [p.RULE for p in PACKAGES] == list(RULES)
    on_disk = sorted(d.name for d in (REPO / "ddpdoctor" / "rules").iterdir() if (d / "__init__.py").is_file())
    assert on_disk == [p.__name__.rsplit(".", 1)[-1] for p in PACKAGES], "every rule package is in PACKAGES, once"
    for p in PACKAGES:
        r = p.RULE
        assert p.__name__ == r.package == f"ddpdoctor.rules.{r.code.lower()}_{r.name.replace('-', '_')}"
        assert p.CODE == r.code


@pytest.mark.parametrize("rule", [r for r in RULES if r.fix_variants], ids=lambda r: r.code)
def test_fix_variants_are_short_imperatives(rule: Rule):
    for key, text in rule.fix_variants.items():
        assert re.fullmatch(r"[a-z_]+", key) and text.strip() and "\n" not in text, (rule.code, key)
        assert len(text) <= 220 and "TODO" not in text.upper(), (rule.code, key)
    assert rule.fix_text(detail="Also this.") == rule.fix + " Also this."  # a detail appends, never replaces


def test_frozen_contract_matches_spec_md():
    if not SPEC.is_file():
        pytest.skip("SPEC.md is not beside this clone (../shared)")
    implemented = {r.code for r in RULES}
    pending = [row for row in PENDING if row[0] not in implemented]
    assert {code for code, _ in PENDING_HALVES} <= implemented
    assert not [row for row in PENDING if row[0] in implemented], "a landed rule belongs in EXPECTED, not PENDING"
    assert _spec_rows() == sorted(EXPECTED + pending)


def test_the_contract_page_lists_every_row_and_what_is_pending():
    """docs/contract.md carries SPEC's rule table into the repository (CI has no ../shared)."""
    rows = {row[0]: (row, status) for row, status in contract_rows()}
    assert len(rows) == len(contract_rows()) and [c for c, _ in sorted(rows.items())] == list(rows), "one row a code"
    implemented = {r.code for r in RULES}
    pending = [row for row in PENDING if row[0] not in implemented]
    assert sorted(row for row, _ in rows.values()) == sorted(EXPECTED + pending)
    for code, (_, status) in rows.items():
        halves = sorted(half for c, half in PENDING_HALVES if c == code)
        want = "pending" if code not in implemented else (f"{halves[0]} half pending" if halves else "")
        assert status == want, code


def test_codes_and_names_are_unique_and_well_formed():
    codes = [r.code for r in RULES]
    names = [r.name for r in RULES]
    assert len(set(codes)) == len(codes) == len(EXPECTED)
    assert len(set(names)) == len(names)
    assert codes == sorted(codes)
    for r in RULES:
        assert re.fullmatch(r"DD[1-59]\d\d", r.code), r.code
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", r.name), r.name
        assert isinstance(r.severity, Severity)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_every_documentation_part_is_written(rule: Rule):
    for part in DOC_PARTS:
        text = getattr(rule, part)
        assert text.strip(), f"{rule.code}.{part} is empty"
        assert "TODO" not in text.upper(), f"{rule.code}.{part} is a placeholder"
    assert "\n" not in rule.summary
    assert "\n" not in rule.fix
    assert len(rule.fix) <= 220, "fix is a short imperative (finding fix, SARIF fix title)"
    assert len(rule.what) >= 120 and len(rule.why) >= 250, "what/why explain the detection and the mechanism"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_what_says_how_the_rule_is_found(rule: Rule):
    # "what" describes exactly the detectors the rule has: no static description for a probe-only rule
    assert ("Static analysis" in rule.what or "static analysis" in rule.what) == rule.static
    assert ("The probe" in rule.what) == rule.probe


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_example_is_python_with_bad_then_good(rule: Rule):
    ast.parse(rule.example)
    comments = [ln.strip() for ln in rule.example.splitlines() if ln.strip().startswith("#")]
    bad = [i for i, c in enumerate(comments) if c.startswith("# Bad")]
    good = [i for i, c in enumerate(comments) if c.startswith("# Good")]
    assert bad and good and bad[0] < good[0], rule.code
    assert max(len(ln) for ln in rule.example.splitlines()) <= 96


def test_documentation_has_the_four_sections_in_order():
    doc = get_rule("DD301").documentation()
    positions = [doc.index(h) for h in ("What it detects\n", "Why it hurts accuracy\n", "Example\n", "Fix\n")]
    assert positions == sorted(positions)
    assert doc.startswith("DD301 sampler-not-reshuffled\n")
    assert "default severity: high" in doc
    assert "    sampler.set_epoch(epoch)" in doc  # the example is indented as code
    assert max(len(ln) for ln in doc.splitlines()) <= 100


def test_markdown_documentation_fences_the_example():
    md = get_rule("DD101").markdown()
    assert "```python\n# Bad" in md
    assert "### Why it hurts accuracy" in md


def test_dd101_documentation_matches_the_measured_facts():
    # docs/facts.md#converting-to-syncbn-after-wrapping-in-ddp: on torch >= 1.8 the late conversion still syncs
    # (shared Parameters); it broke on <= 1.7 / apex
    why = get_rule("DD101").why
    assert "same" in why and "Parameter" in why
    assert "1.7" in why and "apex" in why
    assert "has_sync_bn" in why and "mixed_precision" in why


def test_categories_follow_the_code_ranges():
    assert {r.category for r in RULES} == {"setup", "batchnorm", "data", "optimisation", "checkpoints", "probe"}
    assert get_rule("DD301").category == "data"
    assert get_rule("DD903").category == "probe"


def test_get_rule_is_case_insensitive_and_rejects_unknown_codes():
    assert get_rule(" dd204 ").name == "syncbn-large-batch"
    with pytest.raises(KeyError):
        get_rule("DD999")


def test_select_codes_prefix_match():
    # derived from the contract, so that a new rule is one row to add (not a set of codes per test)
    data_rules = {code for code, *_ in EXPECTED if code.startswith("DD3")}
    assert len(data_rules) >= 6 and select_codes(["DD3"]) == data_rules
    assert select_codes(["dd501", "DD9"]) == {"DD501"} | {code for code, *_ in EXPECTED if code.startswith("DD9")}
    assert select_codes(["DD"]) == {r.code for r in RULES}
    with pytest.raises(ValueError):
        select_codes(["DD7"])


def test_markdown_table_has_one_row_per_rule():
    lines = catalog_markdown_table().splitlines()
    assert lines[0] == "| code | name | default severity | static | probe | summary |"
    rows = lines[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [r.code for r in RULES]
    dd107 = next(row for row in rows if row.startswith("| DD107 "))
    assert dd107.split(" | ")[2:5] == ["medium", "yes", "–"]


def test_readme_rule_table_is_generated_from_the_catalog():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    start, end = "<!-- rules:start -->", "<!-- rules:end -->"
    assert readme.count(start) == 1 and readme.count(end) == 1
    section = readme[readme.index(start) + len(start) : readme.index(end)]
    assert section.strip("\n") == catalog_markdown_table().strip("\n"), (
        "README rule table is stale: regenerate it from ddpdoctor.rules.catalog_markdown_table()"
    )


# ------------------------------------------------------------------------------------------------ measured consequence
# A probe finding's own measurement may never contradict it (issue 20): a probe half declares the measured quantity
# its finding is about (`CONSEQUENCE`, ddpdoctor.analyses.consequence) and `analyze_context` drops a finding of it
# whose value is absent or not above the floor. Probe halves without a declaration, and why. Empty these, don't grow
# them: a new probe half declares its consequence or says here why its finding is the observation itself.
OBSERVATION_ITSELF = {code: "the finding is the event the run recorded (a hang, a crash, no process group, nothing "
                      "observed): there is no separate quantity to contradict it"
                      for code in ("DD901", "DD902", "DD903", "DD904")}
CONSEQUENCE_PENDING = {
    "DD101": "one finding lists what it measured on the converted model together with 'no optimizer step ran, so "
    "the probe could not check': the unmeasured case must become a note before a quantity can be declared",
    "DD106": "four finding paths (three low notes on how DataParallel ran, the per-replica BN statistics) with "
    "different quantities",
    "DD401": "two finding paths (the lr against the reference recipe, an lr changed in the loop) with different "
    "quantities",
    "DD402": "fires from static scaling evidence when no lr ratio was measured (ratio None): a declaration would drop "
    "that finding until the lr trace's own quantity is in its evidence",
}
# declaring rules whose finding no recorded run under fixtures/runs holds yet (the declared field is then checked on
# a finding made from the rule's own evidence only)
NO_RECORDED_FINDING = {"DD209": "momentum/eps lost by a converter: no recorded run holds it",
                       "DD210": "frozen BN unfrozen: no recorded run holds it",
                       "DD109": "a world size unlike the launch's needs a launch across nodes (test_rule_dd109.py)",
                       "DD211": "SyncBN statistics off the global batch's: no recorded run holds it",
                       "DD212": "SyncBN over a partial process group: no recorded run holds it",
                       **{code: "population / evaluation-shift / micro-batch measures of triage arms: no recorded "
                          "run holds one" for code in ("DD213", "DD214", "DD215")}}


def _probe_modules() -> dict[str, object]:
    return {m.__name__.split(".")[-2].split("_")[0].upper(): m for m in hooks("probe")}


def test_every_probe_half_declares_the_consequence_it_measures_or_says_why_not() -> None:
    from ddpdoctor.analyses.consequence import Consequence

    modules = _probe_modules()
    declared = {code for code, m in modules.items() if isinstance(getattr(m, "CONSEQUENCE", None), Consequence)}
    excused = set(OBSERVATION_ITSELF) | set(CONSEQUENCE_PENDING)
    assert not declared & excused, f"declared and excused: {sorted(declared & excused)}"
    assert set(modules) == declared | excused, f"undeclared: {sorted(set(modules) - declared - excused)}"
    assert declared >= {"DD105", "DD208", "DD209", "DD210", "DD216", "DD302"}


def test_a_finding_its_own_measurement_contradicts_is_never_reported() -> None:
    """For every declaring rule: a finding whose evidence holds no value, or the floor, is dropped with a note; the
    mechanism sits in analyze_context, so no probe half can raise one."""
    from ddpdoctor.analyses.consequence import Consequence, keep_consistent
    from ddpdoctor.findings import Confidence, new_finding

    for code, module in _probe_modules().items():
        declared = getattr(module, "CONSEQUENCE", None)
        if not isinstance(declared, Consequence):
            continue
        bare = new_finding(code, sources=("probe",), message="m", confidence=Confidence.CERTAIN, evidence={})
        notes: list[str] = []
        assert keep_consistent(module, [bare], notes) == [], code
        assert notes and notes[0].startswith(f"{code} not reported: its own measurement contradicts it"), notes
        # at the floor: the declared field holding the floor value (a count field: nothing counted) is dropped too
        field = getattr(declared.measure, "field", None)
        if field is not None:
            for value in ([] if declared.floor == 0 else None, declared.floor):
                if value is None:
                    continue
                at_floor = new_finding(code, sources=("probe",), message="m", confidence=Confidence.CERTAIN,
                                       evidence={field: value})
                notes = []
                assert keep_consistent(module, [at_floor], notes) == [], (code, value)
                assert "measured" in notes[0], notes


def test_recorded_findings_carry_the_consequence_their_rule_declares() -> None:
    """Over every recorded run: each probe finding of a declaring rule has its measured value above the floor
    (so the declaration names a field the rule really fills), and each declaring rule has such a finding somewhere
    unless NO_RECORDED_FINDING says why."""
    from ddpdoctor.analyses import analyze_run
    from ddpdoctor.analyses.consequence import Consequence, contradiction
    from ddpdoctor.causes import flatten
    from ddpdoctor.rundata import find_run_dirs

    modules = _probe_modules()
    declaring = {c for c, m in modules.items() if isinstance(getattr(m, "CONSEQUENCE", None), Consequence)}
    seen: set[str] = set()
    runs = sorted(p for p in (REPO / "fixtures" / "runs").iterdir() if p.is_dir())
    for run in runs:
        for d in find_run_dirs([run]) if not (run / "meta.json").is_file() else [run]:
            for f in flatten(analyze_run(d).findings):
                if f.rule in declaring and "probe" in f.sources:
                    assert contradiction(modules[f.rule], f) is None, (d, f.rule, f.evidence)
                    seen.add(f.rule)
    missing = declaring - seen - set(NO_RECORDED_FINDING)
    assert not missing, f"declaring rules with no recorded finding: {sorted(missing)}"
    assert not seen & set(NO_RECORDED_FINDING), "a recorded finding exists now: remove it from NO_RECORDED_FINDING"
