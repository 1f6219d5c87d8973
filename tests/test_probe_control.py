"""The probe's epoch/step limit on the loop shapes real scripts use, in one process (no ranks): the run must end
after E epochs of S optimizer steps, the script's own output must show what it saw, and no loop may be left
running into the timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpdoctor.probe.settings import ProbeSettings
from ddpdoctor.rundata import read_run

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "fixtures/probe/control/loops.py"
pytestmark = pytest.mark.slow


def _run(tmp_path: Path, scenario: str, epochs: int = 2, steps: int = 3) -> tuple[list[dict], dict, list]:
    settings = ProbeSettings(run_dir=str(tmp_path), mode="torchrun", epochs=epochs, steps=steps, device="cpu",
                             nproc=1, timeout=300.0)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}, **settings.to_env()}
    done = subprocess.run([sys.executable, "-m", "ddpdoctor.probe.bootstrap", SCRIPT, scenario], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "meta.json").write_text(json.dumps({"schema": "ddpdoctor.events/1"}))
    run = read_run(tmp_path)
    p = run.processes[0]
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return printed, p.done, p.of("loader_iter_end")


def test_two_loaders_zipped_are_one_epoch(tmp_path: Path) -> None:
    printed, done, ends = _run(tmp_path, "zip")
    assert done["reason"] == "epochs observed" and done["steps"] == 6 and done["epochs"] == 2
    assert printed == []  # ended at the start of the third epoch, before the script's final print
    assert sorted(e["reason"] for e in ends) == ["abandoned", "abandoned", "cut", "cut"]


def test_itertools_cycle_ends_after_epochs_times_steps(tmp_path: Path) -> None:
    _, done, ends = _run(tmp_path, "cycle")
    assert done["reason"] == "steps observed" and done["steps"] == 6


def test_next_with_restart_on_stop_iteration(tmp_path: Path) -> None:
    _, done, ends = _run(tmp_path, "next_restart")
    assert done["reason"] == "epochs observed" and done["steps"] == 6
    assert [e["steps"] for e in ends] == [3, 3]


def test_gradient_accumulation_counts_optimizer_steps(tmp_path: Path) -> None:
    _, done, ends = _run(tmp_path, "accumulate")
    assert done["steps"] == 6 and [e["batches"] for e in ends] == [6, 6]
    steps = read_run(tmp_path).processes[0].of("optimizer_step")
    assert [s["train_batches"] for s in steps] == [2] * 6


def test_evaluation_loops_are_cut_too(tmp_path: Path) -> None:
    printed, done, ends = _run(tmp_path, "eval_nograd")
    assert printed == [{"batches": 3, "eval_batches": 3, "epochs": 1}, {"batches": 6, "eval_batches": 6, "epochs": 2}]
    evals = [e for e in ends if not e["training"]]
    assert [e["batches"] for e in evals] == [3, 3] and all(e["reason"] == "cut" for e in evals)
    assert done["epochs"] == 2


def test_a_loop_that_breaks_early_still_counts_epochs(tmp_path: Path) -> None:
    _, done, ends = _run(tmp_path, "break_early")
    assert done["reason"] == "epochs observed" and done["steps"] == 4 and done["epochs"] == 2
    assert [e["reason"] for e in ends] == ["abandoned", "abandoned"]
