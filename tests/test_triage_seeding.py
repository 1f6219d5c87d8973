"""Triage's own seeding never makes ranks identical (issue 20): children of torch.multiprocessing.spawn inherit no
RANK of their own, so they were all seeded seed + 0 and drew the same dropout masks — a false DD304 that `check`
does not report. They are seeded seed + rank once the process group gives their rank; a script that seeds every
rank alike itself keeps its DD304. Two real gloo ranks per run (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpdoctor.analyses import analyze_run
from ddpdoctor.config import CheckConfig
from ddpdoctor.probe.launcher import run_probe

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _rules(tmp_path: Path, name: str) -> dict:
    cfg = CheckConfig(script=REPO / "fixtures" / "probe" / f"{name}.py", nproc=2, timeout=90.0, epochs=2, steps=3)
    run_probe(cfg, tmp_path / name, arm={"arm": "A", "seed": 0})
    return {f.rule: f for f in analyze_run(tmp_path / name).findings}


def test_spawned_ranks_seeded_by_triage_draw_different_streams(tmp_path: Path) -> None:
    assert "DD304" not in _rules(tmp_path, "spawn_unseeded_dropout")


def test_spawned_ranks_the_script_seeds_alike_keep_dd304(tmp_path: Path) -> None:
    assert "DD304" in _rules(tmp_path, "spawn_same_seed_dropout")
