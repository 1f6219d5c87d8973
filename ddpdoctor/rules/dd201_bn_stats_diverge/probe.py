"""DD201 bn-stats-diverge: BatchNorm running statistics differ across ranks at the end of the run.

What it does: compares the running_mean / running_var every rank holds at the end (bn_final) and reports the
largest difference and its layer: for running_mean in units of the channel's standard deviation (means often sit
near zero, where a relative error says nothing), for running_var relative. What counts depends on DDP's
`broadcast_buffers`:

- `False` (or BN layers outside any DDP model): nothing reconciles the ranks' statistics; any difference above
  1e-3 is reported — it grows over the whole run.
- `True` (the default): DDP broadcasts rank 0's buffers at the start of every forward and each rank then applies
  its own batch's update, so ranks always end one local update apart (0.13 on a plain DDP run,
  docs/facts.md#batchnorm-buffers-under-plain-ddp; 0.33 std of the first layer's running_mean in the bn_iid_default
  fixture).
  That difference is expected and not reported. The analysis reconstructs the statistics each rank held *before*
  its last update, S = (final - f * batch statistic) / (1 - f) from the recorded batch moments and the layer's
  momentum f; when they agree across ranks (to 1e-4) the broadcast works. When they do not, the broadcast never
  reached those layers (training forwards that bypass the DDP wrapper, BN in a module DDP does not own) and the
  finding is reported with that explanation.

This module also builds the report's BatchNorm table (local running statistics against the SyncBN replay, per
layer; see `bn_table`), since that comparison is the measurement behind this rule.

Why it matters, example, fix: see `ddpdoctor explain DD201`.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_num, pct
from ddpdoctor.bn.stats import relative_error
from ddpdoctor.findings import Finding, Severity
from ddpdoctor.formatting import fmt_p, fmt_sig
from ddpdoctor.rules.dd201_bn_stats_diverge import ALIGNED, CODE, MATERIAL

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the largest difference measured between the ranks' BN running statistics",
    measure=key("max_diff"))


def analyze(ctx: RunContext) -> list[Finding]:
    bn = bc.bn_for(ctx)
    if bn is None:
        return []
    table = bn_table(ctx)
    if table is not None:
        ctx.tables["batchnorm"] = table
    alone = _syncbn_without_group(bn)
    if alone and (len(bn.ranks) < 2 or not bc.distributed(ctx.run)):
        ctx.notes.append(
            f"{len(alone)} SyncBatchNorm layer{'s' if len(alone) != 1 else ''} (first: `{alone[0]}`) never "
            "synchronised: the run has no process group across processes (one process: nn.DataParallel or a "
            "single-process run), so SyncBatchNorm normalises each replica's own batch, as plain BatchNorm does "
            "— the conversion changes nothing here; synchronised statistics need one process per GPU "
            "(DistributedDataParallel)")
    if len(bn.ranks) < 2 or not bc.distributed(ctx.run):
        return []  # processes that never formed a group each train their own model
    ddps = bc.ddp_inits(ctx.run)
    broadcast = bool(ddps[0].get("broadcast_buffers", True)) if ddps else None
    rows: list[dict[str, Any]] = []
    explained_rows: list[dict[str, Any]] = []
    for layer in bn.layers:
        if not layer.info.get("track_running_stats", True):
            continue
        spread = bc.cross_rank_spread(layer, bn.ranks)
        if spread is None or spread["max"] <= MATERIAL:
            continue
        gap = _gap_before_last_update(layer, bn.ranks)
        row = {
            "layer": layer.name,
            "kind": layer.kind,
            "max": bc.finite(spread["max"]),
            "stat": spread["stat"],
            "rank": spread["rank"],
            "running_mean_diff_std": {str(r): bc.finite(v) for r, v in spread["mean"].items()},
            "running_var_rel_diff": {str(r): bc.finite(v) for r, v in spread["var"].items()},
            "diff_before_last_update": bc.finite(gap),
        }
        if broadcast and gap is not None and gap <= ALIGNED:
            explained_rows.append(row)
        elif broadcast and gap is None:
            explained_rows.append(row)  # cannot tell; the default broadcast gets the benefit of the doubt
        else:
            rows.append(row)
    if explained_rows and table is not None:
        worst = max(explained_rows, key=lambda r: r["max"])
        table["caption"] += (
            f" Ranks end up to {_amount(worst)} apart ({worst['stat']} of {worst['layer']}) only through their own "
            "last update: DDP broadcasts rank 0's buffers before every forward (broadcast_buffers=True)."
        )
    if not rows:
        return []
    worst = max(rows, key=lambda r: r["max"])
    bypass = sum(1 for _, _e in ctx.run.events("forward_bypass"))
    wrapper = ddps[0].get("wrapper") if ddps else None
    fix_detail = None
    if broadcast is None and any(True for _ in ctx.run.events("grad_averaging")):
        fix_detail = (
            "With Horovod: build the model with hvd.SyncBatchNorm, or average the buffers before evaluating and "
            "saving (for b in model.buffers(): hvd.allreduce_(b) for floating-point buffers)."
        )
        why = (
            "Horovod's DistributedOptimizer averages gradients only, never buffers, so every rank keeps the "
            "statistics of its own batches and rank 0's checkpoint carries rank 0's"
        )
    elif broadcast is None:
        why = "these layers are not inside a DDP model, so nothing reconciles the ranks' statistics"
    elif wrapper:
        if wrapper.startswith("apex."):
            fix_detail = ("With apex: model = apex.parallel.convert_syncbn_model(model) before the optimizer is "
                          "built (it clones weight and bias).")
        why = (
            f"{wrapper} never broadcasts buffers (unlike torch's DDP), so nothing reconciles them: every rank "
            "evaluates with statistics of its own batches, and rank 0's checkpoint carries rank 0's"
        )
    elif not broadcast:
        why = (
            "with broadcast_buffers=False nothing reconciles them: every rank evaluates with statistics of its own "
            "batches, and rank 0's checkpoint carries rank 0's"
        )
    else:
        reason = (
            "training forwards bypass the DDP wrapper" if bypass
            else "the layers run outside the DDP-wrapped module's forward"
        )
        why = (
            "although DDP broadcasts rank 0's buffers (broadcast_buffers=True), the statistics had diverged before "
            f"each rank's last update ({fmt_num(round(worst['diff_before_last_update'] or 0.0, 4))} apart), so "
            f"the broadcast does not reach them ({reason})"
        )
    # shuffle-BN (MoCo): per-GPU statistics are the method, so the fix reconciles the buffers and keeps per-GPU BN
    shuffle = bc.batch_shuffle(ctx, bc.normalisation_batch(bn.layers[0], bn.ranks)["global_samples"])
    if shuffle is not None:
        why += (
            f"; the ranks shuffle each global batch among themselves ({shuffle['gather_op']} at "
            f"{ctx.at(shuffle['gather_site'])}): per-GPU BatchNorm is the design (shuffle-BN), only its running "
            "statistics need reconciling"
        )
    tracked = sum(1 for layer in bn.layers if layer.info.get("track_running_stats", True))
    message = (
        f"BatchNorm running statistics differ across ranks at the end by up to {_amount(worst)} "
        f"({worst['stat']} of {worst['layer']}, rank {worst['rank']} vs rank {bn.ranks[0]}; "
        f"{len(rows)} of {tracked} layers differ by more than {MATERIAL:g}): {why}"
    )
    site = ddps[0].get("site") if ddps else None
    if site is None:
        first = bn.by_name(worst["layer"])
        site = first.info.get("site") if first is not None else None
    evidence = {
        "broadcast_buffers": broadcast,
        "reference_rank": bn.ranks[0],
        "max_diff": worst["max"],
        "max_diff_unit": "std" if worst["stat"] == "running_mean" else "relative",
        "max_layer": worst["layer"],
        "max_stat": worst["stat"],
        "layers": rows,
        "aligned_before_last_update": [r["layer"] for r in explained_rows],
        "forward_bypasses": bypass,
        "syncbn_replay_rel_error": bc.replay_errors(ctx),
        **({"batch_shuffle": shuffle} if shuffle is not None else {}),
    }
    severity = Severity.MEDIUM if worst["max"] >= 0.01 else Severity.LOW
    return [
        ctx.finding(
            CODE,
            message=message,
            severity=severity,
            site=site,
            ranks=bn.ranks,
            evidence=evidence,
            magnitude=worst["max"],
            fix_detail=fix_detail,
            **({"fix_variant": "shuffle_bn"} if shuffle is not None else {}),
        )
    ]


def _amount(row: dict[str, Any]) -> str:
    """0.42 std (running_mean) or 12% (running_var)."""
    value = float(row["max"])
    return f"{value:.2g} std" if row["stat"] == "running_mean" else pct(value)


def _gap_before_last_update(layer: bc.LayerRun, ranks: list[int]) -> float | None:
    before = bc.before_last_update(layer, ranks)
    if before is None or len(before) < 2:
        return None
    ref_mean, ref_var = before[min(before)]
    return max(max(bc.mean_gap(m, ref_mean, ref_var), relative_error(v, ref_var)) for m, v in before.values())


TABLE_ROWS = 16


def _noniid_decision(test: Any) -> str:
    """What decides DD203, so that a small p in the table is never read as a finding the report lacks: the test
    combined over layers, and a difference large enough to matter."""
    from ddpdoctor.rules.dd203_non_iid_shards import MATERIAL_EFFECT

    if test.non_iid:
        return (f" Combined over layers p = {fmt_p(test.p_value)}, below {fmt_p(test.threshold)}: DD203 reports it "
                f"when some channel's means also differ by at least {MATERIAL_EFFECT:g} within-batch standard "
                "deviations between ranks.")
    return (f" Combined over layers p = {fmt_p(test.p_value)}, not below {fmt_p(test.threshold)}: no evidence of "
            "non-i.i.d. shards (one small p among many layers is expected by chance).")


def _syncbn_without_group(bn: Any) -> list[str]:
    """SyncBatchNorm layers (torch's, apex's, emulated) none of whose forwards synchronised."""
    return [layer.name for layer in bn.layers if layer.kind in ("sync", "emulated_sync") and not layer.synced]


def bn_table(ctx: RunContext) -> dict[str, Any] | None:
    """The BN table of the text report: per layer, what it normalised over, how far each rank's running
    statistics are from what SyncBN would have accumulated from the same batches (the compare-bn card's
    comparison, measured on the user's model and data in this run), the spread across ranks, and the
    non-i.i.d. p-value."""
    bn = bc.bn_for(ctx)
    if bn is None:
        return None
    test = bc.noniid_for(ctx)
    layer_p = test.layer_p_values if test is not None else {}
    rows = []
    scores = []
    for layer in bn.layers:
        nb = bc.normalisation_batch(layer, bn.ranks)
        per_rank = sorted(set(nb["per_rank_samples"].values()))
        local = "/".join(str(v) for v in per_rank) or "-"
        if layer.synced:
            norm = f"{nb['global_samples']} (sync)"
        else:
            norm = local
        cmp = bc.local_vs_syncbn(layer, bn.ranks)
        spread = bc.cross_rank_spread(layer, bn.ranks)
        p = layer_p.get(layer.name)
        rows.append([
            layer.name,
            "SyncBN (local)" if layer.kind in ("sync", "emulated_sync") and not layer.synced
            else {"plain": "BN", "sync": "SyncBN", "emulated_sync": "SyncBN*"}.get(layer.kind, layer.kind),
            local,
            norm,
            fmt_sig(cmp["max_mean_std"]) if cmp else "n/a",
            fmt_sig(cmp["max_var"]) if cmp else "n/a",
            fmt_sig(spread["max"]) if spread else "n/a",
            fmt_p(p) if p is not None else "n/a",
        ])
        scores.append(max(cmp["max_mean_std"], cmp["max_var"]) if cmp else 0.0)
    caption = (
        "vs SyncBN: how far the running statistics each rank holds at the end are from what SyncBN would have "
        "accumulated from the same per-rank batches (the worst rank): running_mean in standard deviations (RMS "
        "over channels), running_var as a relative L2 error (both relative L2 errors are in the JSON evidence); "
        "spread: largest difference between ranks (means in std, variances relative); p: non-i.i.d. test of the "
        "ranks' input means, per layer."
    )
    if test is not None and test.p_value is not None:
        caption += _noniid_decision(test)
    if any(layer.kind == "emulated_sync" and layer.synced for layer in bn.layers):
        caption += " SyncBN*: SyncBatchNorm computed by ddpdoctor's CPU emulation (exact global statistics)."
    if _syncbn_without_group(bn):
        caption += (" SyncBN (local): SyncBatchNorm that never synchronised (no process group across processes), "
                    "normalising each replica's own batch.")
    if len(rows) > TABLE_ROWS:
        keep = sorted(sorted(range(len(rows)), key=lambda i: -scores[i])[:TABLE_ROWS])
        caption += f" {len(rows) - TABLE_ROWS} of {len(rows)} layers with the smallest errors not shown."
        rows = [rows[i] for i in keep]
    return {
        "title": f"BatchNorm layers ({len(bn.layers)}) on {len(bn.ranks)} ranks: local running stats vs SyncBN",
        "columns": ["layer", "kind", "batch/rank", "normalised over", "mean vs SyncBN (std)", "var vs SyncBN",
                    "spread", "non-iid p"],
        "rows": rows,
        "caption": caption,
    }
