"""Batch-norm statistics without torch: the non-i.i.d. shard test and SyncBN bookkeeping in numpy.

The probe's analyses (which must not import torch) and `compare-bn` both use this module.

The non-i.i.d. test asks: do the ranks' BN layers see inputs drawn from the same distribution? Its data are the
per-rank, per-step, per-channel means of each BN layer's input. Three facts shape the test:

1. Steps are the replicates, but the model and the data drift over steps (training moves the weights, epochs
   reshuffle), and that drift is common to all ranks. So the test blocks on the step: a two-way additive model
   `mean[r, s, c] = mu_c + step_c[s] + rank_c[r] + noise`, and an F-test of the rank effect against the
   residual (rank x step) variation. Within a step, ranks' batches drawn without replacement from one pool are
   exchangeable, which this blocking absorbs.
2. Per-rank batch sizes can differ (a short last batch): a mean over n values has variance sigma^2 / n, so the
   model is fitted by weighted least squares with weights = counts.
3. Channels of one layer (and layers of one network) are strongly correlated, so their p-values are combined with
   the Cauchy combination test (Liu & Xie 2020, "ACAT"), whose size stays at the nominal level under arbitrary
   dependence for small significance levels — unlike Fisher's method, which assumes independence and would fire
   on i.i.d. shards of a network with correlated channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import special as _special  # scipy.special, not scipy.stats: a third of the import time

__all__ = [
    "NONIID_METHOD",
    "NONIID_THRESHOLD",
    "ChannelTest",
    "LayerTest",
    "NonIIDResult",
    "RunningStats",
    "cauchy_combination",
    "combine_moments",
    "noniid_test",
    "rank_effect_test",
    "relative_error",
    "replay_running_stats",
]

NONIID_METHOD = (
    "per-channel two-way ANOVA F-test of the rank effect blocked on step (mean ~ step + rank, no interaction, "
    "weighted by per-rank counts); channels, then layers, combined by the Cauchy combination test "
    "(valid under dependence)"
)
NONIID_THRESHOLD = 1e-3
_DEGENERATE = 1e-20


@dataclass(frozen=True, kw_only=True)
class ChannelTest:
    """The rank-effect F-test of every channel of one layer (arrays over channels; nan where untestable)."""

    f: np.ndarray
    p: np.ndarray
    df_rank: int
    df_residual: int


@dataclass(frozen=True, kw_only=True)
class LayerTest:
    layer: str
    p_value: float | None
    statistic: float | None  # Cauchy combination statistic over the layer's channels
    channel: int | None  # the channel with the strongest rank effect
    channel_f: float | None
    channel_p: float | None
    df_rank: int
    df_residual: int
    channels_tested: int

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "p_value": _finite_or_none(self.p_value),
            "statistic": _finite_or_none(self.statistic),
            "channel": self.channel,
            "channel_f": _finite_or_none(self.channel_f),
            "channel_p": _finite_or_none(self.channel_p),
            "df": [self.df_rank, self.df_residual],
            "channels_tested": self.channels_tested,
        }


@dataclass(frozen=True, kw_only=True)
class NonIIDResult:
    """Outcome of `noniid_test`. `p_value` is None when the data cannot support a test (`reason` says why)."""

    method: str
    statistic: float | None
    p_value: float | None
    layer: str | None
    channel: int | None
    ranks: int
    steps: int
    layers: tuple[LayerTest, ...] = ()
    reason: str | None = None
    threshold: float = NONIID_THRESHOLD

    @property
    def non_iid(self) -> bool:
        return self.p_value is not None and self.p_value < self.threshold

    @property
    def layer_p_values(self) -> dict[str, float | None]:
        return {t.layer: t.p_value for t in self.layers}

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "statistic": _finite_or_none(self.statistic),
            "p_value": _finite_or_none(self.p_value),
            "threshold": self.threshold,
            "non_iid": self.non_iid,
            "layer": self.layer,
            "channel": self.channel,
            "ranks": self.ranks,
            "steps": self.steps,
            "reason": self.reason,
            "layers": [t.to_json() for t in self.layers],
        }


def _finite_or_none(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return None
    return x


def cauchy_combination(p_values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Combine p-values of arbitrarily dependent tests: returns (statistic T, combined p).

    T = mean(tan((0.5 - p_i) * pi)) is standard Cauchy under the null whatever the dependence (asymptotically in
    the tail), so p = P(Cauchy > T). Tiny p_i use tan((0.5 - p) pi) ~ 1 / (p pi) to stay finite; NaNs are ignored.
    """
    p = np.asarray(p_values, dtype=np.float64).ravel()
    p = p[~np.isnan(p)]
    if p.size == 0:
        return math.nan, math.nan
    if np.any(p <= 0.0):
        return math.inf, 0.0
    p = np.minimum(p, 1.0 - 1e-15)
    small = p < 1e-15
    t = np.empty_like(p)
    t[small] = 1.0 / (p[small] * math.pi)
    t[~small] = np.tan((0.5 - p[~small]) * math.pi)
    stat = float(np.mean(t))
    return stat, _cauchy_sf(stat)


def _cauchy_sf(t: float) -> float:
    """P(standard Cauchy > t), accurate in the far tail (arctan(1/t)/pi rather than 0.5 - arctan(t)/pi)."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    if t > 0:
        return math.atan(1.0 / t) / math.pi
    return 0.5 + math.atan(-t) / math.pi


def rank_effect_test(means: np.ndarray, counts: np.ndarray | None = None) -> ChannelTest:
    """Per-channel F-test of the rank effect in `means[rank, step, channel]`, blocked on step.

    Weighted least squares with weights `counts[rank, step]` (values or samples per rank and step; only their
    ratios matter). Cells with a zero count or non-finite means are missing. A channel whose means are explained
    by the step alone (identical across ranks) gets p = 1; one that ranks separate without any residual gets p = 0.
    """
    y = np.asarray(means, dtype=np.float64)
    if y.ndim != 3:
        raise ValueError(f"means must have shape [ranks, steps, channels], got {y.shape}")
    n_ranks, n_steps, n_channels = y.shape
    w = np.ones((n_ranks, n_steps)) if counts is None else np.asarray(counts, dtype=np.float64)
    if w.shape != (n_ranks, n_steps):
        raise ValueError(f"counts must have shape [ranks, steps] = {(n_ranks, n_steps)}, got {w.shape}")
    valid = (w > 0) & np.all(np.isfinite(y), axis=2)
    r_idx, s_idx = np.nonzero(valid)
    nan = np.full(n_channels, np.nan)
    if r_idx.size == 0:
        return ChannelTest(f=nan, p=nan, df_rank=0, df_residual=0)
    steps_used = np.unique(s_idx)
    ranks_used = np.unique(r_idx)
    step_cols = (s_idx[:, None] == steps_used[None, :]).astype(np.float64)
    rank_cols = (r_idx[:, None] == ranks_used[None, 1:]).astype(np.float64)
    reduced = step_cols
    full = np.hstack([step_cols, rank_cols])
    sw = np.sqrt(w[r_idx, s_idx] / w[r_idx, s_idx].mean())[:, None]
    yw = y[r_idx, s_idx, :] * sw

    def rss(design: np.ndarray) -> tuple[np.ndarray, int]:
        xw = design * sw
        coef, _, rank, _ = np.linalg.lstsq(xw, yw, rcond=None)
        resid = yw - xw @ coef
        return np.einsum("ij,ij->j", resid, resid), int(rank)

    rss_reduced, rank_reduced = rss(reduced)
    rss_full, rank_full = rss(full)
    df_rank = rank_full - rank_reduced
    df_resid = r_idx.size - rank_full
    if df_rank < 1 or df_resid < 1:
        return ChannelTest(f=nan, p=nan, df_rank=max(df_rank, 0), df_residual=max(df_resid, 0))
    scale = np.einsum("ij,ij->j", yw, yw) + 1e-300
    rss_reduced = np.maximum(rss_reduced, rss_full)
    explained = rss_reduced - rss_full
    f = np.full(n_channels, np.nan)
    p = np.full(n_channels, np.nan)
    no_rank_signal = explained <= _DEGENERATE * scale
    separated = ~no_rank_signal & (rss_full <= _DEGENERATE * rss_reduced)
    regular = ~no_rank_signal & ~separated
    f[no_rank_signal], p[no_rank_signal] = 0.0, 1.0
    f[separated], p[separated] = math.inf, 0.0
    f[regular] = (explained[regular] / df_rank) / (rss_full[regular] / df_resid)
    p[regular] = _special.fdtrc(df_rank, df_resid, f[regular])
    return ChannelTest(f=f, p=p, df_rank=df_rank, df_residual=df_resid)


def _layer_test(layer: str, means: np.ndarray, counts: np.ndarray | None) -> LayerTest:
    ct = rank_effect_test(means, counts)
    tested = ~np.isnan(ct.p)
    if not tested.any():
        return LayerTest(
            layer=layer, p_value=None, statistic=None, channel=None, channel_f=None, channel_p=None,
            df_rank=ct.df_rank, df_residual=ct.df_residual, channels_tested=0,
        )
    stat, p = cauchy_combination(ct.p[tested])
    idx = np.flatnonzero(tested)
    # strongest: smallest p, ties (p underflows to 0) broken by the larger F
    order = np.lexsort((-np.nan_to_num(ct.f[idx], posinf=np.inf), ct.p[idx]))
    best = int(idx[order[0]])
    return LayerTest(
        layer=layer,
        p_value=p,
        statistic=stat,
        channel=best,
        channel_f=float(ct.f[best]),
        channel_p=float(ct.p[best]),
        df_rank=ct.df_rank,
        df_residual=ct.df_residual,
        channels_tested=int(tested.sum()),
    )


def noniid_test(
    layer_means: Mapping[str, np.ndarray],
    counts: Mapping[str, np.ndarray] | np.ndarray | None = None,
    *,
    threshold: float = NONIID_THRESHOLD,
) -> NonIIDResult:
    """Are the ranks' BN inputs drawn from one distribution? See the module docstring for the design.

    `layer_means[layer]` has shape [ranks, steps, channels]; `counts` (one [ranks, steps] array for all layers,
    or one per layer) weights the cells. Returns the overall combined p-value, the most different layer and
    channel, and each layer's test.
    """
    if not layer_means:
        return NonIIDResult(method=NONIID_METHOD, statistic=None, p_value=None, layer=None, channel=None,
                            ranks=0, steps=0, reason="no BN layers", threshold=threshold)
    shapes = {np.asarray(m).shape[:2] for m in layer_means.values()}
    n_ranks, n_steps = max(shapes)
    reason = None
    if n_ranks < 2:
        reason = "needs at least 2 ranks"
    elif n_steps < 2:
        reason = "needs at least 2 steps (steps are the replicates)"
    if reason:
        return NonIIDResult(method=NONIID_METHOD, statistic=None, p_value=None, layer=None, channel=None,
                            ranks=n_ranks, steps=n_steps, reason=reason, threshold=threshold)
    tests = []
    for name, means in layer_means.items():
        c = counts.get(name) if isinstance(counts, Mapping) else counts
        tests.append(_layer_test(name, np.asarray(means), None if c is None else np.asarray(c)))
    usable = [t for t in tests if t.p_value is not None]
    if not usable:
        return NonIIDResult(method=NONIID_METHOD, statistic=None, p_value=None, layer=None, channel=None,
                            ranks=n_ranks, steps=n_steps, layers=tuple(tests), threshold=threshold,
                            reason="not enough complete (rank, step) cells for a residual estimate")
    stat, p = cauchy_combination([t.p_value for t in usable])
    strongest = min(usable, key=lambda t: (t.p_value, -(t.statistic or 0.0)))
    return NonIIDResult(
        method=NONIID_METHOD,
        statistic=stat,
        p_value=p,
        layer=strongest.layer,
        channel=strongest.channel,
        ranks=n_ranks,
        steps=n_steps,
        layers=tuple(tests),
        threshold=threshold,
    )


def relative_error(estimate: np.ndarray | Sequence[float], reference: np.ndarray | Sequence[float]) -> float:
    """||estimate - reference|| / ||reference|| over channels (L2). 0 when both are zero, inf when only the
    reference is."""
    est = np.asarray(estimate, dtype=np.float64).ravel()
    ref = np.asarray(reference, dtype=np.float64).ravel()
    if est.shape != ref.shape:
        raise ValueError(f"shapes differ: {est.shape} vs {ref.shape}")
    num = float(np.linalg.norm(est - ref))
    den = float(np.linalg.norm(ref))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def combine_moments(
    counts: np.ndarray | Sequence[float], means: np.ndarray, variances: np.ndarray
) -> tuple[float, np.ndarray, np.ndarray]:
    """Pool per-rank moments exactly (Chan's parallel formula): returns (total count, mean, biased variance).

    `counts[r]` values per channel on rank r, `means[r, c]`, `variances[r, c]` the biased (divide-by-n) variance.
    Ranks with a zero count drop out. This is the arithmetic SyncBN does on the gathered statistics.
    """
    n = np.asarray(counts, dtype=np.float64).reshape(-1)
    m = np.asarray(means, dtype=np.float64).reshape(n.size, -1)
    v = np.asarray(variances, dtype=np.float64).reshape(n.size, -1)
    keep = n > 0
    n, m, v = n[keep], m[keep], v[keep]
    total = float(n.sum())
    if total == 0:
        nan = np.full(np.asarray(means).shape[-1], np.nan)
        return 0.0, nan, nan
    mean = (n[:, None] * m).sum(0) / total
    m2 = (n[:, None] * v).sum(0) + (n[:, None] * (m - mean) ** 2).sum(0)
    return total, mean, m2 / total


@dataclass(frozen=True, kw_only=True)
class RunningStats:
    running_mean: np.ndarray
    running_var: np.ndarray
    num_batches_tracked: int
    history: tuple[tuple[np.ndarray, np.ndarray], ...] = field(default=(), compare=False)


def replay_running_stats(
    counts: np.ndarray,
    means: np.ndarray,
    variances: np.ndarray,
    momentum: float | None,
    *,
    running_mean: np.ndarray | None = None,
    running_var: np.ndarray | None = None,
    num_batches_tracked: int = 0,
    keep_history: bool = False,
) -> RunningStats:
    """The running statistics SyncBN accumulates from per-rank batch moments, step by step.

    `counts[rank, step]` (values per channel: batch x spatial), `means`/`variances[rank, step, channel]` (biased
    per-rank variance of the layer input). Each step pools the ranks with `combine_moments` and applies PyTorch's
    update: `running = (1 - f) running + f stat`, with `f = momentum`, or `1 / num_batches_tracked` when momentum
    is None (cumulative average), and the *unbiased* variance with the global count for running_var. A step
    where every rank is empty increments num_batches_tracked and changes nothing else, like plain BN.
    Pass a single rank (`counts[r:r+1]`, ...) to replay what that rank's local BN accumulates.
    """
    n = np.asarray(counts, dtype=np.float64)
    m = np.asarray(means, dtype=np.float64)
    v = np.asarray(variances, dtype=np.float64)
    if n.ndim != 2 or m.ndim != 3 or v.shape != m.shape or m.shape[:2] != n.shape:
        raise ValueError("expected counts [ranks, steps], means and variances [ranks, steps, channels]")
    channels = m.shape[2]
    rm = np.zeros(channels) if running_mean is None else np.asarray(running_mean, dtype=np.float64).copy()
    rv = np.ones(channels) if running_var is None else np.asarray(running_var, dtype=np.float64).copy()
    nbt = int(num_batches_tracked)
    history = []
    for step in range(n.shape[1]):
        nbt += 1
        factor = 1.0 / nbt if momentum is None else float(momentum)
        total, mean, var = combine_moments(n[:, step], m[:, step], v[:, step])
        if total > 0:
            if total <= 1:
                raise ValueError(f"step {step}: a global batch of 1 value per channel has no unbiased variance")
            rm = (1.0 - factor) * rm + factor * mean
            rv = (1.0 - factor) * rv + factor * var * total / (total - 1.0)
        if keep_history:
            history.append((rm.copy(), rv.copy()))
    return RunningStats(running_mean=rm, running_var=rv, num_batches_tracked=nbt, history=tuple(history))
