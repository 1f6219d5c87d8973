"""FSDP2 (`fully_shard`, DTensor parameters) under the probe, and identical batches found whatever produces them
(issue 20): a script that seeds every rank alike and draws the indices of each batch in its loop (no DataLoader)
trains every rank on the same samples — DD302 from the digests of the model's training inputs, for an FSDP2 model
as for a DDP one; the DTensor parameters are recorded (their local shards) without a recorder failure; seeded per
rank, nothing is reported. Slow: one 2-rank check per case, made once and shared."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "fixtures" / "probe" / "fsdp2_same_batches.py"
try:  # the fixture imports it from there: public since torch 2.6 (2.4 has it under torch.distributed._composable)
    from torch.distributed.fsdp import fully_shard  # noqa: F401
except ImportError:
    pytest.skip("the fixture uses torch.distributed.fsdp.fully_shard (torch 2.6+)", allow_module_level=True)


@lru_cache(maxsize=None)
def _check(*script_args: str) -> tuple[int, dict]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ddpdoctor-test-fsdp2-") as tmp:
        out = Path(tmp) / "r.json"
        argv = ["check", str(SCRIPT), "--quiet", "--format", "json", "-o", str(out)]
        if script_args:
            argv += ["--", *script_args]
        done = run_cli(*argv)
        assert out.is_file(), done.stderr[-3000:]
        return done.returncode, json.loads(out.read_text(encoding="utf-8"))


def _no_recorder_failure(report: dict) -> None:
    assert not [n for n in report["notes"] if "recorder failed" in n], report["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("--ddp",)], ids=["fsdp2", "ddp"])
def test_ranks_seeded_alike_drawing_indices_train_on_identical_batches(args: tuple[str, ...]) -> None:
    code, report = _check(*args)
    dd302 = [f for f in report["findings"] if f["rule"] == "DD302"]
    assert dd302 and dd302[0]["severity"] == "high", report["findings"]
    assert "identical on ranks 0, 1" in dd302[0]["message"]
    assert dd302[0]["evidence"]["overlap_fraction"] == 1.0 and dd302[0]["evidence"]["compared_forwards"] >= 2
    assert report["findings"][0]["rule"] == "DD302" and code == 1
    _no_recorder_failure(report)


@pytest.mark.slow
def test_fsdp2_seeded_per_rank_is_clean() -> None:
    code, report = _check("--per-rank-seed")
    assert not [f for f in report["findings"] if f["rule"] in ("DD302", "DD304", "DD103")], report["findings"]
    _no_recorder_failure(report)
