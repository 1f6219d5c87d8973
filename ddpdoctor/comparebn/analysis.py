"""compare-bn's analysis: from what the ranks measured to per-layer errors, the non-i.i.d. test, findings and a
verdict. Pure (numpy and `ddpdoctor.bn.stats`; no torch, no processes): `ddpdoctor.comparebn.compare` runs the ranks and
hands their results here; `ddpdoctor.report.compare_bn` renders the result.

Findings go through the rules like every other finding (`ddpdoctor.findings.new_finding`: severity and fix text
from DD201-DD204, whose `compare_bn` fix variants say what to do in compare-bn's terms), and their thresholds are
the rules' parameters.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from ddpdoctor import __version__
from ddpdoctor.findings import Confidence, Finding, Severity, new_finding, rank_findings
from ddpdoctor.formatting import fmt_err, fmt_p
from ddpdoctor.rules import setting

# the rules' thresholds (DD201, DD202, DD204), read through the catalog
LOCAL_ERROR_ALARM = setting("local_error_alarm").default
SMALL_BN_BATCH = setting("small_bn_batch").default
LARGE_SYNC_BATCH = setting("large_sync_batch").default

COMPARE_SCHEMA = "ddpdoctor.compare-bn/1"
MODES = ("local", "local_no_broadcast", "local_reduce", "sync")
MODE_LABELS = {
    "local": "local BN (DDP default)",
    "local_no_broadcast": "local BN, no broadcast",
    "local_reduce": "local BN, running stats averaged over ranks each epoch (timm --dist-bn reduce)",
    "sync": "SyncBN",
}
SYNC_MATCH = 1e-4  # SyncBN within this of the reference "matches" (float32 round-off is ~1e-7)


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """Options of one comparison (the CLI's flags). `model`/`data` are `MODULE:FACTORY` or None for the demo;
    `shard` is "iid", "sorted" or a path to a JSON file of per-rank index lists."""

    model: str | None = None
    data: str | None = None
    nproc: int = 2
    batch_size: int = 16
    steps: int = 20
    shard: str = "iid"
    seed: int = 0
    device: str = "auto"
    timeout: float = 300.0


@dataclass(frozen=True, kw_only=True)
class LayerComparison:
    layer: str
    kind: str
    features: int
    momentum: float | None
    tracked: bool
    norm_batch: dict[str, int]
    running_mean_rel_err: dict[str, float | None]
    running_var_rel_err: dict[str, float | None]
    # RMS over channels of (running_mean - reference) / sqrt(reference running_var): how far eval-mode outputs
    # shift, in standard deviations. Unlike the relative error it stays meaningful when the means sit near zero.
    running_mean_shift_sd: dict[str, float | None]
    rank_spread: dict[str, dict[str, float | None]]
    noniid_p: float | None = None
    noniid_channel: int | None = None
    # median over channels of (reduce-mode running_var - reference) / reference: the sign says which way the
    # averaging of per-rank variances is biased (low when the ranks' means differ)
    reduce_var_bias: float | None = None

    def to_json(self) -> dict[str, Any]:
        return _finite(
            {
                "layer": self.layer,
                "kind": self.kind,
                "features": self.features,
                "momentum": self.momentum,
                "track_running_stats": self.tracked,
                "norm_batch": self.norm_batch,
                "running_mean_rel_err": self.running_mean_rel_err,
                "running_var_rel_err": self.running_var_rel_err,
                "running_mean_shift_sd": self.running_mean_shift_sd,
                "rank_spread": self.rank_spread,
                "noniid": {"p_value": self.noniid_p, "channel": self.noniid_channel},
                "reduce_var_bias": self.reduce_var_bias,
            }
        )


@dataclass(frozen=True, kw_only=True)
class CompareResult:
    config: CompareConfig
    environment: dict[str, Any]
    plan: dict[str, Any]
    layers: tuple[LayerComparison, ...]
    noniid: Any  # ddpdoctor.bn.stats.NonIIDResult
    findings: tuple[Finding, ...]
    verdict: tuple[str, ...]
    timings: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        """Dict access to the JSON document (`result["layers"]`), as on a Report."""
        return self.to_json()[key]

    def _repr_markdown_(self) -> str:
        """Jupyter shows a comparison as its `--format markdown` rendering."""
        from ddpdoctor.report.markdown import render_compare_markdown

        return render_compare_markdown(self)

    def to_json(self) -> dict[str, Any]:
        config = asdict(self.config)
        return _finite(
            {
                "schema": COMPARE_SCHEMA,
                "tool": {"name": "ddpdoctor", "version": __version__},
                "config": config,
                "environment": self.environment,
                "plan": self.plan,
                "layers": [layer.to_json() for layer in self.layers],
                "noniid": self.noniid.to_json(),
                "findings": [f.to_json() for f in rank_findings(self.findings)],
                "verdict": list(self.verdict),
                "timings": self.timings,
            }
        )


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite numbers become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _typical(values: Iterable[int]) -> int:
    counts = Counter(values)
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0] if counts else 0


def analyse(
    cfg: CompareConfig, shard: str, metas: list[dict[str, Any]], arrays: list[dict[str, Any]]
) -> CompareResult:
    """Errors against the reference, rank spread, the non-i.i.d. test, findings and the verdict (numpy only)."""
    import numpy as np

    from ddpdoctor.bn.stats import noniid_test, relative_error

    nproc = len(metas)
    sizes = metas[0]["plan_sizes"]  # [rank][step] samples
    local_sizes = [n for per_rank in sizes for n in per_rank]
    global_sizes = [sum(col) for col in zip(*sizes)]
    ref_arrays = arrays[0]

    layer_means: dict[str, np.ndarray] = {}
    layer_counts: dict[str, np.ndarray] = {}
    n_steps = len(sizes[0])
    for info in metas[0]["layers"]:
        name = info["layer"]
        key = f"moments|{name}|mean"
        if all(key in a and a[key].size for a in arrays):
            calls = min(a[key].shape[0] for a in arrays)
            # A layer called k times per forward (shared BN) records k moments per step; the calls of one step
            # see the same batch, so only the first is an independent replicate.
            stride = calls // n_steps if calls % n_steps == 0 and calls >= n_steps else 1
            layer_means[name] = np.stack([a[key][:calls:stride] for a in arrays])
            layer_counts[name] = np.stack([a[f"moments|{name}|count"][:calls:stride] for a in arrays])
    noniid = noniid_test(layer_means, layer_counts)
    per_layer_test = {t.layer: t for t in noniid.layers}

    layers = []
    for info in metas[0]["layers"]:
        name = info["layer"]
        tracked = f"reference|{name}|running_var" in ref_arrays
        mean_err: dict[str, float | None] = {}
        var_err: dict[str, float | None] = {}
        shift: dict[str, float | None] = {}
        spread: dict[str, dict[str, float | None]] = {"running_mean": {}, "running_var": {}}
        if tracked:
            for stat, errs in (("running_mean", mean_err), ("running_var", var_err)):
                ref = ref_arrays[f"reference|{name}|{stat}"]
                for mode in MODES:
                    per_rank = [a[f"{mode}|{name}|{stat}"] for a in arrays]
                    rel = [relative_error(v, ref) for v in per_rank]
                    worst = max(rel)
                    if mode == "sync":
                        errs["sync"] = worst
                    else:
                        errs[mode] = rel[0]  # rank 0's: what a checkpoint saved by rank 0 holds
                        errs[f"{mode}_worst"] = worst
                    centre = np.mean(per_rank, axis=0)
                    spread[stat][mode] = max(relative_error(v, centre) for v in per_rank)
            ref_mean = ref_arrays[f"reference|{name}|running_mean"]
            ref_sd = np.sqrt(np.maximum(ref_arrays[f"reference|{name}|running_var"], 1e-30))
            for mode in MODES:
                per_rank = [
                    float(np.sqrt(np.mean(((a[f"{mode}|{name}|running_mean"] - ref_mean) / ref_sd) ** 2)))
                    for a in arrays
                ]
                if mode == "sync":
                    shift["sync"] = max(per_rank)
                else:
                    shift[mode] = per_rank[0]
                    shift[f"{mode}_worst"] = max(per_rank)
        spatial = None
        if name in layer_counts and layer_counts[name].shape[1] == n_steps:
            per_sample = layer_counts[name][0] / np.maximum(np.asarray(sizes[0], dtype=float), 1.0)
            spatial = int(round(float(np.median(per_sample))))
        test = per_layer_test.get(name)
        reduce_bias = None
        if tracked and f"local_reduce|{name}|running_var" in arrays[0]:
            ref_var = ref_arrays[f"reference|{name}|running_var"]
            got = arrays[0][f"local_reduce|{name}|running_var"]
            reduce_bias = float(np.median((got - ref_var) / np.maximum(np.abs(ref_var), 1e-30)))
        layers.append(
            LayerComparison(
                layer=name,
                kind=info["kind"],
                features=int(info["features"]),
                momentum=info["momentum"],
                tracked=tracked,
                norm_batch={
                    "local": _typical(local_sizes),
                    "sync": _typical(global_sizes),
                    "local_min": min(local_sizes),
                    "sync_min": min(global_sizes),
                    **({"values_per_sample": spatial} if spatial is not None else {}),
                },
                running_mean_rel_err=mean_err,
                running_var_rel_err=var_err,
                running_mean_shift_sd=shift,
                rank_spread=spread,
                noniid_p=None if test is None else test.p_value,
                noniid_channel=None if test is None else test.channel,
                reduce_var_bias=reduce_bias,
            )
        )

    environment = {
        "device": metas[0]["device"],
        "backend": metas[0]["backend"],
        "torch": metas[0]["torch"],
        "nproc": nproc,
        "samples": metas[0]["n_items"],
        "model": cfg.model or "demo (ddpdoctor.bn.demo:demo_model)",
        "data": cfg.data or "demo (ddpdoctor.bn.demo:demo_data)",
    }
    plan = {
        "shard": shard,
        "steps": len(global_sizes),
        "local_batch": _typical(local_sizes),
        "global_batch": _typical(global_sizes),
        "uneven_steps": sum(1 for col in zip(*sizes) if len(set(col)) > 1),
        "global_batch_sizes": global_sizes,
    }
    timings = {f"rank{m['rank']}": m.get("timings", {}) for m in metas}
    findings = tuple(_findings(layers, noniid, plan))
    verdict = tuple(_verdict(layers, noniid, plan))
    return CompareResult(
        config=cfg,
        environment=environment,
        plan=plan,
        layers=tuple(layers),
        noniid=noniid,
        findings=findings,
        verdict=verdict,
        timings=timings,
    )


def _worst(
    layers: Iterable[LayerComparison], key: str, metric: str = "running_var_rel_err"
) -> tuple[LayerComparison | None, float]:
    """The layer where `metric[key]` is largest, and that value (None, 0.0 when no layer has it)."""
    best: tuple[LayerComparison | None, float] = (None, 0.0)
    for layer in layers:
        v = getattr(layer, metric).get(key)
        if v is not None and (best[0] is None or v > best[1]):
            best = (layer, v)
    return best


@dataclass(frozen=True)
class _Summary:
    """The headline numbers every part of the output quotes, computed once."""

    var_layer: LayerComparison | None
    var_local: float  # rank 0 under DDP's default broadcast
    var_no_broadcast: float  # worst rank without broadcast
    shift_layer: LayerComparison | None
    shift_local: float  # worst of rank 0 / no-broadcast ranks, in reference standard deviations
    mean_layer: LayerComparison | None
    mean_local: float
    sync: float  # worst SyncBN relative error over layers, mean and var
    spread_no_broadcast: float
    broadcast_is_rank0: bool  # DDP's broadcast leaves rank 0 with exactly its own local statistics

    @property
    def local_worst(self) -> float:
        return max(self.var_local, self.var_no_broadcast)


def _summary(layers: list[LayerComparison]) -> _Summary:
    tracked = [layer for layer in layers if layer.tracked]
    var_layer, var_local = _worst(tracked, "local")
    _, var_nb = _worst(tracked, "local_no_broadcast_worst")
    shift_layer, shift = _worst(tracked, "local_no_broadcast_worst", "running_mean_shift_sd")
    _, shift0 = _worst(tracked, "local", "running_mean_shift_sd")
    mean_layer, mean_local = _worst(tracked, "local", "running_mean_rel_err")
    _, sync_var = _worst(tracked, "sync")
    _, sync_mean = _worst(tracked, "sync", "running_mean_rel_err")
    spread = max((lay.rank_spread["running_var"].get("local_no_broadcast") or 0.0 for lay in tracked), default=0.0)
    same = bool(tracked) and all(
        lay.running_var_rel_err.get("local") == lay.running_var_rel_err.get("local_no_broadcast")
        and lay.running_mean_rel_err.get("local") == lay.running_mean_rel_err.get("local_no_broadcast")
        for lay in tracked
    )
    return _Summary(
        var_layer=var_layer, var_local=var_local, var_no_broadcast=var_nb,
        shift_layer=shift_layer, shift_local=max(shift, shift0),
        mean_layer=mean_layer, mean_local=mean_local,
        sync=max(sync_var, sync_mean), spread_no_broadcast=spread, broadcast_is_rank0=same,
    )


def _findings(layers: list[LayerComparison], noniid: Any, plan: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    s = _summary(layers)
    local_batch, global_batch = plan["local_batch"], plan["global_batch"]
    sources = ("compare-bn",)

    if s.var_layer is not None and (s.local_worst >= LOCAL_ERROR_ALARM or s.shift_local >= LOCAL_ERROR_ALARM):
        big = s.local_worst >= 2.5 * LOCAL_ERROR_ALARM or s.shift_local >= 2.5 * LOCAL_ERROR_ALARM
        mean_part = (
            f"; running_mean is off by {s.shift_local:.2g} standard deviations in {s.shift_layer.layer}"
            if s.shift_layer is not None and s.shift_local >= LOCAL_ERROR_ALARM / 2
            else ""
        )
        out.append(
            new_finding(
                "DD201",
                severity=Severity.MEDIUM if big or noniid.non_iid else Severity.LOW,
                confidence=Confidence.CERTAIN,
                sources=sources,
                message=(
                    f"local BN running_var is {fmt_err(s.var_local)} off the global-batch value in "
                    f"{s.var_layer.layer} (rank 0's, which DDP's buffer broadcast hands to every rank; without "
                    f"the broadcast ranks differ by {fmt_err(s.spread_no_broadcast)} and the worst is "
                    f"{fmt_err(s.var_no_broadcast)} off){mean_part}; SyncBN matches to {fmt_err(s.sync)}"
                ),
                evidence={
                    "layer": s.var_layer.layer,
                    "running_var_rel_err": s.var_layer.running_var_rel_err,
                    "running_mean_rel_err": s.var_layer.running_mean_rel_err,
                    "running_mean_shift_sd": s.var_layer.running_mean_shift_sd,
                    "rank_spread_running_var_no_broadcast": s.spread_no_broadcast,
                    "local_batch": local_batch,
                    "global_batch": global_batch,
                },
                fix_variant="compare_bn",
                magnitude=min(1e9, max(s.local_worst, s.shift_local)),
            )
        )
    if local_batch < SMALL_BN_BATCH:
        out.append(
            new_finding(
                "DD202",
                confidence=Confidence.CERTAIN,
                sources=sources,
                message=(
                    f"local BN normalises over {local_batch} samples per rank (global batch {global_batch}): "
                    f"statistics of so few samples are noisy; SyncBN would normalise over {global_batch}"
                ),
                evidence={"local_batch": local_batch, "global_batch": global_batch, "threshold": SMALL_BN_BATCH},
                fix_variant="compare_bn",
                magnitude=float(SMALL_BN_BATCH - local_batch),
            )
        )
    if noniid.non_iid:
        out.append(
            new_finding(
                "DD203",
                confidence=Confidence.CERTAIN if noniid.p_value < 1e-6 else Confidence.LIKELY,
                sources=sources,
                message=(
                    f"shards are not i.i.d.: per-rank BN input means differ beyond sampling noise "
                    f"(p={fmt_p(noniid.p_value)}, strongest in {noniid.layer} channel {noniid.channel}, "
                    f"{plan['shard']} shards)"
                ),
                evidence=_finite(noniid.to_json()),
                fix_variant="compare_bn",
                magnitude=min(300.0, -math.log10(max(noniid.p_value, 1e-300))),
            )
        )
    if local_batch >= LARGE_SYNC_BATCH and noniid.p_value is not None and not noniid.non_iid:
        out.append(
            new_finding(
                "DD204",
                confidence=Confidence.LIKELY,
                sources=sources,
                message=(
                    f"per-rank batch {local_batch} >= {LARGE_SYNC_BATCH} on i.i.d. shards "
                    f"(p={fmt_p(noniid.p_value)}): local BN running_var is within {fmt_err(s.local_worst)} of "
                    f"the global-batch value, so SyncBN adds communication and removes BN's regularising batch "
                    f"noise for no statistical gain"
                ),
                evidence={"local_batch": local_batch, "global_batch": global_batch,
                          "noniid_p": noniid.p_value, "local_running_var_rel_err": s.local_worst},
                fix_variant="compare_bn",
                magnitude=float(local_batch),
            )
        )
    return rank_findings(out)


def _reduce_bias(layer: LayerComparison) -> str:
    """'biased low/high by X%' from the signed bias the reduce mode left in running_var (JSON `reduce_var_bias`)."""
    bias = layer.reduce_var_bias
    if bias is None or not math.isfinite(bias) or abs(bias) < 1e-6:
        return ""
    return f"biased {'low' if bias < 0 else 'high'} by {fmt_err(abs(bias))} (median over channels)"


def _verdict(layers: list[LayerComparison], noniid: Any, plan: dict[str, Any]) -> list[str]:
    """Plain words: the headline sentence first, then what explains it."""
    s = _summary(layers)
    parts: list[str] = []
    if s.var_layer is None:
        parts.append("no BN layer tracks running statistics (track_running_stats=False), so nothing accumulates")
    else:
        parts.append(
            f"local BN running_var is {fmt_err(s.var_local)} off the global-batch value in {s.var_layer.layer}"
        )
        if s.sync <= SYNC_MATCH:
            parts.append(f"SyncBN matches to {fmt_err(s.sync)}")
        else:
            parts.append(f"SyncBN is {fmt_err(s.sync)} off (the model's forward is not deterministic across processes)")
    if noniid.p_value is None:
        parts.append(f"the non-i.i.d. test could not run ({noniid.reason})")
    elif noniid.non_iid:
        parts.append(f"shards are not i.i.d. (p={fmt_p(noniid.p_value)}): use SyncBN or fix the sharding")
    else:
        parts.append(f"shards look i.i.d. (p={fmt_p(noniid.p_value)})")
    lines = ["; ".join(parts) + "."]
    reduce_layer, reduce_err = _worst([lay for lay in layers if lay.tracked], "local_reduce")
    if reduce_layer is not None:
        direction = _reduce_bias(reduce_layer)
        lines.append(
            f"averaging the ranks' running statistics each epoch (timm --dist-bn reduce) leaves running_var "
            f"{fmt_err(reduce_err)} off the global-batch value in {reduce_layer.layer}"
            + (f", {direction}" if direction else "")
            + ("; SyncBN is exact" if s.sync <= SYNC_MATCH else "")
            + (": the ranks' means differ, and averaging variances drops the spread between them" if noniid.non_iid
               else "")
            + "."
        )
    if s.var_layer is not None:
        if s.shift_layer is not None and s.shift_local >= LOCAL_ERROR_ALARM / 2:
            lines.append(
                f"local running_mean is off by {s.shift_local:.2g} standard deviations in {s.shift_layer.layer}: "
                "eval-mode outputs of that layer shift by that much."
            )
        if s.broadcast_is_rank0:
            lines.append(
                "DDP's buffer broadcast does not average anything: rank 0 ends with exactly the statistics of its "
                "own batches, and every other rank gets them at the next forward."
            )
        if noniid.p_value is not None and not noniid.non_iid and s.local_worst < LOCAL_ERROR_ALARM:
            lines.append(
                f"the local error is the sampling noise of {plan['local_batch']}-sample batches; SyncBN is not "
                "needed for the statistics at this batch size."
                if plan["local_batch"] >= SMALL_BN_BATCH
                else f"the local error is the sampling noise of {plan['local_batch']}-sample batches."
            )
    return lines
