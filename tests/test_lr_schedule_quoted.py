"""DD401 never quotes an optimizer's default lr when a schedule drives the lr the probe measured (issue 20): the
static suspicion quoting "the AdamW default lr=0.001" is replaced by the same low suspicion quoting the lr the ranks
stepped with. Slow: one 2-rank check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_scheduled_default_lr_is_quoted_as_measured(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    script = ROOT / "fixtures" / "probe" / "optim" / "lr_default_scheduled.py"
    done = run_cli("check", str(script), "--quiet", "--format", "json", "-o", str(out))
    assert out.is_file(), done.stderr[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    dd401 = [f for f in report["findings"] if f["rule"] == "DD401"]
    assert len(dd401) == 1 and dd401[0]["severity"] == "low", dd401
    assert "default lr=" not in dd401[0]["message"], dd401[0]["message"]
    assert "→ 0.001" in dd401[0]["message"] and dd401[0]["evidence"]["lr_source"] == "measured"
    assert done.returncode == 0
