"""apex's SyncBatchNorm under nn.DataParallel has no process group (one process): it normalises each replica's own
batch. The report says so in a note, and the BN table labels the layers "SyncBN (local)", never "exact global
statistics" (issue 20). Slow: one single-process check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_syncbn_under_dataparallel_is_reported_as_local(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    script = ROOT / "fixtures" / "probe" / "bn" / "apex_syncbn_dataparallel.py"
    done = subprocess.run([sys.executable, "-m", "ddpdoctor", "check", str(script), "--quiet", "--format", "json",
                           "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert out.is_file(), done.stderr[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    table = report["tables"]["batchnorm"]
    kinds = {row[1] for row in table["rows"]}
    assert kinds == {"SyncBN (local)"}, table["rows"]
    assert "exact global statistics" not in table["caption"], table["caption"]
    assert any("never synchronised" in n and "DataParallel" in n for n in report["notes"]), report["notes"]
