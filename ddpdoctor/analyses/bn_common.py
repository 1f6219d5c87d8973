"""BatchNorm data of a recorded run, assembled once for the BN analyses (DD201–DD207) and the BN table.

Pure functions of the event logs (numpy only; the statistics come from `ddpdoctor.bn.stats`). The batchnorm
recorder writes, per rank, `bn_layer` (one per layer), `bn_step` (the training-mode forwards of each step with
their per-channel input moments in a blob) and `bn_final` (the running statistics at the end); `load_bn` turns
them into one `BNRun`: layers by name, each with its per-rank forwards in call order.

Two alignments of forwards across ranks are used:
- *blocks* for the non-i.i.d. test and the noise estimates: the k-th gradient-enabled training forward of a layer
  within optimizer step s, on every rank (steps are the replicates; the model is shared at a step);
- *updates* for the SyncBN replay: the k-th training-mode forward (with or without grad — both update running
  statistics, and SyncBN would synchronise in both) within step s.

Size: one module (~600 lines) because every BN rule reads the same parsed run and its two alignments, memoised
once per run; the rule-specific parts (the BN table, each rule's thresholds) live in the rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddpdoctor.bn.stats import RunningStats, combine_moments, relative_error, replay_running_stats
from ddpdoctor.rundata import RunData


@dataclass
class Forward:
    """One training-mode forward of a layer on one rank."""

    step: int
    k: int  # index among this layer's training-mode forwards of the step (update alignment)
    kg: int | None  # index among its gradient-enabled forwards of the step (block alignment), None without grad
    grad: bool
    samples: int
    count: int
    synced: bool
    mean: np.ndarray
    var: np.ndarray  # biased (divide by count)


@dataclass
class RankLayer:
    """A layer as one rank saw it."""

    rank: int
    info: dict[str, Any]
    forwards: list[Forward] = field(default_factory=list)
    modes: str = ""
    dropped: int = 0
    initial_mean: np.ndarray | None = None
    initial_var: np.ndarray | None = None
    initial_batches: int | None = None
    final_mean: np.ndarray | None = None
    final_var: np.ndarray | None = None
    final_batches: int | None = None
    final_training: bool | None = None
    final_momentum: float | None = None

    @property
    def train_forwards(self) -> list[Forward]:
        return [f for f in self.forwards if f.grad]


@dataclass
class LayerRun:
    """One BN layer (by name) across ranks."""

    name: str
    order: int
    ranks: dict[int, RankLayer] = field(default_factory=dict)

    @property
    def info(self) -> dict[str, Any]:
        return self.ranks[min(self.ranks)].info

    @property
    def kind(self) -> str:
        kinds = {rl.info.get("bn_kind", "plain") for rl in self.ranks.values()}
        return "plain" if kinds == {"plain"} else next(k for k in ("emulated_sync", "sync", "plain") if k in kinds)

    @property
    def momentum(self) -> float | None:
        m = self.info.get("momentum")
        return None if m is None else float(m)

    @property
    def synced(self) -> bool:
        """SyncBN that actually synchronised in its training forwards (not SyncBN without a process group)."""
        return any(f.synced for rl in self.ranks.values() for f in rl.forwards)

    @property
    def local(self) -> bool:
        """Normalises over each rank's own batch in training mode."""
        return not self.synced

    @property
    def complete(self) -> bool:
        """Every training-mode forward's moments were kept on every rank (the replay is exact)."""
        return all(rl.dropped == 0 for rl in self.ranks.values())

    def per_rank_samples(self) -> dict[int, int]:
        """The typical (median) per-rank batch of the gradient-enabled training forwards."""
        out = {}
        for r, rl in self.ranks.items():
            s = [f.samples for f in rl.train_forwards]
            if s:
                out[r] = int(np.median(s))
        return out

    def per_rank_values(self) -> dict[int, int]:
        """The typical per-rank values per channel (samples x spatial positions) of the training forwards."""
        out = {}
        for r, rl in self.ranks.items():
            c = [f.count for f in rl.train_forwards]
            if c:
                out[r] = int(np.median(c))
        return out


@dataclass
class BNRun:
    """Every BN layer of a run, ordered as the lowest rank first ran them."""

    ranks: list[int]
    layers: list[LayerRun]

    def by_name(self, name: str) -> LayerRun | None:
        return next((layer for layer in self.layers if layer.name == name), None)


# --------------------------------------------------------------------------------------------------- loading


def load_bn(run: RunData) -> BNRun | None:
    """The run's BN data, or None when no rank recorded a BN layer."""
    layers: dict[str, LayerRun] = {}
    ranks: list[int] = []
    for rank, proc in run.rank_processes.items():
        by_index: dict[int, RankLayer] = {}
        counters: dict[tuple[int, int], list[int]] = {}
        for ev in proc.events:
            kind = ev.get("kind")
            if kind == "bn_layer":
                rl = RankLayer(rank=rank, info=ev)
                if ev.get("initial"):
                    vec = _array(run, ev["initial"])
                    if vec is not None and vec.size % 2 == 0:
                        half = vec.size // 2
                        rl.initial_mean, rl.initial_var = vec[:half], vec[half:]
                rl.initial_batches = ev.get("initial_batches_tracked")
                by_index[int(ev["layer"])] = rl
                name = str(ev.get("name"))
                lr = layers.get(name)
                if lr is None:
                    lr = layers[name] = LayerRun(name=name, order=len(layers))
                lr.ranks[rank] = rl
            elif kind == "bn_step":
                _add_step(run, ev, by_index, counters)
            elif kind == "bn_final":
                _add_final(run, ev, by_index)
        if by_index:
            ranks.append(rank)
    if not layers:
        return None
    ordered = sorted(layers.values(), key=lambda lr: lr.order)
    return BNRun(ranks=sorted(ranks), layers=ordered)


def _array(run: RunData, ref: dict[str, Any]) -> np.ndarray | None:
    try:
        return np.asarray(run.load_array(ref), dtype=np.float64)
    except (OSError, ValueError, KeyError):
        return None


def _add_step(run: RunData, ev: dict[str, Any], by_index: dict[int, RankLayer], counters: dict) -> None:
    step = int(ev.get("step", 0))
    cols = ev.get("forwards") or {}
    layer_ids = cols.get("layer") or []
    vec = _array(run, ev["moments"]) if ev.get("moments") else None
    offset = 0
    for i, lid in enumerate(layer_ids):
        channels = int(cols["channels"][i])
        rl = by_index.get(int(lid))
        if vec is None or offset + 2 * channels > vec.size:
            break
        mean = vec[offset : offset + channels]
        var = vec[offset + channels : offset + 2 * channels]
        offset += 2 * channels
        if rl is None:
            continue
        grad = bool(cols["grad"][i])
        k_all = counters.setdefault((int(lid), step), [0, 0])
        kg = k_all[1] if grad else None
        rl.forwards.append(
            Forward(step=step, k=k_all[0], kg=kg, grad=grad, samples=int(cols["samples"][i]),
                    count=int(cols["count"][i]), synced=bool(cols["synced"][i]), mean=mean, var=var)
        )
        k_all[0] += 1
        if grad:
            k_all[1] += 1
    for lid, modes in (ev.get("modes") or {}).items():
        rl = by_index.get(int(lid))
        if rl is not None:
            rl.modes += str(modes)
    for lid, n in (ev.get("dropped") or {}).items():
        rl = by_index.get(int(lid))
        if rl is not None:
            rl.dropped = max(rl.dropped, int(n))


def _add_final(run: RunData, ev: dict[str, Any], by_index: dict[int, RankLayer]) -> None:
    vec = _array(run, ev["stats"]) if ev.get("stats") else None
    offset = 0
    for entry in ev.get("layers") or []:
        channels = int(entry.get("channels") or 0)
        rl = by_index.get(int(entry["layer"]))
        if channels == 0:
            continue
        if vec is None or offset + 2 * channels > vec.size:
            break
        rm, rv = vec[offset : offset + channels], vec[offset + channels : offset + 2 * channels]
        offset += 2 * channels
        if rl is None:
            continue
        rl.final_mean, rl.final_var = rm, rv
        rl.final_batches = entry.get("batches_tracked")
        rl.final_training = entry.get("training")
        rl.final_momentum = entry.get("momentum")
        rl.dropped = max(rl.dropped, int(entry.get("dropped") or 0))


# --------------------------------------------------------------------------------------------------- alignment


def blocks(layer: LayerRun, ranks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """(means, variances [ranks, blocks, channels], counts [ranks, blocks], block keys) of the gradient-enabled
    training forwards, aligned on (step, k). A rank without that forward has count 0 and NaN moments."""
    return _aligned(layer, ranks, grad_only=True)


def updates(layer: LayerRun, ranks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """The same over every training-mode forward (the running-statistics updates), aligned on (step, k)."""
    return _aligned(layer, ranks, grad_only=False)


def _aligned(layer: LayerRun, ranks: list[int], grad_only: bool):
    keyed: dict[int, dict[tuple[int, int], Forward]] = {}
    keys: set[tuple[int, int]] = set()
    channels = int(layer.info.get("num_features") or 0)
    for r in ranks:
        rl = layer.ranks.get(r)
        mine: dict[tuple[int, int], Forward] = {}
        for f in rl.forwards if rl is not None else ():
            if grad_only and not f.grad:
                continue
            key = (f.step, f.kg if grad_only else f.k)
            mine[key] = f
            channels = f.mean.size
        keyed[r] = mine
        keys |= set(mine)
    order = sorted(keys)
    means = np.full((len(ranks), len(order), channels), np.nan)
    variances = np.full_like(means, np.nan)
    counts = np.zeros((len(ranks), len(order)))
    for i, r in enumerate(ranks):
        for j, key in enumerate(order):
            f = keyed[r].get(key)
            if f is not None and f.mean.size == channels:
                means[i, j], variances[i, j], counts[i, j] = f.mean, f.var, f.count
    return means, variances, counts, order


# --------------------------------------------------------------------------------------------------- replay


def syncbn_replay(layer: LayerRun, ranks: list[int]) -> RunningStats | None:
    """What SyncBN (one group of all `ranks`) would have accumulated from the same per-rank moments, with the
    layer's own momentum, starting from the running statistics the lowest rank held before its first forward.
    None when that cannot be exact: moments were dropped, no initial statistics, or no update was recorded."""
    if not layer.complete or not layer.info.get("track_running_stats", True):
        return None
    first = layer.ranks[min(layer.ranks)]
    if first.initial_mean is None or first.initial_var is None:
        return None
    means, variances, counts, order = updates(layer, ranks)
    if not order:
        return None
    means = np.nan_to_num(means)
    variances = np.nan_to_num(variances)
    try:
        return replay_running_stats(
            counts, means, variances, layer.momentum,
            running_mean=first.initial_mean, running_var=first.initial_var,
            num_batches_tracked=int(first.initial_batches or 0),
        )
    except ValueError:
        return None


def local_vs_syncbn(layer: LayerRun, ranks: list[int]) -> dict[str, Any] | None:
    """How far the running statistics each rank holds are from the SyncBN replay: relative L2 errors
    {"mean": {rank: err}, "var": {rank: err}} (ddpdoctor.bn.stats.relative_error, as compare-bn reports them),
    the mean's error in units of the channel's standard deviation {"mean_std": {rank: rms |dmean| / std}} —
    running means often sit near zero, where a relative error says little, while the shift BN applies is
    measured in standard deviations — and the worst rank of each: "max_mean", "max_var", "max_mean_std".
    None when there is nothing to compare."""
    replay = syncbn_replay(layer, ranks)
    if replay is None:
        return None
    out: dict[str, Any] = {"mean": {}, "var": {}, "mean_std": {}}
    eps = float(layer.info.get("eps") or 1e-5)
    for r in ranks:
        rl = layer.ranks.get(r)
        if rl is None or rl.final_mean is None or rl.final_var is None:
            continue
        out["mean"][r] = relative_error(rl.final_mean, replay.running_mean)
        out["var"][r] = relative_error(rl.final_var, replay.running_var)
        out["mean_std"][r] = mean_gap(rl.final_mean, replay.running_mean, replay.running_var, eps)
    if not out["mean"]:
        return None
    out["max_mean"] = max(out["mean"].values())
    out["max_var"] = max(out["var"].values())
    out["max_mean_std"] = max(out["mean_std"].values())
    return out


def mean_gap(a: np.ndarray, b: np.ndarray, var: np.ndarray, eps: float = 1e-5) -> float:
    """RMS over channels of |a - b| in units of the channel's standard deviation sqrt(var + eps): how far apart
    two mean vectors are for normalisation (a relative L2 error is meaningless for means near zero)."""
    std = np.sqrt(np.maximum(np.asarray(var, dtype=np.float64), 0.0) + eps)
    return float(np.sqrt(np.mean(((np.asarray(a) - np.asarray(b)) / std) ** 2)))


def cross_rank_spread(layer: LayerRun, ranks: list[int]) -> dict[str, Any] | None:
    """How far each rank's final running statistics are from the lowest rank's: running_mean in standard
    deviations (`mean_gap`), running_var as a relative L2 error; {"mean": {rank: gap}, "var": {rank: err},
    "max", "stat", "rank"} with the largest of them."""
    finals = {r: layer.ranks[r] for r in ranks if r in layer.ranks and layer.ranks[r].final_mean is not None}
    if len(finals) < 2:
        return None
    ref_rank = min(finals)
    ref = finals[ref_rank]
    eps = float(layer.info.get("eps") or 1e-5)
    out: dict[str, Any] = {"reference_rank": ref_rank, "mean": {}, "var": {}}
    best = (0.0, "running_var", ref_rank)
    for r, rl in finals.items():
        if r == ref_rank:
            continue
        em = mean_gap(rl.final_mean, ref.final_mean, ref.final_var, eps)
        ev = relative_error(rl.final_var, ref.final_var)
        out["mean"][r], out["var"][r] = em, ev
        for value, stat in ((em, "running_mean"), (ev, "running_var")):
            if value > best[0]:
                best = (value, stat, r)
    out["max"], out["stat"], out["rank"] = best
    return out


def before_last_update(layer: LayerRun, ranks: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]] | None:
    """The running statistics each rank held just before its last training-mode update, reconstructed from the
    final statistics and that update's batch moments: S = (final - f * batch_stat) / (1 - f). Identical across
    ranks exactly when DDP's buffer broadcast (rank 0's buffers at the start of the forward) kept them aligned
    and the ranks differ only by their own last batch. None when it cannot be reconstructed."""
    out = {}
    for r in ranks:
        rl = layer.ranks.get(r)
        if rl is None or rl.final_mean is None or not rl.forwards or rl.dropped:
            return None
        last = rl.forwards[-1]
        if last.count <= 1:
            return None
        momentum = layer.momentum
        if momentum is None:
            if not rl.final_batches:
                return None
            factor = 1.0 / float(rl.final_batches)
        else:
            factor = float(momentum)
        if factor >= 1.0 - 1e-9:
            return None
        total = float(last.count)
        if last.synced:  # the update SyncBN applied used the global moments; those are not this rank's alone
            return None
        unbiased = last.var * total / (total - 1.0)
        out[r] = (
            (rl.final_mean - factor * last.mean) / (1 - factor),
            (rl.final_var - factor * unbiased) / (1 - factor),
        )
    return out


def ema_weights(layer_rank: RankLayer, momentum: float | None) -> list[float]:
    """Weight of each recorded training-mode update in the final running statistics (exponential moving average
    with the layer's momentum, or the cumulative average for momentum None)."""
    n = len(layer_rank.forwards)
    if n == 0:
        return []
    if momentum is None:
        start = int(layer_rank.initial_batches or 0)
        factors = [1.0 / (start + i + 1) for i in range(n)]
    else:
        factors = [float(momentum)] * n
    weights = [0.0] * n
    keep = 1.0
    for i in range(n - 1, -1, -1):
        weights[i] = factors[i] * keep
        keep *= 1.0 - factors[i]
    return weights


# --------------------------------------------------------------------------------------------------- noise


def batch_noise(layer: LayerRun, ranks: list[int]) -> dict[str, Any] | None:
    """How noisy the batch statistics this layer normalises with are, under local BN (each rank's own batch)
    and under SyncBN (the ranks' batches pooled), from the recorded per-rank moments.

    The model changes from step to step, so the batch mean of a channel drifts however large the batch; that
    drift is shared by the ranks at a step. The headline numbers are therefore measured across ranks within a
    step: a rank's batch mean deviates from the pooled mean by d with E[d^2] = s^2 (1/n_r - 1/N), so
    s^2/n_r (local noise) and s^2/N (global noise) follow exactly from the measured deviations — in units of the
    channel's within-batch standard deviation for the mean, and as relative noise (log scale) for the variance;
    median over channels. `rank_vs_global_*` is the plain RMS of d: how far each rank's statistics are from the
    global batch's that SyncBN would use (no assumption about the ranks' data). `step_to_step` adds the plain RMS
    of successive differences / sqrt(2) of both
    statistics over steps, drift included. None with fewer than 2 complete blocks (3 for step_to_step)."""
    means, variances, counts, order = blocks(layer, ranks)
    full = np.all(counts > 0, axis=0)
    if full.sum() < 2 or len(ranks) < 2:
        return None
    means, variances, counts = means[:, full], variances[:, full], counts[:, full]
    scale = np.sqrt(np.maximum(np.nanmean(variances, axis=(0, 1)), 1e-30))
    pooled_m = np.empty(means.shape[1:])
    pooled_v = np.empty(means.shape[1:])
    for j in range(means.shape[1]):
        _, pooled_m[j], pooled_v[j] = combine_moments(counts[:, j], means[:, j], variances[:, j])
    share = counts / counts.sum(axis=0, keepdims=True)  # n_r / N per cell
    dm2 = ((means - pooled_m[None]) / scale) ** 2
    dv2 = (np.log(np.maximum(variances, 1e-30)) - np.log(np.maximum(pooled_v, 1e-30))[None]) ** 2
    keep = share < 1.0
    local_factor = np.where(keep, 1.0 / np.maximum(1.0 - share, 1e-12), 0.0)[..., None]
    global_factor = np.where(keep, share / np.maximum(1.0 - share, 1e-12), 0.0)[..., None]
    cells = max(int(keep.sum()), 1)

    def noise(d2: np.ndarray, factor: np.ndarray) -> float:
        return float(np.median(np.sqrt((d2 * factor).sum(axis=(0, 1)) / cells)))

    ones = np.where(keep, 1.0, 0.0)[..., None]
    out: dict[str, Any] = {
        "steps": int(full.sum()),
        "rank_vs_global_mean": noise(dm2, ones),
        "rank_vs_global_var": noise(dv2, ones),
        "local_mean_noise": noise(dm2, local_factor),
        "global_mean_noise": noise(dm2, global_factor),
        "local_var_noise": noise(dv2, local_factor),
        "global_var_noise": noise(dv2, global_factor),
    }
    if full.sum() >= 3:

        def successive(m: np.ndarray, v: np.ndarray) -> tuple[float, float]:
            dm = np.diff(m, axis=0) / scale
            dv = np.diff(np.log(np.maximum(v, 1e-30)), axis=0)
            return (float(np.median(np.sqrt(np.mean(dm**2, axis=0) / 2))),
                    float(np.median(np.sqrt(np.mean(dv**2, axis=0) / 2))))

        local = [successive(means[i], variances[i]) for i in range(len(ranks))]
        glob = successive(pooled_m, pooled_v)
        out["step_to_step"] = {
            "local_mean": float(np.mean([x[0] for x in local])),
            "global_mean": glob[0],
            "local_var": float(np.mean([x[1] for x in local])),
            "global_var": glob[1],
        }
    return out


# --------------------------------------------------------------------------------------------------- run facts


def ddp_inits(run: RunData) -> list[dict[str, Any]]:
    """The successful DDP constructions of the lowest rank (the options are the same on every rank)."""
    ranks = run.rank_processes
    if not ranks:
        return []
    proc = ranks[min(ranks)]
    return [e for e in proc.of("ddp_init") if e.get("ok")]


def distributed(run: RunData) -> bool:
    """The ranks trained together: a process group of more than one rank was initialised. Without one, each
    process normalises over its own batch because that is the script's recipe, not because DDP split it."""
    return any(e.get("ok") and int(e.get("world_size") or 0) > 1 for _, e in run.events("pg_init"))


def training_loader_site(run: RunData) -> dict[str, Any] | None:
    """Where the training DataLoader was built (its batch_size sets the per-rank BN batch), on the lowest rank."""
    ranks = run.rank_processes
    if not ranks:
        return None
    proc = ranks[min(ranks)]
    training = [e.get("loader") for e in proc.of("loader_iter_end") if e.get("training")]
    for e in proc.of("loader_created"):
        if e.get("loader") in training and e.get("site"):
            return e["site"]
    return None


def rounded(value: Any) -> Any:
    """Numbers (also inside dicts and lists) rounded for evidence, JSON-safe."""
    if isinstance(value, dict):
        return {str(k): rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    if isinstance(value, float):
        return finite(value)
    return value


def finite(x: float | None, digits: int = 4) -> float | None:
    """A JSON-safe rounded number (None for NaN; infinities as ±1e308)."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return None
    if math.isinf(x):
        return 1e308 if x > 0 else -1e308
    return float(f"{x:.{digits}g}")


_MEMO: dict[str, Any] = {"run": None}


def _memo(ctx: Any, key: str, compute: Any) -> Any:
    """Compute something about a run once, however many analyses ask (one run at a time)."""
    import weakref

    ref = _MEMO.get("run")
    if ref is None or ref() is not ctx.run:
        _MEMO.clear()
        _MEMO["run"] = weakref.ref(ctx.run)
    if key not in _MEMO:
        _MEMO[key] = compute()
    return _MEMO[key]


def bn_for(ctx: Any) -> BNRun | None:
    """`load_bn(ctx.run)`, read once per run."""
    return _memo(ctx, "bn", lambda: load_bn(ctx.run))


def noniid_test_of(bn: BNRun):
    """The non-i.i.d. test (`ddpdoctor.bn.stats.noniid_test`) on the per-rank input means of every BN layer's
    gradient-enabled training forwards, blocked on (step, forward); None without data."""
    from ddpdoctor.bn.stats import noniid_test

    means: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for layer in bn.layers:
        m, _, c, order = blocks(layer, bn.ranks)
        if order and m.shape[2] > 0:
            means[layer.name], counts[layer.name] = m, c
    return noniid_test(means, counts) if means else None


def noniid_for(ctx: Any):
    """`noniid_test_of` the run's BN data, computed once per run."""

    def compute():
        bn = bn_for(ctx)
        return None if bn is None else noniid_test_of(bn)

    return _memo(ctx, "noniid", compute)


def normalisation_batch(layer: LayerRun, ranks: list[int]) -> dict[str, Any]:
    """What the layer normalised over in its gradient-enabled training forwards: the typical per-rank batch
    (samples, and values per channel), and for synchronised SyncBN the group's global batch."""
    per_rank = layer.per_rank_samples()
    values = layer.per_rank_values()
    out: dict[str, Any] = {"per_rank_samples": per_rank, "per_rank_values": values, "synced": layer.synced}
    if layer.synced:
        group = layer.info.get("group_ranks") or ranks
        out["group_ranks"] = list(group)
        out["global_samples"] = int(sum(per_rank.get(r, 0) for r in group))
        out["global_values"] = int(sum(values.get(r, 0) for r in group))
    else:
        out["global_samples"] = int(sum(per_rank.values()))
        out["global_values"] = int(sum(values.values()))
    return out


def replay_errors(ctx: Any) -> dict[str, dict[str, Any]]:
    """Per layer: relative error of each rank's final running stats against the SyncBN replay (max over ranks),
    the compact form that goes into the evidence of every BN finding."""

    def compute() -> dict[str, dict[str, Any]]:
        bn = bn_for(ctx)
        out: dict[str, dict[str, Any]] = {}
        for layer in bn.layers if bn is not None else ():
            cmp = local_vs_syncbn(layer, bn.ranks)
            if cmp is not None:
                out[layer.name] = {"running_mean": finite(cmp["max_mean"]), "running_var": finite(cmp["max_var"]),
                                   "running_mean_std": finite(cmp["max_mean_std"]), "kind": layer.kind}
        return out

    return _memo(ctx, "replay_errors", compute)


def convert_site(run: RunData) -> dict[str, Any] | None:
    """Where the script made its BN layers SyncBN (convert_sync_batchnorm), on the lowest rank."""
    ranks = run.rank_processes
    if not ranks:
        return None
    for e in ranks[min(ranks)].of("sync_bn_convert"):
        if e.get("site"):
            return e["site"]
    return None


GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_object")
INTEGER_DTYPES = ("int64", "int32", "long", "int")


def batch_shuffle(ctx: Any, global_samples: int) -> dict[str, object] | None:
    """A shuffle of the global batch across ranks, as every rank recorded it: an all_gather, then a broadcast of
    an integer tensor with `global_samples` entries (the permutation every rank applies to the gathered batch):
    shuffle-BN (MoCo), where per-GPU BatchNorm is the design (DD202, DD201 keep it in their fixes)."""
    if global_samples < 2:
        return None
    found = None
    for p in ctx.ranks.values():
        gather = None
        hit = None
        for e in p.of("collective"):
            if e.get("op") in GATHERS:
                gather = e
            elif (gather is not None and e.get("op") == "broadcast" and e.get("numel") == global_samples
                  and str(e.get("dtype") or "").replace("torch.", "") in INTEGER_DTYPES):
                hit = (gather, e)
                break
        if hit is None:
            return None  # every rank takes part in a shuffle
        found = found or hit
    if found is None:
        return None
    gather, bcast = found
    return {"gather_op": gather.get("op"), "gather_site": gather.get("site"), "broadcast_site": bcast.get("site"),
            "permutation": global_samples}
