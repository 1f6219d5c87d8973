"""The style-specific analyses replayed from recorded runs of fixtures/styles/ (fixtures/runs/styles_*, recorded
by python -m ddpdoctor.dev.record): what DataParallel did to BatchNorm, apex's DDP leaving BN buffers per rank,
Horovod replicas that never started equal and a discarded hvd.allreduce. Fast: no rank runs here."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpdoctor.analyses import analyze_run

RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "runs"


def _result(name: str):
    return analyze_run(RUNS / name)


def _by_rule(result) -> dict[str, object]:  # noqa: ANN001
    return {f.rule: f for f in result.findings}


def test_dataparallel_measures_the_replicas_batchnorm_and_gives_the_port() -> None:
    result = _result("styles_dataparallel_bad")
    f = _by_rule(result)["DD106"]
    assert f.severity.label == "medium"
    assert f.evidence["replicas"] == 2 and f.evidence["chunk_sizes"] == [8, 8] and f.evidence["batch"] == 16
    assert f.evidence["bn_samples_per_replica"] == 8 and f.evidence["device_ids"] == [0, 1]
    gap = next(iter(f.evidence["replica0_vs_batch"].values()))
    assert gap["steps"] == 8 and 0.0 < gap["mean_std"] < 1.0 and 0.0 < gap["var_rel"] < 1.0
    assert "only replica 0's chunk updated the running statistics" in f.message
    assert "torchrun --nproc_per_node=2" in f.fix and "batch_size=8 per process" in f.fix
    assert not any(g.rule == "DD903" for g in result.findings)  # DD106 speaks for a DataParallel script
    assert any("one process, 2 GPUs" in n for n in result.notes)
    assert result.environment["nproc"] == 1


def test_dataparallel_without_batchnorm_is_low() -> None:
    f = _by_rule(_result("styles_dataparallel_good"))["DD106"]
    assert f.severity.label == "low" and f.evidence["bn_layers"] == 0
    assert "only speed is lost" in f.message


def test_apex_ddp_leaves_batchnorm_buffers_per_rank() -> None:
    result = _result("styles_apex_bad")
    f = _by_rule(result)["DD201"]
    assert f.evidence["broadcast_buffers"] is False
    assert "apex.parallel.DistributedDataParallel never broadcasts buffers" in f.message
    assert "convert_syncbn_model(model) before the optimizer" in f.fix
    assert "DD903" not in _by_rule(result)  # apex's DDP averages gradients
    assert any(n.startswith("NVIDIA apex is not installed: ddpdoctor's stand-in") for n in result.notes)


def test_horovod_replicas_that_never_started_equal_and_a_discarded_allreduce() -> None:
    result = _result("styles_horovod_bad")
    found = _by_rule(result)
    f = found["DD103"]
    assert f.evidence["first_step"] == 0 and f.evidence["replicas_of"] == "horovod.torch.DistributedOptimizer"
    assert f.evidence["trace"][0]["step"] == 0 and f.evidence["trace"][0]["ranks_differing"] == [1]
    assert "never calls hvd.broadcast_parameters" in f.message and "hvd.broadcast_parameters(" in f.fix
    metric = found["DD504"]
    assert metric.evidence["result_discarded"] is True and metric.evidence["op"] == "allreduce"
    first = metric.evidence["calls"]["1"]
    kept = [first[r]["kept"] for r in ("0", "1")]
    assert kept[0] != kept[1]
    assert first["0"]["returned"] == pytest.approx(sum(kept) / 2, rel=1e-5)  # what Average would have given
    assert "Horovod's DistributedOptimizer averages gradients only" in found["DD201"].message
    assert "DD903" not in found
    assert any("launched as `horovodrun -np 2` launches it" in n for n in result.notes)
    assert any("bad.py:53 would raise \"Default process group has not been initialized\"" in n for n in result.notes)


def test_the_emulation_note_says_which_precision_autocast_computed_in() -> None:
    """Issue 23: CUDA float16 autocast runs as CPU bfloat16 (CPU float16 kernels are ~85x slower than float32 on a
    ResNet-18-shaped step, bfloat16 as fast as float32): the report says so, and what bfloat16 does not reproduce."""
    (note,) = [n for n in _result("styles_apex_bad").notes if n.startswith("CUDA was emulated on CPU")]
    assert "autocast(cuda) → float16 as CPU bfloat16" in note
    assert "float16's overflow above 65504 not reproduced" in note
