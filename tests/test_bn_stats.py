"""`ddpdoctor.bn.stats`: calibration of the non-i.i.d. test across many synthetic seeds, its power on
label-sorted shards, and the SyncBN bookkeeping helpers checked against torch's batch norm."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ddpdoctor.bn.stats import (
    NONIID_METHOD,
    cauchy_combination,
    combine_moments,
    noniid_test,
    rank_effect_test,
    relative_error,
    replay_running_stats,
)


def _null_layers(rng, *, ranks, steps, channels, layers, rho, noise="normal", uneven=False, drift=3.0):
    """Per-rank per-step channel means of i.i.d. shards: a drift over steps shared by every rank (the model
    changes), channels correlated through a common factor (rho), per-cell noise ~ 1/sqrt(count)."""
    counts = np.full((ranks, steps), 16.0)
    if uneven:
        counts[:, -1] = rng.integers(2, 16, size=ranks)
    out = {}
    for i in range(layers):
        common_drift = rng.normal(0, drift, size=(1, steps, channels)).cumsum(axis=1)
        if noise == "t3":
            shared, own = rng.standard_t(3, size=(ranks, steps, 1)), rng.standard_t(3, size=(ranks, steps, channels))
        elif noise == "exp":
            shared, own = rng.exponential(size=(ranks, steps, 1)), rng.exponential(size=(ranks, steps, channels))
        else:
            shared, own = rng.normal(size=(ranks, steps, 1)), rng.normal(size=(ranks, steps, channels))
        cell = (np.sqrt(rho) * shared + np.sqrt(1 - rho) * own) / np.sqrt(counts[..., None] / 16.0)
        out[f"layer{i}"] = 5.0 + common_drift + 0.3 * cell
    return out, counts


NULL_CONFIGS = [
    dict(ranks=2, steps=20, channels=16, layers=2, rho=0.9),
    dict(ranks=2, steps=6, channels=32, layers=2, rho=0.99, noise="t3", uneven=True),
    dict(ranks=4, steps=10, channels=8, layers=2, rho=0.5, noise="exp", uneven=True, drift=50.0),
]


@pytest.mark.parametrize("config", NULL_CONFIGS, ids=["2x20-normal", "2x6-t3-uneven", "4x10-skewed-bigdrift"])
def test_silent_on_iid_shards_across_seeds(config):
    """False alarms at p < 1e-3 stay well below 1%, and p is close to uniform (5% at 0.05)."""
    seeds = 600
    p = np.array(
        [noniid_test(*_null_layers(np.random.default_rng(seed), **config)).p_value for seed in range(seeds)]
    )
    assert (p < 1e-3).mean() <= 0.005
    assert 0.025 <= (p < 0.05).mean() <= 0.08
    assert 0.3 <= np.median(p) <= 0.7


def test_identical_channels_do_not_inflate_false_alarms():
    """64 copies of one channel: Fisher's method would count the same evidence 64 times; the Cauchy
    combination of identical p-values returns that p-value."""
    hits = 0
    for seed in range(300):
        rng = np.random.default_rng(10_000 + seed)
        base = rng.normal(size=(2, 8, 1)) + rng.normal(size=(1, 8, 1)).cumsum(1)
        res = noniid_test({"bn": np.repeat(base, 64, axis=2)})
        single = rank_effect_test(base).p[0]
        assert res.p_value == pytest.approx(single, rel=1e-6)
        hits += res.p_value < 0.05
    assert 5 <= hits <= 30  # ~5% of 300


def _sorted_shard_layers(rng, *, ranks=2, steps=20, channels=16, shift=1.0):
    """Ranks hold label-sorted slices: each rank's batch means are offset by a rank-specific class mixture."""
    layers, counts = _null_layers(rng, ranks=ranks, steps=steps, channels=channels, layers=3, rho=0.8)
    for name in layers:
        offset = shift * 0.3 * rng.normal(size=(ranks, 1, channels))
        layers[name] = layers[name] + offset
    return layers, counts


def test_fires_on_sorted_shards():
    p = [noniid_test(*_sorted_shard_layers(np.random.default_rng(seed), shift=2.0)).p_value for seed in range(50)]
    assert max(p) < 1e-3


def test_names_the_most_different_layer_and_channel():
    rng = np.random.default_rng(7)
    layers, counts = _null_layers(rng, ranks=3, steps=12, channels=10, layers=3, rho=0.5)
    layers["layer1"][2, :, 4] += 1.5  # rank 2, channel 4 of layer1 only
    res = noniid_test(layers, counts)
    assert res.non_iid and res.p_value < 1e-6
    assert (res.layer, res.channel) == ("layer1", 4)
    assert res.layer_p_values["layer1"] < 1e-6
    assert res.method == NONIID_METHOD and "Cauchy" in res.method and "blocked on step" in res.method
    doc = json.loads(json.dumps(res.to_json(), allow_nan=False))
    assert doc["layer"] == "layer1" and doc["non_iid"] is True and len(doc["layers"]) == 3


def test_step_drift_alone_is_not_a_rank_effect():
    """Without blocking, a huge drift shared by all ranks would swamp the noise; blocked, it cancels exactly."""
    rng = np.random.default_rng(3)
    drift = np.linspace(0, 1000, 15)[None, :, None]
    noise = rng.normal(size=(2, 15, 4))
    assert noniid_test({"bn": drift + noise}).p_value > 1e-3
    # the same data with rank labels shuffled within a step is equally unremarkable
    assert noniid_test({"bn": drift + noise[::-1]}).p_value > 1e-3


def test_degenerate_inputs():
    steps = np.arange(6, dtype=float)[None, :, None]
    same = np.repeat(steps, 2, axis=0) * np.ones((2, 6, 3))
    assert noniid_test({"bn": same}).p_value == pytest.approx(1.0)  # ranks saw identical data: no rank effect
    separated = same + np.array([0.0, 1.0])[:, None, None]
    res = noniid_test({"bn": separated})
    assert res.p_value == 0.0 and res.non_iid  # ranks differ by a constant and nothing else
    one_rank = noniid_test({"bn": np.zeros((1, 5, 3))})
    assert one_rank.p_value is None and "2 ranks" in one_rank.reason
    one_step = noniid_test({"bn": np.zeros((2, 1, 3))})
    assert one_step.p_value is None and "2 steps" in one_step.reason
    assert noniid_test({}).p_value is None


def test_missing_cells_are_dropped():
    rng = np.random.default_rng(5)
    means = rng.normal(size=(2, 10, 4))
    counts = np.full((2, 10), 8.0)
    counts[1, 3] = 0  # rank 1 had an empty batch at step 3
    means[1, 3] = np.nan
    t = rank_effect_test(means, counts)
    assert t.df_rank == 1 and t.df_residual == 19 - (10 + 1)  # 19 cells; 10 step columns + 1 rank column
    assert np.all((t.p > 0) & (t.p <= 1))


def test_weights_follow_counts():
    """A mean over few samples is noisy: weighting cells by their counts keeps one tiny last batch from hiding a
    rank effect that every full batch shows."""
    rng = np.random.default_rng(11)
    counts = np.full((2, 8), 1000.0)
    counts[0, 0] = 1.0
    means = rng.normal(scale=0.01, size=(2, 8, 3)) + np.array([0.0, 0.05])[:, None, None]
    means[0, 0] += 0.3 * np.sqrt(1000.0) * 0.01 * np.array([3.0, -3.0, 3.0])  # 1-sample cell: large noise
    weighted = rank_effect_test(means, counts).p
    unweighted = rank_effect_test(means).p
    assert weighted.max() < 1e-4
    assert unweighted.min() > 1e-2
    # only ratios of counts matter
    np.testing.assert_allclose(rank_effect_test(means, counts * 7.0).p, weighted, rtol=1e-9)


def test_cauchy_combination():
    assert cauchy_combination([0.5]) == (0.0, 0.5)
    stat, p = cauchy_combination([0.2, 0.2, 0.2])
    assert p == pytest.approx(0.2)
    assert cauchy_combination([0.0, 0.9])[1] == 0.0
    _, tiny = cauchy_combination([1e-30, 0.5, 0.5])
    assert tiny == pytest.approx(1e-30 / 3, rel=1e-6)
    assert cauchy_combination([1.0, 1.0])[1] > 0.99


def test_relative_error():
    assert relative_error([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert relative_error([1.1, 2.0], [1.0, 2.0]) == pytest.approx(0.1 / np.sqrt(5))
    assert relative_error([0.0], [0.0]) == 0.0
    assert relative_error([1.0], [0.0]) == float("inf")
    with pytest.raises(ValueError):
        relative_error([1.0], [1.0, 2.0])


def test_combine_moments_is_exact_with_offsets():
    rng = np.random.default_rng(0)
    parts = [1000.0 + rng.normal(size=(n, 3)) for n in (3, 5, 1)]
    counts = [len(p) for p in parts] + [0]
    means = [p.mean(0) for p in parts] + [np.full(3, np.nan)]
    var = [p.var(0) for p in parts] + [np.full(3, np.nan)]
    total, mean, v = combine_moments(counts, np.array(means), np.array(var))
    allx = np.concatenate(parts)
    assert total == 9
    np.testing.assert_allclose(mean, allx.mean(0), rtol=1e-14)
    np.testing.assert_allclose(v, allx.var(0), rtol=1e-10)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_replay_matches_torch_batch_norm(momentum):
    """Replaying per-rank moments gives exactly what BatchNorm over the concatenated batch accumulates (SyncBN),
    and replaying one rank gives what that rank's local BN accumulates."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    sizes = [(3, 5), (1, 7), (0, 6), (4, 4)]  # per step, per rank; an empty rank at step 2
    channels = 4
    glob = torch.nn.BatchNorm2d(channels, momentum=momentum).double()
    local = torch.nn.BatchNorm2d(channels, momentum=momentum).double()
    counts = np.zeros((2, len(sizes)))
    means = np.full((2, len(sizes), channels), np.nan)
    variances = np.full((2, len(sizes), channels), np.nan)
    for s, (a, b) in enumerate(sizes):
        x = 50 + 3 * torch.randn(a + b, channels, 2, 3, generator=g, dtype=torch.float64)
        glob(x)
        local(x[:a])
        for r, part in enumerate((x[:a], x[a:])):
            counts[r, s] = part.shape[0] * 6
            if part.shape[0]:
                means[r, s] = part.mean((0, 2, 3)).numpy()
                variances[r, s] = part.var((0, 2, 3), unbiased=False).numpy()
    replay = replay_running_stats(counts, means, variances, momentum)
    np.testing.assert_allclose(replay.running_mean, glob.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(replay.running_var, glob.running_var.numpy(), rtol=1e-12)
    assert replay.num_batches_tracked == int(glob.num_batches_tracked) == len(sizes)
    rank0 = replay_running_stats(counts[:1], means[:1], variances[:1], momentum)
    np.testing.assert_allclose(rank0.running_mean, local.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(rank0.running_var, local.running_var.numpy(), rtol=1e-12)


def test_replay_history_and_start_values():
    counts = np.array([[4.0, 4.0]])
    means = np.array([[[1.0], [3.0]]])
    variances = np.array([[[0.75], [0.75]]])
    r = replay_running_stats(counts, means, variances, 0.5, running_mean=np.array([2.0]),
                             running_var=np.array([2.0]), num_batches_tracked=10, keep_history=True)
    assert r.num_batches_tracked == 12
    np.testing.assert_allclose(r.history[0][0], [1.5])
    np.testing.assert_allclose(r.running_mean, [2.25])
    np.testing.assert_allclose(r.running_var, [0.5 * (0.5 * 2.0 + 0.5) + 0.5])


def test_stats_modules_do_not_import_torch():
    """Analyses import ddpdoctor.bn.stats; compare-bn's parent process must stay torch-free too."""
    code = (
        "import sys, ddpdoctor.bn, ddpdoctor.bn.stats, ddpdoctor.bn.plan, ddpdoctor.comparebn.compare; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
