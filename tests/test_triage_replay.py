"""A recorded `ddpdoctor triage --keep-run` directory (fixtures/runs/triage_fused_act:
fixtures/triage/fused_act_torch.py, arms A and P, 1 epoch x 8 steps) re-analysed by `ddpdoctor report DIR` without
running anything: the verdicts, the JSON `triage` object, the text sections, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ddpdoctor.cli import main

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "runs" / "triage_fused_act"


def test_replayed_triage_confirms_the_changed_function(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert main(["report", str(RUN), "--format", "json", "-o", str(out)]) == 1
    report = json.loads(out.read_text(encoding="utf-8"))
    tri = report["triage"]
    assert set(tri) == {"arms", "paired", "headline", "causes"}
    assert [a["name"] for a in tri["arms"]] == ["A", "P"] and tri["paired"] is True
    first = tri["causes"][0]
    assert (first["verdict"], first["rule"], first["favours"]) == ("confirmed", "DD208", "fix_conversion")
    assert [c["rule"] for c in tri["causes"] if c["verdict"] == "confirmed"] == ["DD208"]
    assert tri["headline"].startswith("The conversion to SyncBN changed the model itself")
    assert "DD208" in {f["rule"] for f in report["findings"]}
    noise = next(c for c in tri["causes"] if c["rule"] == "DD204")
    assert noise["measured"]["per_rank_samples"] == 16 and noise["measured"]["sync_group"] == 2


def test_replayed_triage_text(capsys) -> None:
    assert main(["report", str(RUN)]) == 1
    text = capsys.readouterr().out
    assert "triage: The conversion to SyncBN changed the model itself" in text
    assert "paired: yes; emulated: yes; final accuracy: not measured" in text
    assert "CONFIRMED" in text and "conversion-changed-function" in text


def test_replaying_a_triage_never_imports_torch() -> None:
    code = ("import sys; from pathlib import Path; from ddpdoctor.cli import main; "
            f"main(['report', {str(RUN)!r}, '--format', 'json', '-o', '/dev/null']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
