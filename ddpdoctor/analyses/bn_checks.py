"""BatchNorm conversion and applied-statistics data of a recorded run, and the numerical checks on them (DD208-DD216,
`ddpdoctor triage`). Pure: numpy and the event logs, no torch.

- `conversions(run)`: the `bn_conversion` events per rank (one per layer a converter replaced).
- `applied(run)`: the `bn_applied` records, aligned across ranks per layer and forward.
- `applied_statistics(...)`: the statistics a training-mode BN layer applied, recovered from the moments of its
  input and output, against candidate statistics, with a tolerance from floating-point rounding (DD211).
- `effective_samples(...)`: the effective number of independent values a batch mean averages, from per-sample
  channel moments (n_eff = 1 + B · var / var(sample means)).
- `sync_groups(ctx)`, `accumulation_of(ctx)`, `population(ctx)` / `lag_level(...)`: per run, the ranks each layer
  normalised over, gradient accumulation (DD215), running statistics against PreciseBN population statistics
  (DD213, DD214) — read by the rules' probe halves and by `ddpdoctor triage`, which compares them across arms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.rules import setting
from ddpdoctor.rundata import RunData

# the rules' thresholds (DD204, DD213), read through the catalog
LARGE_SYNC_BATCH = setting("large_sync_batch").default
LAG_LIKELY, LAG_POSSIBLE = setting("mean_lag_likely").default, setting("mean_lag_possible").default
VAR_LAG_LIKELY, VAR_LAG_POSSIBLE = setting("var_lag_likely").default, setting("var_lag_possible").default

# unit roundoff of the output dtype
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# slack over the rounding estimates (calibrated: 200 random float32 cases with unequal batches, offsets up to 1000
# standard deviations and weights near zero stay below 1/8 of it, tests/test_triage_checks.py)
ROUNDING_SLACK = 64.0
# a channel is measured when the check can resolve a deviation of this size in its applied statistics
RESOLUTION = 1e-3
# running statistics have forgotten their initial values (e^-3 ≈ 5 % left) after this many time constants of the
# exponential average: 3 / momentum updates. Before that, their lag measures the warm-up, not the training
WARMUP_TIME_CONSTANTS = 3.0
# a relative quantity (variance lag, eval-output shift) above this (1e3 %) is measured against a reference near
# zero: unbounded, not a size
MAX_RELATIVE = 10.0


# --------------------------------------------------------------------------------------------------- conversions


def conversions(run: RunData) -> dict[int, list[dict[str, Any]]]:
    """rank → its `bn_conversion` events, in order."""
    return {r: p.of("bn_conversion") for r, p in run.rank_processes.items() if p.of("bn_conversion")}


def lowest_rank_conversions(run: RunData) -> list[dict[str, Any]]:
    convs = conversions(run)
    return convs[min(convs)] if convs else []


# --------------------------------------------------------------------------------------------------- applied


@dataclass
class AppliedForward:
    """One training forward of one layer on one rank: per-channel moments of input and output."""

    rank: int
    step: int
    k: int
    samples: int
    count: int
    eps: float
    sync_like: bool
    synced: bool | None
    group_ranks: list[int] | None
    local_mode: bool
    dtype: str
    cls: str
    mx: np.ndarray
    vx: np.ndarray
    my: np.ndarray
    vy: np.ndarray
    cxy: np.ndarray
    w: np.ndarray
    b: np.ndarray


@dataclass
class AppliedLayer:
    name: str
    forwards: dict[tuple[int, int], dict[int, AppliedForward]] = field(default_factory=dict)  # (step, k) → rank → fwd

    @property
    def any(self) -> AppliedForward:
        return next(iter(next(iter(self.forwards.values())).values()))


def applied(run: RunData) -> list[AppliedLayer]:
    """Every layer's recorded forwards, aligned across ranks on (step, k-th forward of the layer in the step)."""
    layers: dict[str, AppliedLayer] = {}
    for rank, proc in run.rank_processes.items():
        for ev in proc.of("bn_applied"):
            cols = ev.get("forwards") or {}
            names = cols.get("name") or []
            try:
                vec = np.asarray(run.load_array(ev["moments"]), dtype=np.float64) if ev.get("moments") else None
            except (OSError, ValueError, KeyError):
                vec = None
            if vec is None:
                continue
            offset = 0
            seen: dict[str, int] = {}
            step = int(ev.get("step", 0))
            for i, name in enumerate(names):
                c = int(cols["channels"][i])
                if offset + 7 * c > vec.size:
                    break
                parts = [vec[offset + j * c: offset + (j + 1) * c] for j in range(7)]
                offset += 7 * c
                k = seen.get(name, 0)
                seen[name] = k + 1
                fwd = AppliedForward(
                    rank=rank, step=step, k=k, samples=int(cols["samples"][i]), count=int(cols["count"][i]),
                    eps=float(cols["eps"][i]), sync_like=bool(cols["sync_like"][i]),
                    synced=cols["synced"][i], group_ranks=cols["group_ranks"][i],
                    local_mode=bool(cols["local_mode"][i]), dtype=str(cols["dtype"][i]), cls=str(cols["cls"][i]),
                    mx=parts[0], vx=parts[1], my=parts[2], vy=parts[3], cxy=parts[4], w=parts[5], b=parts[6],
                )
                layer = layers.setdefault(name, AppliedLayer(name))
                layer.forwards.setdefault((step, k), {})[rank] = fwd
    return list(layers.values())


def chan(counts: np.ndarray, means: np.ndarray, variances: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Exact pooled (count, mean, biased variance) of groups given per group (count, mean, biased variance):
    Chan's parallel formula, per channel. counts [g], means/variances [g, c]."""
    counts = np.asarray(counts, dtype=np.float64)
    total = float(counts.sum())
    if total <= 0:
        return 0.0, np.full(means.shape[1:], np.nan), np.full(means.shape[1:], np.nan)
    mean = (counts[:, None] * means).sum(0) / total
    m2 = (counts[:, None] * variances).sum(0) + (counts[:, None] * (means - mean) ** 2).sum(0)
    return total, mean, m2 / total


@dataclass
class AppliedCheck:
    """How the statistics one forward applied compare with candidate statistics, per channel."""

    z: np.ndarray  # normalised residual (1 = at the rounding tolerance) of the worse of mean and spread
    measurable: np.ndarray  # channels where a RESOLUTION-sized deviation is resolvable
    affine: np.ndarray  # channels whose output is affine in the input (correlation ±1)
    mean_error: np.ndarray  # recovered applied mean - candidate mean, in candidate standard deviations
    var_error: np.ndarray  # recovered (applied var + eps) / (candidate var + eps) - 1


def applied_statistics(
    *,
    count: float,
    mx: np.ndarray,
    vx: np.ndarray,
    my: np.ndarray,
    vy: np.ndarray,
    cxy: np.ndarray,
    w: np.ndarray,
    b: np.ndarray,
    eps: float,
    mean: np.ndarray,
    var: np.ndarray,
    dtype: str = "float32",
) -> AppliedCheck:
    """Compare what a training-mode BN forward applied with candidate statistics (mean, biased var) per channel.

    y = a (x - mean) + b with a = w / sqrt(var + eps): the candidate predicts the output's mean and standard
    deviation from the input's; the recorded output moments either agree within the rounding of a float
    computation of that dtype or they do not. The tolerance covers the rounding of each output value (relative to
    the magnitudes involved, the input's offset from zero included) and of the kernel's own statistics, so an
    exact implementation passes whatever the batch sizes, offsets and weights; channels whose weight is so small
    that the output carries no resolvable information about the statistics are not measurable (and pass)."""
    u = UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["float32"])
    n = max(float(count), 2.0)
    sx = np.sqrt(np.maximum(vx, 0.0))
    sy = np.sqrt(np.maximum(vy, 0.0))
    s = np.sqrt(np.maximum(var, 0.0) + eps)
    a = w / s
    my_pred = a * (mx - mean) + b
    sy_pred = np.abs(a) * sx
    # magnitudes an output value is computed from: |y|, and |a| times |x| and |mean| (x - mean is rounded first)
    scale = np.abs(my) + sy + np.abs(a) * (np.abs(mx) + sx + np.abs(mean)) + np.abs(b)
    tol_m = ROUNDING_SLACK * u * scale + 1e-300
    tol_s = ROUNDING_SLACK * u * (sy_pred + sy + (my**2 + vy) / (np.maximum(sy, 1e-300) * np.sqrt(n))
                                  + u * scale**2 / np.maximum(sy, 1e-300)) + 1e-300
    z = np.maximum(np.abs(my - my_pred) / tol_m, np.abs(sy - sy_pred) / tol_s)
    resolvable = RESOLUTION * np.abs(w)  # output change of a RESOLUTION deviation of the mean (in std units)
    measurable = (tol_m < resolvable) & (tol_s < RESOLUTION * np.maximum(sy_pred, 1e-300)) & (sx > 0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        corr = cxy / np.sqrt(np.maximum(vx * vy, 1e-300))
        affine = (np.abs(np.abs(corr) - 1.0) <= max(1e-4, 64 * u)) | ~measurable
        a_obs = np.sign(cxy) * np.sqrt(vy / np.maximum(vx, 1e-300))
        s_obs = np.abs(w) / np.maximum(np.abs(a_obs), 1e-300)
        mean_obs = mx - (my - b) / np.where(a_obs == 0, np.nan, a_obs)
        mean_error = np.where(measurable, (mean_obs - mean) / s, np.nan)
        var_error = np.where(measurable, s_obs**2 / s**2 - 1.0, np.nan)
    z = np.where(measurable | (z > 1), z, 0.0)  # a residual above tolerance counts even where the channel is weak
    return AppliedCheck(z=z, measurable=measurable, affine=affine, mean_error=mean_error, var_error=var_error)


def candidate_statistics(fwds: dict[int, AppliedForward], ranks: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """Exact (mean, biased var) over the batches of `ranks` at one forward, None when a rank is missing."""
    if not ranks or any(r not in fwds for r in ranks):
        return None
    counts = np.array([fwds[r].count for r in ranks], dtype=np.float64)
    means = np.stack([fwds[r].mx for r in ranks])
    variances = np.stack([fwds[r].vx for r in ranks])
    _, mean, var = chan(counts, means, variances)
    return mean, var


@dataclass
class LayerVerdict:
    """DD211/DD212 facts about one SyncBN-like layer: which statistics it applied."""

    name: str
    cls: str
    expected: str  # "group" | "local"
    group_ranks: dict[int, list[int] | None]
    matches: dict[str, bool | None]  # candidate → all measured channels within tolerance (None: not measured)
    worst_z: dict[str, float | None]
    measured_channels: int
    channels: int
    forwards: int
    not_affine: int
    mean_error: float | None  # median |error| against the expected candidate over measured channels
    var_error: float | None
    max_mean_error: float | None
    max_var_error: float | None

    @property
    def applied(self) -> str:
        """Which statistics the layer applied: the expected candidate when it matches, else the first that does
        ('group', 'local', 'world'), 'other' when none does, 'not_measured'."""
        if self.measured_channels == 0:
            return "not_measured"
        if self.matches.get(self.expected):
            return self.expected
        for cand in ("group", "local", "world"):
            if self.matches.get(cand):
                return cand
        return "other"


def applied_verdicts(layers: list[AppliedLayer], world: list[int]) -> list[LayerVerdict]:
    """For every SyncBN-like layer: do the statistics it applied match its group's exact statistics?"""
    out: list[LayerVerdict] = []
    for layer in layers:
        first = layer.any
        if not first.sync_like:
            continue
        z: dict[str, list[float]] = {"group": [], "local": [], "world": []}
        errors_m: list[np.ndarray] = []
        errors_v: list[np.ndarray] = []
        measured = 0
        not_affine = 0
        groups: dict[int, list[int] | None] = {}
        expected = "local" if first.local_mode else "group"
        n_fwd = 0
        for key in sorted(layer.forwards):
            fwds = layer.forwards[key]
            for r, f in fwds.items():
                groups.setdefault(r, f.group_ranks)
                group = f.group_ranks if f.group_ranks else world
                cands = {"local": [r], "group": group, "world": world}
                n_fwd += 1
                channel_measured = None
                for cand, ranks in cands.items():
                    stats = candidate_statistics(fwds, ranks)
                    if stats is None:
                        continue
                    chk = applied_statistics(count=f.count, mx=f.mx, vx=f.vx, my=f.my, vy=f.vy, cxy=f.cxy, w=f.w,
                                             b=f.b, eps=f.eps, mean=stats[0], var=stats[1], dtype=f.dtype)
                    if not np.all(chk.affine):
                        not_affine += int(np.sum(~chk.affine))
                        channel_measured = np.zeros_like(chk.measurable)
                        break
                    ok = chk.measurable
                    channel_measured = ok
                    z[cand].append(float(np.max(chk.z)) if chk.z.size else 0.0)
                    if cand == expected:
                        errors_m.append(np.abs(chk.mean_error[ok]))
                        errors_v.append(np.abs(chk.var_error[ok]))
                if channel_measured is not None:
                    measured = max(measured, int(np.sum(channel_measured)))
        if not_affine:
            z = {k: [] for k in z}
            measured = 0
        em = np.concatenate(errors_m) if errors_m else np.zeros(0)
        ev = np.concatenate(errors_v) if errors_v else np.zeros(0)
        out.append(LayerVerdict(
            name=layer.name,
            cls=first.cls,
            expected=expected,
            group_ranks=groups,
            matches={k: (None if not v or measured == 0 else max(v) <= 1.0) for k, v in z.items()},
            worst_z={k: (max(v) if v else None) for k, v in z.items()},
            measured_channels=measured,
            channels=int(first.mx.size),
            forwards=n_fwd,
            not_affine=not_affine,
            mean_error=float(np.median(em)) if em.size else None,
            var_error=float(np.median(ev)) if ev.size else None,
            max_mean_error=float(np.max(em)) if em.size else None,
            max_var_error=float(np.max(ev)) if ev.size else None,
        ))
    return out


# --------------------------------------------------------------------------------------------------- n_eff


def effective_samples(samples: np.ndarray, total_var: np.ndarray, between_var: np.ndarray) -> np.ndarray:
    """Per channel, the effective number of independent values the batch mean averages, pooled over forwards.

    samples [f]: batch size of each forward; total_var [f, c]: the input's biased variance over the batch;
    between_var [f, c]: the unbiased variance across samples of the per-sample channel means. The batch mean of B
    independent samples has variance var(sample means) / B; the per-value variance sigma^2 is estimated without bias
    from the biased total variance, which gives n_eff = 1 + B · total_var / between_var — B · H · W for spatially
    independent values, B for spatially constant ones. Ratio of sums over forwards (B-weighted) for stability."""
    samples = np.asarray(samples, dtype=np.float64)
    num = (samples[:, None] * np.asarray(total_var, dtype=np.float64)).sum(0)
    den = np.asarray(between_var, dtype=np.float64).sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return 1.0 + np.where(den > 0, num / den, np.inf)


def effective_samples_interval(samples: np.ndarray, total_var: np.ndarray, between_var: np.ndarray,
                               draws: int = 200, seed: int = 0) -> tuple[float, float, float]:
    """(median over channels of n_eff, 5% and 95% bootstrap quantiles of it, resampling forwards). The draws are
    computed together (one array per chunk of draws, not a Python loop): triage reads this for every layer of
    every rank."""
    samples = np.asarray(samples, dtype=np.float64)
    tv, bv = np.asarray(total_var, dtype=np.float64), np.asarray(between_var, dtype=np.float64)
    point = float(np.median(effective_samples(samples, tv, bv)))
    f = samples.size
    if f < 3:
        return point, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, f, (draws, f))
    weighted = samples[:, None] * tv  # [f, c]
    chunk = max(1, BOOTSTRAP_VALUES // max(f * tv.shape[1], 1))
    boots = []
    for start in range(0, draws, chunk):
        rows = idx[start: start + chunk]
        num, den = weighted[rows].sum(1), bv[rows].sum(1)  # [draws, c]
        with np.errstate(divide="ignore", invalid="ignore"):
            boots.append(np.median(1.0 + np.where(den > 0, num / den, np.inf), axis=1))
    lo, hi = np.quantile(np.concatenate(boots), [0.05, 0.95])
    return point, float(lo), float(hi)


BOOTSTRAP_VALUES = 4_000_000  # float64 values one chunk of bootstrap draws may hold (32 MB)


@dataclass
class SampleLayer:
    name: str
    per_rank: dict[int, dict[str, list[Any]]] = field(default_factory=dict)  # rank → {samples, count, tv, bv}


def sample_moments(run: RunData) -> list[SampleLayer]:
    """The `bn_samples` records per layer and rank."""
    layers: dict[str, SampleLayer] = {}
    for rank, proc in run.rank_processes.items():
        for ev in proc.of("bn_samples"):
            cols = ev.get("forwards") or {}
            try:
                vec = np.asarray(run.load_array(ev["moments"]), dtype=np.float64) if ev.get("moments") else None
            except (OSError, ValueError, KeyError):
                vec = None
            if vec is None:
                continue
            offset = 0
            for i, name in enumerate(cols.get("name") or []):
                c = int(cols["channels"][i])
                if offset + 2 * c > vec.size:
                    break
                tv, bv = vec[offset: offset + c], vec[offset + c: offset + 2 * c]
                offset += 2 * c
                layer = layers.setdefault(name, SampleLayer(name))
                rec = layer.per_rank.setdefault(rank, {"samples": [], "count": [], "tv": [], "bv": []})
                rec["samples"].append(int(cols["samples"][i]))
                rec["count"].append(int(cols["count"][i]))
                rec["tv"].append(tv)
                rec["bv"].append(bv)
    return list(layers.values())


def layer_effective_samples(layer: SampleLayer, interval: bool = True) -> dict[int, dict[str, float]]:
    """rank → {n_eff, lo, hi, samples, values} for one layer (median over channels, bootstrap interval; lo and hi
    are NaN with `interval=False`, for an arm whose point estimate only is compared)."""
    out: dict[int, dict[str, float]] = {}
    for rank, rec in layer.per_rank.items():
        if not rec["samples"]:
            continue
        channels = {t.size for t in rec["tv"]}
        if len(channels) != 1:
            continue
        samples, tv, bv = np.array(rec["samples"]), np.stack(rec["tv"]), np.stack(rec["bv"])
        if interval:
            point, lo, hi = effective_samples_interval(samples, tv, bv)
        else:
            point, lo, hi = float(np.median(effective_samples(samples, tv, bv))), float("nan"), float("nan")
        # the estimate's noise can put it above the number of values the batch mean averages, which no set of
        # values can have: bounded there (NaN, an interval not computed, stays NaN)
        values = float(np.median(rec["count"]))
        point, lo, hi = (min(x, values) if x == x else x for x in (point, lo, hi))
        out[rank] = {"n_eff": point, "lo": lo, "hi": hi, "samples": float(np.median(rec["samples"])),
                     "values": values}
    return out


# --------------------------------------------------------------------------------------------------- per run


def sync_groups(ctx: Any) -> dict[str, int]:
    """layer → ranks it normalised over in the run's gradient-enabled training forwards (1: per-rank statistics)."""
    bn = bc.bn_for(ctx)
    out: dict[str, int] = {}
    if bn is None:
        return out
    for layer in bn.layers:
        if layer.synced:
            out[layer.name] = len(layer.info.get("group_ranks") or bn.ranks)
        else:
            out[layer.name] = 1
    return out


def accumulation_of(ctx: Any) -> tuple[dict[str, Any], str, str] | None:
    """(measured, message, verdict) of gradient accumulation in one run, None without it. Optimizer steps that
    average several micro-batches: several backward passes per step (train_step), each after its own forward.
    Not forwards alone: a multi-view or multi-crop recipe forwards the same batch once per view (SimSiam, BYOL,
    DINO's crops; also a DDP-wrapped EMA teacher, whose forward is not counted as training) and takes one backward
    of the summed loss — its BN normalises over the whole per-rank batch each time. Runs recorded without
    train_step fall back to training forwards through DDP between optimizer steps."""
    per_step = [int(e.get("backwards") or 0) for p in ctx.ranks.values() for e in p.of("train_step")]
    if not any(per_step):
        per_step = [int(e.get("ddp_forwards") or 0) for p in ctx.ranks.values() for e in p.of("optimizer_step")]
    per_step = [k for k in per_step if k > 0]
    if not per_step:
        return None
    k = int(np.median(per_step))
    if k < 2:
        return None
    bn = bc.bn_for(ctx)
    if bn is None:
        return None
    first = bn.layers[0]
    per_rank = first.per_rank_samples()
    b = int(np.median(list(per_rank.values()))) if per_rank else 0
    g = sync_groups(ctx).get(first.name, 1)
    world = len(bn.ranks)
    verdict = "likely" if b * g < LARGE_SYNC_BATCH else "possible"
    message = (f"gradient accumulation: each optimizer step averages {k} micro-batches (backward passes) of {b} "
               f"samples per rank ({k * b * world} samples over {world} ranks) but BatchNorm normalises — and "
               f"updates its running statistics — per forward, over {b * g} samples{' with SyncBN' if g > 1 else ''}"
               + (f" (plain BN: {b})" if g > 1 else ""))
    measured = {"summary": f"{k} micro-batches of {b}/rank; BN over {b * g}", "micro_batches": k,
                "micro_batch_per_rank": b, "optimizer_batch": k * b * world, "bn_batch_syncbn": b * g,
                "bn_batch_plain": b}
    return measured, message, verdict



def population(ctx: Any) -> dict[str, Any] | None:
    """Per layer over ranks: running vs population lag (mean in std, var relative), the population estimate's
    standard error, and the eval-output shift; None when not recorded."""
    lags_m, lags_v, ses, shifts = [], [], [], []
    updates: list[int] = []
    needed: list[int] = []
    for proc in ctx.ranks.values():
        ev = proc.last("bn_population")
        if not ev or not ev.get("ok"):
            continue
        if ev.get("eval_output_shift") is not None:
            shifts.append(float(ev["eval_output_shift"]))
        for layer in ev.get("layers") or []:
            tracked = layer.get("batches_tracked")
            updates.append(int(tracked) if tracked is not None else int(ev.get("step") or 0))
            m = layer.get("momentum")
            needed.append(math.ceil(WARMUP_TIME_CONSTANTS / float(m)) if m else 1)
        try:
            vec = np.asarray(ctx.run.load_array(ev["stats"]), dtype=np.float64) if ev.get("stats") else None
        except (OSError, ValueError, KeyError):
            vec = None
        if vec is None:
            continue
        off = 0
        world = max(len(ctx.ranks), 1) if ev.get("pooled") else 1
        for layer in ev.get("layers") or []:
            c, h = int(layer["channels"]), int(layer["batches"])
            need = 6 * c + h * c
            if off + need > vec.size:
                break
            rm, rv, _pm, _pv, gm, gv = (vec[off + i * c: off + (i + 1) * c] for i in range(6))
            means = vec[off + 6 * c: off + 6 * c + h * c].reshape(h, c)
            off += need
            sd = np.sqrt(np.maximum(gv, 0) + float(layer.get("eps") or 1e-5))
            lags_m.append(float(np.sqrt(np.mean(((rm - gm) / sd) ** 2))))
            lags_v.append(float(np.median(np.abs((rv + 1e-12) / (gv + 1e-12) - 1.0))))
            if h > 1:
                ses.append(float(np.sqrt(np.mean((means.std(axis=0, ddof=1) / math.sqrt(h * world) / sd) ** 2))))
    if not lags_m:
        return None
    out = {"mean_lag_std": float(np.median(lags_m)), "var_lag_rel": float(np.median(lags_v)),
           "population_se_std": float(np.median(ses)) if ses else None,
           "eval_output_shift": float(np.median(shifts)) if shifts else None, "layers": len(lags_m),
           "running_stat_updates": min(updates) if updates else None,
           "warmup_updates_needed": max(needed) if needed else None}
    out["lag_not_measurable"] = _lag_not_measurable(out)
    out["shift_not_measurable"] = _shift_not_measurable(out)
    return out


def _warmup_reason(pop: dict[str, Any]) -> str | None:
    n, need = pop.get("running_stat_updates"), pop.get("warmup_updates_needed")
    if n is None or need is None or n >= need:
        return None
    return (f"the running statistics had {n} updates, fewer than the {need} (3/momentum) an exponential average "
            "needs to forget its initial values: their lag measures the warm-up, not the training")


def _lag_not_measurable(pop: dict[str, Any]) -> str | None:
    """Why the running-statistics lag (DD213) of this run is not a measurement, or None: the `measurable?` test."""
    warm = _warmup_reason(pop)
    if warm:
        return warm
    if pop["var_lag_rel"] > MAX_RELATIVE:
        return (f"the running variance differs from the population variance by more than {100 * MAX_RELATIVE:.0f}%: "
                "measured against variances near zero, the relative lag is unbounded")
    return None


def _shift_not_measurable(pop: dict[str, Any]) -> str | None:
    """Why the eval-output shift (DD214) of this run is not a measurement, or None."""
    if pop.get("eval_output_shift") is None:
        return None
    warm = _warmup_reason(pop)
    if warm:
        return warm
    if pop["eval_output_shift"] > MAX_RELATIVE:
        return (f"the eval output moved by more than {100 * MAX_RELATIVE:.0f}% of itself: measured against an output "
                "near zero, the relative shift is unbounded")
    return None


def lag_level(pop: dict[str, Any]) -> str:
    """likely / possible / ruled_out for one run's running-statistics lag (`population`): material against the
    population estimate's own standard error."""
    m, v, se = pop["mean_lag_std"], pop["var_lag_rel"], pop["population_se_std"] or 0.0
    if pop.get("lag_not_measurable"):
        return "not_measurable"
    if (m > LAG_LIKELY and m > 3 * se) or v > VAR_LAG_LIKELY:
        return "likely"
    if (m > LAG_POSSIBLE and m > 2 * se) or v > VAR_LAG_POSSIBLE:
        return "possible"
    return "ruled_out"
