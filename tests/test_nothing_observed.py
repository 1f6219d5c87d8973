"""DD904 nothing-observed: a run without a single optimizer step is never a clean report, in `check` and in
`report`, and the finding says why as far as the run shows it. Hand-built runs for each reason (fast), real
probes of the scripts that produce them (slow)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from test_analyses_synthetic import SCRIPT, SITE, Run

from ddpdoctor.analyses import analyze_run

REPO = Path(__file__).resolve().parents[1]


def _dd904(root: Path):
    return [f for f in analyze_run(root).findings if f.rule == "DD904"]


def _ranks(run: Run, *events: tuple[str, dict], done: str = "script returned") -> None:
    for rank in (0, 1):
        run.process(100 + rank, rank, events=[("pg_init", {"ok": True, "rank": rank, "world_size": 2}), *events,
                                              ("done", {"reason": done, "steps": 0, "epochs": 0}),
                                              ("exit", {"code": 0})])


def test_a_resume_past_the_last_epoch_names_the_checkpoint(tmp_path: Path) -> None:
    run = Run(tmp_path / "run", returncode=0)
    _ranks(run, ("optimizer_init", {"opt": 1, "site": SITE}),
           ("checkpoint_load", {"site": SITE, "path": "ckpt/last.pt", "abspath": "/proj/ckpt/last.pt",
                                "users_file": True, "counters": {"epoch": 89}}))
    [f] = _dd904(run.root)
    assert f.severity.label == "high" and f.line == 12
    assert "ckpt/last.pt (epoch=89)" in f.message and "nothing left to train" in f.message
    assert "start afresh" in f.fix


def test_an_empty_loader_gives_its_shape(tmp_path: Path) -> None:
    run = Run(tmp_path / "run", returncode=0)
    _ranks(run, ("optimizer_init", {"opt": 1, "site": SITE}),
           ("loader_created", {"loader": 1, "site": SITE, "batch_size": 64, "drop_last": True, "dataset_len": 100}),
           ("loader_iter_end", {"loader": 1, "it": 1, "batches": 0, "steps": 0, "training": False}))
    [f] = _dd904(run.root)
    assert "yielded no batch (a dataset of 100 samples, batch size 64, drop_last)" in f.message


def test_no_optimizer_and_early_exit(tmp_path: Path) -> None:
    run = Run(tmp_path / "a", returncode=0)
    _ranks(run)
    [f] = _dd904(run.root)
    assert "never built an optimizer" in f.message
    run = Run(tmp_path / "b", returncode=0)
    exits = {"reason": "sys.exit(0)", "steps": 0, "epochs": 0, "site": {"file": SCRIPT, "line": 30}}
    for rank in (0, 1):
        run.process(200 + rank, rank, events=[("optimizer_init", {"opt": 1}), ("done", exits), ("exit", {"code": 0})])
    [f] = _dd904(run.root)
    assert "sys.exit(0) at train.py:30" in f.message


def test_a_hand_written_update_is_named_at_low_severity(tmp_path: Path) -> None:
    """Backward passes and no torch.optim optimizer: the script trains by hand (p -= lr * p.grad). That is not a
    broken run: DD904 says what the probe could not measure, and does not fail CI."""
    run = Run(tmp_path / "run", returncode=0)
    for rank in (0, 1):
        run.process(400 + rank, rank, events=[
            ("pg_init", {"ok": True, "rank": rank, "world_size": 2}),
            ("done", {"reason": "script returned", "steps": 0, "epochs": 0, "backwards": 8}), ("exit", {"code": 0})])
    [f] = _dd904(run.root)
    assert f.severity.label == "low" and f.evidence["backward_passes"] == 16
    assert "ran 16 backward passes but never built a torch.optim optimizer" in f.message
    assert "torch.optim.SGD(params, lr)" in f.fix


def test_a_run_that_stepped_a_failure_or_a_hang_is_not_dd904(tmp_path: Path) -> None:
    run = Run(tmp_path / "a", returncode=0)
    _ranks(run, ("optimizer_step", {"opt": 1, "step": 1}))
    assert _dd904(run.root) == []
    run = Run(tmp_path / "b", returncode=1)
    for rank in (0, 1):
        run.process(300 + rank, rank, events=[("exception", {"type": "ValueError", "message": "bad", "traceback": ""})])
    assert _dd904(run.root) == []
    assert _dd904(Path(REPO / "fixtures" / "runs" / "bn_uneven_hang")) == []  # timed out: DD901 says it


def test_report_of_a_run_that_observed_nothing_exits_1(tmp_path: Path) -> None:
    run = Run(tmp_path / "run", returncode=0)
    _ranks(run)
    done = subprocess.run([sys.executable, "-m", "ddpdoctor", "report", str(run.root)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 1 and "DD904" in done.stdout and "No findings" not in done.stdout


@pytest.mark.slow
def test_probe_of_a_script_resumed_past_its_last_epoch(tmp_path: Path) -> None:
    """The user's checkpoint holds the last epoch: the script loads it and has nothing to train."""
    import torch
    from torch import nn

    folder = tmp_path / "project"
    (folder / "ckpt").mkdir(parents=True)
    shutil.copy(REPO / "fixtures" / "probe" / "files" / "auto_resume.py", folder / "train.py")
    model = nn.Linear(8, 3)
    torch.save({"model": model.state_dict(), "optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(),
                "epoch": 9}, folder / "ckpt" / "last.pt")
    done = run_cli("check", "train.py", "--format", "json", cwd=folder)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    [f] = [f for f in report["findings"] if f["rule"] == "DD904"]
    assert "ckpt/last.pt (epoch=9)" in f["message"] and f["line"] == 25


@pytest.mark.slow
def test_probe_of_a_script_that_updates_its_parameters_by_hand(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = run_cli("check", "fixtures/probe/manual_sgd.py", "--format", "json", "-o", str(out), "-q")
    assert done.returncode == 0, done.stderr
    [f] = [f for f in json.loads(out.read_text())["findings"] if f["rule"] == "DD904"]
    assert f["severity"] == "low" and f["evidence"]["backward_passes"] == 16, f
