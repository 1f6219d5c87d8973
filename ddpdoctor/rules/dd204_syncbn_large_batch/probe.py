"""DD204 syncbn-large-batch: SyncBatchNorm over per-rank batches that are already large (>= LARGE_SYNC_BATCH).

What it does: for SyncBN layers that synchronised in their gradient-enabled training forwards, takes the typical
per-rank batch; at LARGE_SYNC_BATCH samples (the rule's parameter) or more it reports the local and the global
normalisation batch (samples, and values per channel) and the measured noise of the BN statistics under both — the
batch mean in units of the channel's standard deviation, the batch variance relatively — from the per-rank input
moments the probe recorded (`bn_common.batch_noise`: measured across ranks within each step, so the model's drift
from step to step does not count as noise; the plain step-to-step numbers are in evidence too): local = each rank's own
batch (what per-GPU BN would normalise with), global = the ranks' batches pooled (what SyncBN normalised
with). Synchronising removes that noise; with per-rank batches this large the local estimate is already good,
so the sync buys no accuracy and takes away the noise that regularises (ghost batch norm), a known reason a
SyncBN run scores lower than plain DDP. Alternatives: per-GPU BN, or SyncBN over small subgroups
(`convert_sync_batchnorm(model, process_group=dist.new_group(...))`).
"""

from __future__ import annotations

import numpy as np

from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd204_syncbn_large_batch import CODE, LARGE_SYNC_BATCH

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the SyncBN layers measured synchronising per-rank batches large enough alone",
    measure=key("layers"))


def analyze(ctx: RunContext) -> list[Finding]:
    bn = bc.bn_for(ctx)
    if bn is None or not bc.distributed(ctx.run):
        return []
    large = []
    synced = [layer for layer in bn.layers if layer.synced]
    for layer in synced:
        per_rank = layer.per_rank_samples()
        if per_rank and int(np.median(list(per_rank.values()))) >= LARGE_SYNC_BATCH:
            large.append(layer)
    if not large:
        return []
    first = large[0]
    nb = bc.normalisation_batch(first, bn.ranks)
    per_rank = sorted(set(nb["per_rank_samples"].values()))
    group = nb.get("group_ranks") or bn.ranks
    noises = {layer.name: bc.batch_noise(layer, bn.ranks) for layer in large}
    measured = {k: v for k, v in noises.items() if v is not None}
    noise_text = ""
    summary = None
    if measured:
        summary = {
            key: float(np.median([v[key] for v in measured.values()]))
            for key in ("local_mean_noise", "global_mean_noise", "local_var_noise", "global_var_noise")
        }
    if summary is not None and summary["local_mean_noise"] > 0:  # 0: identical batches on every rank (DD302)
        noise_text = (
            f"; syncing cuts the noise of the batch mean BN subtracts from {summary['local_mean_noise']:.3f} std "
            f"per rank to {summary['global_mean_noise']:.3f}, of the batch variance from "
            f"{100 * summary['local_var_noise']:.1f}% to {100 * summary['global_var_noise']:.1f}% (median over "
            f"{len(measured)} layer{'s' if len(measured) != 1 else ''})"
        )
    message = (
        f"{len(large)} SyncBatchNorm {'layers normalise' if len(large) != 1 else 'layer normalises'} over "
        f"{nb['global_samples']} samples ({len(group)} ranks x "
        f"{'/'.join(str(s) for s in per_rank)}) although each rank's {'/'.join(str(s) for s in per_rank)} "
        f"already give stable statistics{noise_text}: syncing removes the batch-statistics noise that regularises "
        "(ghost batch norm), a likely reason a SyncBN run scores lower than plain DDP — keep per-GPU BatchNorm, "
        "or sync over small subgroups"
    )
    site = bc.convert_site(ctx.run) or first.info.get("site")
    evidence = {
        "per_rank_samples": {str(r): s for r, s in nb["per_rank_samples"].items()},
        "per_rank_values_per_channel": {str(r): v for r, v in nb["per_rank_values"].items()},
        "global_samples": nb["global_samples"],
        "global_values_per_channel": nb["global_values"],
        "group_ranks": list(group),
        "layers": [layer.name for layer in large],
        "syncbn_layers": len(synced),
        "batch_noise": bc.rounded(measured),
        "batch_noise_median": bc.rounded(summary),
        "alternatives": [
            "per-GPU nn.BatchNorm (the recipe's normalisation batch)",
            "nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=dist.new_group(ranks_of_a_small_group))",
        ],
        "syncbn_replay_rel_error": bc.replay_errors(ctx),
    }
    return [
        ctx.finding(
            CODE,
            message=message,
            site=site,
            ranks=bn.ranks,
            evidence=evidence,
            magnitude=float(per_rank[0]),
        )
    ]

