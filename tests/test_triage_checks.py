"""The numerical checks behind `ddpdoctor triage`, in process (fast): the applied-statistics check (DD211) against
random float32 cases, the effective-sample-count estimate, the conversion-equivalence check (DD208) on plain-BN
models of ResNet and MobileNet shape and on a fused subclass, and the arm switches on real modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpdoctor.analyses.bn_checks import applied_statistics, chan, effective_samples
from ddpdoctor.probe import arms
from ddpdoctor.probe.recorders import bn_conversion
from ddpdoctor.probe.recorders.bn_applied import io_moments
from ddpdoctor.probe.session import Probe
from ddpdoctor.probe.settings import ProbeSettings

# ------------------------------------------------------------------------------------------ applied statistics


def _random_case(seed: int):
    """Per-rank float32 inputs of unequal sizes (an empty spatial extent, 1-3 spatial dims, offsets up to 1000,
    scales over six decades), weights including exact zeros and values near zero, eps 1e-5 or 1e-3."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    world, channels = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    spatial = [int(rng.integers(1, 6)) for _ in range(int(rng.integers(0, 3)))]
    sizes = [int(rng.integers(1, 40)) for _ in range(world)]
    view = (1, -1, *([1] * len(spatial)))
    offset = torch.tensor(rng.choice([0, 1, 10, 1000], size=channels) * rng.normal(size=channels), dtype=torch.float32)
    scale = torch.tensor(10 ** rng.uniform(-3, 3, size=channels), dtype=torch.float32)
    xs = []
    for r in range(world):
        shift = torch.tensor(rng.normal(size=channels) * rng.choice([0, 0.5, 3]), dtype=torch.float32)
        x = torch.randn(sizes[r], channels, *spatial, generator=g) * scale.view(view)
        x = x + (offset + shift * scale).view(view)
        xs.append(x)
    w = torch.tensor(rng.normal(size=channels) * rng.choice([1, 1e-3, 1e-7], size=channels), dtype=torch.float32)
    w[torch.tensor(rng.random(channels) < 0.15)] = 0.0
    b = torch.tensor(rng.normal(size=channels) * 2, dtype=torch.float32)
    eps = float(rng.choice([1e-5, 1e-3]))
    return xs, w, b, eps


def _syncbn_outputs(xs, w, b, eps, combine="exact"):
    """Each rank's output as ddpdoctor's SyncBN computes it (float32 var_mean per rank, Chan in float64, the
    normalisation in float32) — or with the statistics combined another way."""
    channels = xs[0].shape[1]
    counts, means, variances = [], [], []
    for x in xs:
        v, m = torch.var_mean(x, dim=[0, *range(2, x.dim())], correction=0)
        counts.append(x.numel() // channels)
        means.append(m.double().numpy())
        variances.append(v.double().numpy())
    _, mean, var = chan(np.array(counts, dtype=float), np.stack(means), np.stack(variances))
    if combine == "equal":  # equal-weight average of the ranks' statistics (a naive SyncBN)
        mean, var = np.mean(np.stack(means), 0), np.mean(np.stack(variances), 0)
    elif isinstance(combine, tuple):  # an explicit bias: (mean shift in std, relative change of var + eps)
        mean = mean + combine[0] * np.sqrt(var + eps)
        var = (var + eps) * (1 + combine[1]) - eps
    mean32, invstd = torch.tensor(mean).float(), torch.rsqrt(torch.tensor(var) + eps).float()
    outs = []
    for x in xs:
        v = (1, -1, *([1] * (x.dim() - 2)))
        outs.append((x - mean32.view(v)) * invstd.view(v) * w.view(v) + b.view(v))
    return outs, mean, var


def _check(xs, ys, w, b, eps):
    """Run the check on each rank's recorded moments against the exact statistics of all ranks."""
    moments = [[t.numpy() for t in io_moments(x, y)] for x, y in zip(xs, ys)]
    counts = np.array([x.numel() // x.shape[1] for x in xs], dtype=float)
    _, mean, var = chan(counts, np.stack([m[0] for m in moments]), np.stack([m[1] for m in moments]))
    results = []
    for x, (mx, vx, my, vy, cxy) in zip(xs, moments):
        results.append(applied_statistics(count=x.numel() // x.shape[1], mx=mx, vx=vx, my=my, vy=vy, cxy=cxy,
                                          w=w.double().numpy(), b=b.double().numpy(), eps=eps, mean=mean, var=var))
    return results


def test_applied_statistics_no_false_alarm_over_200_random_float32_cases():
    alarms, measured, worst = [], 0, 0.0
    for seed in range(200):
        xs, w, b, eps = _random_case(seed)
        ys, _, _ = _syncbn_outputs(xs, w, b, eps)
        for chk in _check(xs, ys, w, b, eps):
            measured += int(chk.measurable.sum())
            worst = max(worst, float(chk.z.max()))
            if (chk.z > 1).any():
                alarms.append(seed)
    assert alarms == []
    assert worst < 0.25  # a wide margin under the tolerance
    assert measured > 300  # and the check does measure: not everything is excused as unmeasurable


def test_applied_statistics_with_torch_batch_norm_on_one_rank():
    """torch's own CPU kernel (F.batch_norm in training mode) is exact too."""
    for seed in range(50):
        xs, w, b, eps = _random_case(seed)
        x = torch.cat(xs) if xs[0].dim() > 1 else xs[0]
        y = F.batch_norm(x, None, None, w, b, True, 0.0, eps)
        for chk in _check([x], [y], w, b, eps):
            assert not (chk.z > 1).any(), seed


@pytest.mark.parametrize("bias", [(0.005, 0.0), (0.0, 0.005), (-0.005, -0.005)])
def test_applied_statistics_detects_a_half_percent_bias(bias):
    for seed in range(200):
        xs, w, b, eps = _random_case(seed)
        ys, _, _ = _syncbn_outputs(xs, w, b, eps, combine=bias)
        checks = _check(xs, ys, w, b, eps)
        if any(c.measurable.any() for c in checks):
            assert any((c.z[c.measurable] > 1).any() for c in checks), seed


def test_applied_statistics_detects_equal_weight_averaging_of_unequal_batches():
    """Equal-weight averaging biased by 0.5% or more on a measurable channel is always detected."""
    detected = tested = 0
    for seed in range(400):
        xs, w, b, eps = _random_case(seed)
        if len(xs) < 2 or len({x.shape[0] for x in xs}) < 2:
            continue
        ys, mean_eq, var_eq = _syncbn_outputs(xs, w, b, eps, combine="equal")
        _, mean, var = _syncbn_outputs(xs, w, b, eps)
        big = ((np.abs(mean_eq - mean) / np.sqrt(var + eps) >= 0.005)
               | (np.abs((var_eq + eps) / (var + eps) - 1) >= 0.005))
        checks = _check(xs, ys, w, b, eps)
        hit = np.zeros_like(big)
        meas = np.zeros_like(big)
        for c in checks:
            hit |= c.z > 1
            meas |= c.measurable
        if (big & meas).any():
            tested += 1
            detected += int(hit.any())
    assert tested >= 20 and detected == tested


def test_applied_statistics_recovers_the_bias_it_reports():
    xs, w, b, eps = _random_case(3)
    w = torch.ones_like(w)
    ys, _, _ = _syncbn_outputs(xs, w, b, eps, combine=(0.02, 0.04))
    chk = _check(xs, ys, w, b, eps)[0]
    ok = chk.measurable
    assert ok.any()
    assert np.allclose(chk.mean_error[ok], 0.02, atol=1e-4)
    assert np.allclose(chk.var_error[ok], 0.04, atol=1e-4)


def test_a_fused_activation_is_not_affine_and_not_measured():
    xs, w, b, eps = _random_case(5)
    w = torch.ones_like(w)
    ys, _, _ = _syncbn_outputs(xs, w, b, eps)
    ys = [F.relu(y) for y in ys]
    for chk in _check(xs, ys, w, b, eps):
        assert not chk.affine[chk.measurable | ~chk.affine].all() or not chk.measurable.any()


# ------------------------------------------------------------------------------------------ effective samples


def _moments_of(batches):
    samples, total, between = [], [], []
    for x in batches:
        xd = x.double()
        per_sample = xd.mean(dim=list(range(2, xd.dim()))) if xd.dim() > 2 else xd
        samples.append(x.shape[0])
        total.append(xd.var(dim=[0, *range(2, xd.dim())], unbiased=False).numpy())
        between.append(per_sample.var(dim=0, unbiased=True).numpy())
    return np.array(samples), np.stack(total), np.stack(between)


@pytest.mark.parametrize("b,h,w", [(16, 8, 8), (8, 4, 4), (32, 2, 3), (4, 12, 12)])
def test_effective_samples_spatially_independent_is_b_h_w(b, h, w):
    g = torch.Generator().manual_seed(b * 100 + h)
    batches = [torch.randn(b, 8, h, w, generator=g) * 3 + 1 for _ in range(20)]
    n_eff = np.median(effective_samples(*_moments_of(batches)))
    assert abs(n_eff / (b * h * w) - 1) < 0.2


@pytest.mark.parametrize("b,h,w", [(16, 8, 8), (8, 4, 4), (32, 1, 1), (4, 6, 6)])
def test_effective_samples_spatially_constant_is_b(b, h, w):
    g = torch.Generator().manual_seed(b + h)
    batches = [torch.randn(b, 8, 1, 1, generator=g).expand(b, 8, h, w) * 2 - 3 for _ in range(20)]
    n_eff = np.median(effective_samples(*_moments_of(batches)))
    assert abs(n_eff / b - 1) < 0.2


def test_effective_samples_of_2d_inputs_is_b():
    g = torch.Generator().manual_seed(0)
    n_eff = np.median(effective_samples(*_moments_of([torch.randn(24, 6, generator=g) for _ in range(20)])))
    assert abs(n_eff / 24 - 1) < 0.2


# ------------------------------------------------------------------------------------------ equivalence (DD208)


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.down(x))


def resnet_like():
    return nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         BasicBlock(8, 8, 1), BasicBlock(8, 16, 2), BasicBlock(16, 32, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10), nn.BatchNorm1d(10))


def mobilenet_like():
    def dw(c_in, c_out, stride):
        return nn.Sequential(nn.Conv2d(c_in, c_in, 3, stride, 1, groups=c_in, bias=False), nn.BatchNorm2d(c_in),
                             nn.ReLU6(), nn.Conv2d(c_in, c_out, 1, bias=False),
                             nn.BatchNorm2d(c_out, eps=1e-3, momentum=0.01), nn.ReLU6())
    return nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(), dw(8, 16, 1),
                         dw(16, 24, 2), dw(24, 24, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 5))


class BatchNormReLU2d(nn.BatchNorm2d):
    def forward(self, x):
        return F.relu(super().forward(x))


@pytest.fixture
def conversion_probe(tmp_path):
    """A probe in this process with the arm switches and the conversion recorder; yields (probe, run_dir)."""
    probe = Probe(ProbeSettings(run_dir=str(tmp_path), epochs=0, steps=0), role="rank")
    probe.rank = 0
    try:
        arms.install_early(probe)
        bn_conversion.install(probe)
        yield probe, tmp_path
    finally:
        probe.patcher.undo()


def _conversions(probe, run_dir):
    from ddpdoctor.rundata import read_run

    for hook in probe.end_hooks:
        hook()
    run = read_run(run_dir)
    return [e for p in run.processes for e in p.of("bn_conversion")]


@pytest.mark.parametrize("make", [resnet_like, mobilenet_like])
def test_equivalence_no_false_alarm_on_plain_bn_models(conversion_probe, make):
    probe, run_dir = conversion_probe
    for seed in range(3):
        torch.manual_seed(seed)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(make())
        for m in model.modules():  # non-trivial weights and running statistics
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                with torch.no_grad():
                    m.weight.uniform_(-2, 2)
                    m.bias.normal_()
                    m.running_mean.normal_()
                    m.running_var.uniform_(0.1, 3)
        model.train()
        model(torch.randn(6, 3, 16, 16) * 2 + 0.5)
    events = _conversions(probe, run_dir)
    assert events and all(e["equivalence"]["status"] == "measured" for e in events)
    assert all(e["equivalence"]["equal"] for e in events), [e["name"] for e in events if not e["equivalence"]["equal"]]


def test_equivalence_catches_a_fused_activation_dropped_by_torch(conversion_probe):
    probe, run_dir = conversion_probe
    model = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormReLU2d(4), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model(torch.randn(4, 3, 10, 10))
    by_name = {e["child"]: e for e in _conversions(probe, run_dir)}
    assert by_name["1"]["equivalence"]["equal"] is False
    assert by_name["1"]["before"]["own_forward"].endswith("BatchNormReLU2d")
    assert by_name["3"]["equivalence"]["equal"] is True


def test_conversion_records_lost_flags_and_cloned_parameters(conversion_probe):
    probe, run_dir = conversion_probe
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3, momentum=0.01))
    model[1].eval()
    model[1].weight.requires_grad_(False)
    fresh = nn.SyncBatchNorm(4)
    fresh.weight = nn.Parameter(model[1].weight.detach().clone())
    model[1] = fresh
    events = _conversions(probe, run_dir)
    (e,) = events
    assert e["before"]["momentum"] == 0.01 and e["after"]["momentum"] == 0.1
    assert e["before"]["weight_requires_grad"] is False and e["after"]["weight_requires_grad"] is True
    assert e["before"]["training"] is False and e["after"]["training"] is True
    assert e["same_params"]["weight"] is False


# ------------------------------------------------------------------------------------------ arm switches


def _probe(tmp_path, **settings):
    probe = Probe(ProbeSettings(run_dir=str(tmp_path), epochs=0, steps=0, **settings), role="rank")
    probe.rank = 0
    return probe


def test_plain_arm_undoes_torch_and_custom_converters_and_direct_syncbn(tmp_path):
    probe = _probe(tmp_path, arm="P", bn_mode="plain")
    try:
        arms.install_early(probe)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
        original = model[1]
        assert nn.SyncBatchNorm.convert_sync_batchnorm(model) is model and model[1] is original
        model[3] = nn.SyncBatchNorm(4)  # a hand-written converter's replacement of a plain layer: refused
        assert type(model[3]) is nn.BatchNorm1d
        direct = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4))  # built directly: plain BatchNorm
        assert type(direct[1]) is nn.BatchNorm2d
        weight = direct[1].weight
        direct(torch.randn(2, 3, 6, 6))
        flat = nn.Sequential(nn.Linear(3, 5), nn.SyncBatchNorm(5))
        flat(torch.randn(4, 3))
        assert type(flat[1]) is nn.BatchNorm1d and direct[1].weight is weight
    finally:
        probe.patcher.undo()
    assert isinstance(nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(2)))[0], nn.SyncBatchNorm)


def test_local_arm_normalises_syncbn_with_rank_statistics(tmp_path):
    probe = _probe(tmp_path, arm="L", bn_mode="local")
    x = torch.randn(8, 4, 5, 5) * 3 + 2
    try:
        arms.install_early(probe)
        layer = nn.SyncBatchNorm(4)
        expected = F.batch_norm(x, None, None, layer.weight, layer.bias, True, 0.0, layer.eps)
        assert torch.equal(layer(x), expected)
    finally:
        probe.patcher.undo()


def test_no_collectives_refuses_inside_checks_only(tmp_path):
    import torch.distributed as dist

    probe = _probe(tmp_path)
    try:
        arms.install_early(probe)
        with arms.no_collectives(), pytest.raises(arms.CollectiveInCheck):
            dist.all_reduce(torch.zeros(1))
        with pytest.raises((RuntimeError, ValueError)) as info:  # outside: torch's own error (no process group)
            dist.all_reduce(torch.zeros(1))
        assert not isinstance(info.value, arms.CollectiveInCheck)
    finally:
        probe.patcher.undo()
