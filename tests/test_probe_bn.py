"""The batchnorm recorder: in-process checks of what it writes (moments, modes, running statistics, names, lazy
and momentum=None layers, evaluation left in train mode), and end-to-end 2-rank CPU runs of the real probe that
must give the BN findings a reviewer would give (slow)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.bn.stats import relative_error, replay_running_stats
from ddpdoctor.findings import Severity
from ddpdoctor.probe.recorders import batchnorm
from ddpdoctor.probe.session import Probe
from ddpdoctor.probe.settings import ProbeSettings
from ddpdoctor.rundata import read_run

ROOT = Path(__file__).resolve().parents[1]
BN_SCRIPTS = ROOT / "fixtures" / "probe" / "bn"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 6 * 6, 5), nn.BatchNorm1d(5, momentum=None))
        self.lazy = nn.LazyBatchNorm1d()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lazy(self.head(F.relu(self.bn(self.conv(x)))))


@pytest.fixture
def recording(tmp_path):
    """A probe in this process with only the batchnorm recorder installed; yields (probe, run_dir) and ends
    the recording (end hooks, not end_run: that would leave the process) before the test reads the run."""
    settings = ProbeSettings(run_dir=str(tmp_path), epochs=0, steps=0)
    probe = Probe(settings, role="rank")
    probe.rank = 0
    batchnorm.install(probe)
    try:
        yield probe, tmp_path
    finally:
        probe.patcher.undo()


def _finish(probe: Probe) -> None:
    for hook in probe.end_hooks:
        hook()


def test_records_moments_modes_and_final_stats(recording):
    probe, run_dir = recording
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(6, 3, 6, 6) * 2 + 1 for _ in range(3)]
    seen: list[torch.Tensor] = []
    model.bn.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    for step, x in enumerate(batches):
        loss = model(x).square().mean()
        if step == 1:  # a second training forward in the same step (gradient accumulation)
            loss = loss + model(x).sum() * 0
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.steps += 1
        for hook in probe.step_hooks:
            hook(opt)
    with torch.no_grad():  # evaluation left in train mode (DD207)
        model(batches[0])
    model.eval()
    with torch.no_grad():
        model(batches[1])
    _finish(probe)

    run = read_run(run_dir)
    proc = run.processes[0]
    kinds = [e["kind"] for e in proc.events]
    assert kinds.count("bn_layer") == 3 and kinds.count("bn_final") == 1 and "bn_train_no_grad" in kinds
    layers = {e["name"]: e for e in proc.of("bn_layer")}
    assert set(layers) == {"bn", "head.2", "lazy"}
    assert layers["bn"]["bn_kind"] == "plain" and layers["bn"]["placed"] == "cpu"
    assert layers["head.2"]["momentum"] is None and layers["lazy"]["num_features"] == 5
    assert layers["lazy"]["initial"] is None  # a lazy layer has no buffers before its first forward
    assert layers["bn"]["site"]["line"] > 0 and layers["bn"]["site"]["file"] == __file__

    bn = bc.load_bn(run)
    layer = bn.by_name("bn")
    rl = layer.ranks[0]
    # 3 steps, 4 training forwards (two at step 1), then one no-grad training forward; eval forwards not kept
    assert [f.step for f in rl.forwards] == [0, 1, 1, 2, 3]
    assert [f.grad for f in rl.forwards] == [True, True, True, True, False]
    assert [f.k for f in rl.forwards] == [0, 0, 1, 0, 0] and [f.kg for f in rl.forwards] == [0, 0, 1, 0, None]
    assert rl.forwards[0].samples == 6 and rl.forwards[0].count == 6 * 36
    assert rl.modes == "TTTTtE"

    # the recorded moments are the layer input's: replaying plain BN from them gives the final running stats
    for name in ("bn", "head.2"):
        lr = bn.by_name(name)
        r0 = lr.ranks[0]
        counts = np.array([[f.count for f in r0.forwards]], dtype=float)
        rep = replay_running_stats(counts, np.array([[f.mean for f in r0.forwards]]),
                                   np.array([[f.var for f in r0.forwards]]), lr.momentum,
                                   running_mean=r0.initial_mean, running_var=r0.initial_var,
                                   num_batches_tracked=r0.initial_batches or 0)
        assert relative_error(rep.running_mean, r0.final_mean) < 1e-6
        assert relative_error(rep.running_var, r0.final_var) < 1e-6
        assert r0.final_batches == 5

    # the moments themselves: per-channel mean and biased variance of exactly the layer's input, to float64
    # accuracy (the recorder's two-pass reductions agree with var_mean on a float64 copy to ~1e-8 relative)
    for f, x in zip(rl.forwards, seen):
        var, mean = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
        assert np.allclose(f.mean, mean.numpy(), rtol=1e-9, atol=1e-12)
        assert np.allclose(f.var, var.numpy(), rtol=1e-7, atol=0)
    ev = next(e for e in proc.of("bn_step") if e["step"] == 0)
    vec = run.load_array(ev["moments"])
    assert vec.dtype == np.float64 and vec.size == 2 * (4 + 5 + 5)

    no_grad = proc.first("bn_train_no_grad")
    assert no_grad["direct"] is True and no_grad["bn_layers_in_train_mode"] == 3 and not no_grad["inference_mode"]
    final = proc.first("bn_final")
    assert final["no_grad_sites"][0]["forwards"] == 1
    assert {e["name"]: e["eval_forwards"] for e in final["layers"]}["bn"] == 1


@pytest.mark.parametrize("offset, scale", [(0.0, 1.0), (1000.0, 0.01), (-3.0, 1e-3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_channel_moments_match_float64(offset, scale, dtype):
    """Inputs far from zero relative to their spread are where naive sum/sum-of-squares fails."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 5, 7, 3, generator=g) * scale + offset).to(dtype)
    mean, var = batchnorm.channel_moments(x, torch)
    ref_var, ref_mean = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    assert mean.dtype == torch.float64 and var.dtype == torch.float64
    assert torch.allclose(mean, ref_mean, rtol=1e-9, atol=0)
    assert torch.allclose(var, ref_var, rtol=1e-6, atol=0)
    x1d = x.reshape(8, -1)[:, :5]  # BatchNorm1d on [N, C]
    m1, v1 = batchnorm.channel_moments(x1d, torch)
    rv, rm = torch.var_mean(x1d.double(), dim=0, correction=0)
    assert torch.allclose(m1, rm, rtol=1e-9) and torch.allclose(v1, rv, rtol=1e-6)


def test_library_recalibration_is_not_direct(recording):
    """torch.optim.swa_utils.update_bn runs BN in train mode under no_grad on purpose."""
    probe, run_dir = recording
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    loader = [torch.randn(8, 3) for _ in range(2)]
    torch.optim.swa_utils.update_bn(loader, model)
    _finish(probe)
    ev = read_run(run_dir).processes[0].first("bn_train_no_grad")
    assert ev is not None and ev["direct"] is False and ev["site"]["file"] == __file__


def test_recorder_does_not_change_what_the_model_computes(recording):
    probe, _ = recording
    torch.manual_seed(1)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 3, 6, 6)
    out_a = a(x)
    probe.patcher.undo()
    out_b = b(x)
    assert torch.equal(out_a, out_b)
    for ma, mb in zip(a.modules(), b.modules()):
        if isinstance(ma, nn.modules.batchnorm._BatchNorm):
            assert torch.equal(ma.running_mean, mb.running_mean) and torch.equal(ma.running_var, mb.running_var)


def test_moments_beyond_the_cap_are_counted_not_kept(recording, monkeypatch):
    probe, run_dir = recording
    monkeypatch.setattr(batchnorm, "FORWARDS_PER_STEP", 2)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    for _ in range(5):
        model(torch.randn(8, 3))
    _finish(probe)
    bn = bc.load_bn(read_run(run_dir))
    layer = bn.layers[0]
    assert len(layer.ranks[0].forwards) == 2 and layer.ranks[0].dropped == 3
    assert not layer.complete and bc.syncbn_replay(layer, bn.ranks) is None


# ------------------------------------------------------------------------------------------ end to end (slow)


def _check(script: Path, *args: str, tmp_path: Path):
    from ddpdoctor.check import run_check
    from ddpdoctor.config import CheckConfig

    cfg = CheckConfig(script=script, script_args=args, device="cpu", nproc=2, timeout=600,
                      keep_run=tmp_path / "run")
    return run_check(cfg)


def _by_rule(report) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in report.findings:
        out.setdefault(f.rule, []).append(f)
    return out


@pytest.mark.slow
def test_e2e_noniid_contiguous_shards_with_small_batches(tmp_path):
    report = _check(BN_SCRIPTS / "train_bn.py", "--batch-size", "8", "--shard", "contiguous", tmp_path=tmp_path)
    rules = _by_rule(report)
    assert "DD203" in rules and "DD202" in rules
    dd203 = rules["DD203"][0]
    assert dd203.severity == Severity.HIGH and dd203.evidence["p_value"] < 1e-3
    assert dd203.evidence["layer"] in ("bn", "block.bn1", "block.bn2")
    dd202 = rules["DD202"][0]
    assert dd202.evidence["per_rank_samples"] == {"0": 8, "1": 8} and dd202.evidence["global_samples"] == 16
    table = report.tables["batchnorm"]
    assert [row[0] for row in table["rows"]] == ["bn", "block.bn1", "block.bn2"]


@pytest.mark.slow
def test_e2e_local_bn_without_buffer_broadcast_diverges(tmp_path):
    report = _check(BN_SCRIPTS / "train_bn.py", "--no-broadcast-buffers", tmp_path=tmp_path)
    rules = _by_rule(report)
    dd201 = rules["DD201"][0]
    assert dd201.evidence["broadcast_buffers"] is False
    assert dd201.evidence["max_diff"] > 0.01 and "broadcast_buffers=False" in dd201.message
    assert "DD203" not in rules and "DD202" not in rules  # DistributedSampler shards, 32 per rank
    # with broadcast off each rank's running stats are its own EMA: replaying its own moments reproduces them
    bn = bc.load_bn(read_run(tmp_path / "run"))
    for layer in bn.layers:
        for r, rl in layer.ranks.items():
            counts = np.array([[f.count for f in rl.forwards]], dtype=float)
            rep = replay_running_stats(counts, np.array([[f.mean for f in rl.forwards]]),
                                       np.array([[f.var for f in rl.forwards]]), layer.momentum,
                                       running_mean=rl.initial_mean, running_var=rl.initial_var)
            assert relative_error(rep.running_var, rl.final_var) < 1e-5, (layer.name, r)


@pytest.mark.slow
def test_e2e_correct_syncbn_with_large_batch_is_low_only(tmp_path):
    report = _check(BN_SCRIPTS / "syncbn_large.py", tmp_path=tmp_path)
    rules = _by_rule(report)
    assert "DD204" in rules
    assert all(f.severity <= Severity.LOW for f in report.findings), [(f.rule, f.severity) for f in report.findings]
    dd204 = rules["DD204"][0]
    assert dd204.evidence["per_rank_samples"] == {"0": 128, "1": 128} and dd204.evidence["global_samples"] == 256
    noise = dd204.evidence["batch_noise_median"]
    assert noise["local_mean_noise"] > noise["global_mean_noise"] > 0
    # emulated SyncBN accumulated exactly what the replay of the per-rank moments says
    for name, errs in dd204.evidence["syncbn_replay_rel_error"].items():
        assert errs["running_mean"] < 1e-6 and errs["running_var"] < 1e-6, name


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
