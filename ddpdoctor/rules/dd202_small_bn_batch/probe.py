"""DD202 small-bn-batch: per-GPU (not synchronised) BatchNorm normalises over fewer samples than the threshold.

What it does: takes the gradient-enabled training forwards of every BatchNorm layer that normalises over its own
rank's batch (plain BN, or SyncBN that never synchronised) and fires when the typical (median) per-rank batch is
below `small_bn_batch` (the rule's SMALL_BN_BATCH unless `[tool.ddpdoctor] small_bn_batch` / the run's meta says
otherwise). Samples, not values: the spatial positions of one image are strongly correlated, so a batch of 4
images of 56x56 still gives BatchNorm four images' worth of statistics. The evidence has the per-rank and global
batch, values per channel, the measured noise of the batch statistics (per rank and over the global batch,
`bn_common.batch_noise`), and the local-vs-SyncBN running-statistics errors.

Severity: medium; high at 4 samples per rank or fewer (ResNet-50 error 27.3% at 4 vs 23.6% at 32 per GPU); low, with
a message that says so, when the measured noise of the small layers is negligible on this data (each rank's batch
mean within 0.05 std and its variance within 5% of the global batch's, and as steady from step to step): a
message never contradicts its numbers.

Shuffle-BN (MoCo v1): when the ranks shuffle each global batch among themselves during training — an all_gather
followed by a broadcast of an integer tensor with one entry per sample of the global batch (the permutation) — the
per-GPU statistics are the design (the query's and its key's batch statistics must come from different subsets),
so the finding names the shuffle and the fix keeps per-GPU BN and raises the per-GPU batch instead of recommending
SyncBatchNorm, which would undo it.
"""

from __future__ import annotations

import numpy as np

from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Finding, Severity
from ddpdoctor.rules import get_rule
from ddpdoctor.rules.dd202_small_bn_batch import CODE, SMALL_BN_BATCH, VERY_SMALL

# measured noise below which the per-rank statistics are, on this data, as good as the global batch's
QUIET_MEAN = 0.05  # rank batch mean vs global, in standard deviations
QUIET_VAR = 0.05  # rank batch variance vs global, relative

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the BN layers measured normalising fewer samples per rank than the threshold",
    measure=key("layers"))


def analyze(ctx: RunContext) -> list[Finding]:
    bn = bc.bn_for(ctx)
    if bn is None or not bc.distributed(ctx.run):
        return []
    threshold = int(ctx.settings.small_bn_batch or SMALL_BN_BATCH)
    small = []
    for layer in bn.layers:
        if not layer.local:
            continue
        per_rank = layer.per_rank_samples()
        if not per_rank:
            continue
        typical = int(np.median(list(per_rank.values())))
        if typical < threshold:
            small.append((layer, per_rank, typical))
    if not small:
        return []
    local_layers = [layer for layer in bn.layers if layer.local and layer.per_rank_samples()]
    first, per_rank, typical = small[0]
    nb = bc.normalisation_batch(first, bn.ranks)
    values = sorted(set(nb["per_rank_values"].values()))
    # the worst measured noise over the small layers: the first layer alone can look harmless when deeper ones
    # are not
    noises = [n for n in (bc.batch_noise(layer, bn.ranks) for layer, _, _ in small) if n is not None]
    noise = max(noises, key=lambda n: (n["rank_vs_global_mean"], n["rank_vs_global_var"])) if noises else None
    sizes = sorted(set(per_rank.values()))
    batch_text = "/".join(str(s) for s in sizes)
    spatial = ""
    if values and sizes and values[0] != sizes[0]:
        spatial = f" ({'/'.join(str(v) for v in values)} values per channel with the spatial positions)"
    noise_text = ""
    if noise is not None:
        noise_text = (
            f"; each rank's batch mean is {noise['rank_vs_global_mean']:.2f} std and its variance "
            f"{100 * noise['rank_vs_global_var']:.0f}% away from the global batch's (measured at each step)"
        )
    # quiet: each rank's statistics equal the global batch's *and* barely move from step to step (ranks fed the
    # same batches look equal to the global batch too, yet their statistics jump with every batch)
    steps = (noise or {}).get("step_to_step") or {}
    quiet = (
        noise is not None and bool(steps)
        and noise["rank_vs_global_mean"] < QUIET_MEAN and noise["rank_vs_global_var"] < QUIET_VAR
        and steps.get("local_mean", 1.0) < QUIET_MEAN and steps.get("local_var", 1.0) < QUIET_VAR
    )
    if quiet:
        # the message must not contradict its numbers: these batches happened to give the global statistics
        consequence = (
            ": on this data each rank's statistics stayed close to the global batch's, so the small batch cost "
            "little here; data with more variation between samples makes them noisy"
        )
    else:
        consequence = (
            ": noisy batch statistics in training and running statistics that do not match them at evaluation"
        )
    message = (
        f"{len(small)} of {len(local_layers)} per-GPU BatchNorm layers normalise over {batch_text} samples per rank "
        f"(below {threshold}){spatial}, while the global batch is {nb['global_samples']} on "
        f"{len(bn.ranks)} ranks{noise_text}{consequence}"
    )
    shuffle = bc.batch_shuffle(ctx, nb["global_samples"])
    if shuffle is not None:
        message += (
            f"; the ranks shuffle each global batch among themselves ({shuffle['gather_op']} at "
            f"{ctx.at(shuffle['gather_site'])}, a permutation of {shuffle['permutation']} broadcast at "
            f"{ctx.at(shuffle['broadcast_site'])}): per-GPU BatchNorm is the design here (shuffle-BN), so the "
            "remedy is more samples per GPU, not SyncBatchNorm"
        )
    severity = Severity.HIGH if typical <= VERY_SMALL else get_rule(CODE).severity
    if quiet:
        severity = Severity.LOW  # severity follows the measured consequence
    site = bc.training_loader_site(ctx.run) or first.info.get("site")
    evidence = {
        "threshold": threshold,
        "per_rank_samples": {str(r): s for r, s in per_rank.items()},
        "per_rank_values_per_channel": {str(r): v for r, v in nb["per_rank_values"].items()},
        "global_samples": nb["global_samples"],
        "ranks": len(bn.ranks),
        "layers": [layer.name for layer, _, _ in small],
        "local_layers": len(local_layers),
        "batch_noise": bc.rounded(noise),
        "syncbn_replay_rel_error": bc.replay_errors(ctx),
        **({"batch_shuffle": shuffle} if shuffle is not None else {}),
    }
    return [
        ctx.finding(
            CODE,
            message=message,
            severity=severity,
            **({"fix_variant": "shuffle_bn"} if shuffle is not None else {}),
            site=site,
            ranks=sorted(per_rank),
            evidence=evidence,
            magnitude=threshold / max(typical, 1),
        )
    ]
