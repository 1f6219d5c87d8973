"""Attach mode: `python -m ddpdoctor.probe --out DIR SCRIPT` under the user's own torchrun, then
`ddpdoctor report DIR`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpdoctor.check import report_run
from ddpdoctor.probe.launcher import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_attach_under_torchrun_then_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), "-m", "ddpdoctor.probe", "--out", str(out), "--no-limit",
        "fixtures/probe/missing_set_epoch.py",
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("finished") == 2  # the script's own output reaches the user's launcher
    meta = json.loads((out / "meta.json").read_text())
    assert meta["mode"] == "attach" and meta["nproc"] == 2 and meta["epochs"] == 0
    script = REPO / "fixtures" / "probe" / "missing_set_epoch.py"
    assert meta["sources"] == {str(script): "source/fixtures/probe/missing_set_epoch.py"}  # the first process copied it
    assert (out / meta["sources"][str(script)]).read_text() == script.read_text()
    report = report_run(out).to_json()
    dd301 = next(f for f in report["findings"] if f["rule"] == "DD301" and "probe" in f["sources"])
    per_rank = dd301["evidence"]["per_rank"]["0"]
    assert per_rank["epochs_compared"] == 10 and per_rank["repeats"] == 9  # the whole run: 10 epochs
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][3] == 60 and rows[1][3] == 60  # 10 epochs × 6 steps, nothing cut
    assert report["environment"]["cuda_emulated"] is False


def test_attach_rejects_a_missing_script(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ddpdoctor.probe", "--out", str(tmp_path / "r"), "nope.py"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and "nope.py: no such file" in done.stderr and "Traceback" not in done.stderr
