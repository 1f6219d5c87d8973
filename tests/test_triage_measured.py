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
