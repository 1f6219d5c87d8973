"""`TORCH_DISTRIBUTED_DEBUG=DETAIL` in the user's environment makes every DDP rank segfault on CPU torch
(docs/facts.md#pytorchs-own-distributed-debug-modes): ranks that emulate CUDA on CPU run without it, and the report
says so in one note. Two real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpdoctor.check import run_check
from ddpdoctor.config import CheckConfig

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_detail_debug_is_dropped_on_emulated_ranks(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    report = run_check(CheckConfig(script=Path("fixtures/probe/device_bound.py"), nproc=2, device="cpu",
                                   timeout=600, keep_run=tmp_path / "run", quiet=True)).to_json()
    rules = {f["rule"] for f in report["findings"]}
    assert "DD902" not in rules and "DD901" not in rules, report["findings"]
    notes = [n for n in report.get("notes", []) if "TORCH_DISTRIBUTED_DEBUG" in n]
    assert len(notes) == 1 and "DETAIL" in notes[0] and "without it" in notes[0]
