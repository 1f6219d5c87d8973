"""Triage claims only what its arms measured (issue 20): a run whose arms all stopped before their first optimizer
step says "Nothing measured" in the headline, decides no cause and exits non-zero whatever --fail-on; statistical
magnitudes carry their own "measurable?" test. Hand-built runs (fast)."""

from __future__ import annotations

from pathlib import Path

from test_analyses_synthetic import SITE, Run

from ddpdoctor.config import CheckConfig
from ddpdoctor.findings import Severity
from ddpdoctor.report.text import render_text
from ddpdoctor.triage.run import assemble


def _failed_arm(root: Path) -> None:
    run = Run(root)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=[("exception", {"type": "AttributeError",
                                                      "message": "module 'apex' has no attribute 'parallel'",
                                                      "user_frame": SITE})])


def test_arms_that_all_failed_before_step_one_measured_nothing(tmp_path: Path) -> None:
    for name in ("A", "L", "P"):
        _failed_arm(tmp_path / f"arm-{name}")
    layout = {"written": "A", "mirror": False, "syncbn_layers": 2, "plain_layers": 0, "group_size": None,
              "arm_dirs": {n: f"arm-{n}" for n in ("A", "L", "P")}}
    report, _ = assemble(tmp_path, layout, CheckConfig(script=Path("train.py")), [], overrides=None)
    tri = report.triage
    assert tri["headline"].startswith("Nothing measured") and "arm A: DD902 rank-failed" in tri["headline"]
    assert "No SyncBN-specific defect" not in tri["headline"]
    assert tri["causes"] == [] and tri["paired"] is False
    assert report.exit_code(Severity.CRITICAL) == 1
    assert "Nothing measured" in render_text(report, color=False)


RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "runs"


def test_running_statistics_still_warming_up_are_not_measurable() -> None:
    """8 updates at momentum 0.1 (3/momentum = 30 needed): the lag and the eval shift measure the warm-up, not the
    training; neither may be LIKELY/POSSIBLE/RULED OUT, and the row says why."""
    from ddpdoctor.triage.run import report_triage

    report = report_triage(RUNS / "triage_fused_act", CheckConfig(script=Path("train.py")))
    rows = {c["rule"]: c for c in report.triage["causes"]}
    for rule in ("DD213", "DD214"):
        assert rows[rule]["verdict"] == "not_measurable", rows[rule]
        assert rows[rule]["measured"]["summary"] == "not measurable: 8 of 30 warm-up updates"
        assert "fewer than the 30 (3/momentum)" in rows[rule]["message"]
    assert not [f for f in report.findings if f.rule in ("DD213", "DD214")]


def test_relative_numbers_against_near_zero_references_are_unbounded() -> None:
    from ddpdoctor.analyses.bn_checks import MAX_RELATIVE, _lag_not_measurable, _shift_not_measurable, lag_level

    pop = {"mean_lag_std": 0.1, "var_lag_rel": 0.01, "population_se_std": 0.01, "eval_output_shift": 16624164509.3,
           "running_stat_updates": 300, "warmup_updates_needed": 30}
    assert "unbounded" in _shift_not_measurable(pop) and _lag_not_measurable(pop) is None
    pop["var_lag_rel"] = MAX_RELATIVE * 2
    pop["lag_not_measurable"] = _lag_not_measurable(pop)
    assert "unbounded" in pop["lag_not_measurable"] and lag_level(pop) == "not_measurable"
