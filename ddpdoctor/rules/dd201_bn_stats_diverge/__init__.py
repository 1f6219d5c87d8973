"""DD201 bn-stats-diverge: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, Setting, prose, snippet

CODE = "DD201"

# Local running statistics this far (relative) from the global-batch value are a finding in compare-bn; below it
# the gap is the sampling noise of a per-rank batch, which compare-bn shows in its table without alarm.
LOCAL_ERROR_ALARM = 0.10

# The probe half's thresholds.
MATERIAL = 1e-3  # difference (std for means, relative for variances) below which diverging statistics are harmless
ALIGNED = 1e-4  # statistics before the last update agree to float32 round-off amplified by 1 / (1 - f)

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("local_error_alarm", LOCAL_ERROR_ALARM, "relative error",
                "local running statistics this far from the global-batch value are a compare-bn finding; below it "
                "the gap is a per-rank batch's sampling noise"),
        Setting("bn_divergence_material", MATERIAL, "std (means) or relative (variances)",
                "a difference between ranks' statistics below this is harmless"),
        Setting("bn_stats_aligned", ALIGNED, "relative",
                "statistics before the last update agree within this (float32 round-off amplified by "
                "1 / (1 - momentum))"),
    ),
    name="bn-stats-diverge",
    severity=Severity.MEDIUM,
    summary="local BN running stats differ across ranks at the end (broadcast_buffers=False)",
    what=prose(
        """
        The probe records every BatchNorm layer's running_mean and running_var on each rank at the end of the
        observed run and fires when they differ across ranks beyond float round-off, with the layers, the
        largest relative difference and DDP's `broadcast_buffers` setting. With `broadcast_buffers=False`
        the difference builds up over the whole run. With the default `True` ranks still differ by their
        last update (rank 0's buffers are broadcast at the start of each forward, then every rank applies
        its own batch's update), which is why the setting is part of the evidence.
        """
    ),
    why=prose(
        """
        Running statistics are what the model normalises with at evaluation time. Per-GPU BatchNorm updates
        them from each rank's own batches. With `broadcast_buffers=False` nothing ever reconciles them:
        every rank ends with a different eval-mode model, per-rank validation scores disagree, and the
        checkpoint (usually rank 0's) carries statistics estimated from rank 0's shard alone, noisier than
        the recipe's and biased if the shards differ (DD203). The default broadcast copies rank 0's buffers
        to all ranks at the start of each forward, which keeps ranks aligned but still means the statistics
        come from rank 0's batches only.
        """
    ),
    example=snippet(
        """
        # Bad: buffers never reconciled; rank 0's checkpoint has rank 0's statistics
        ddp = DDP(model, device_ids=[local_rank], broadcast_buffers=False)

        # Good: average the running statistics before evaluating and saving (or use SyncBatchNorm)
        world_size = dist.get_world_size()
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                for buf in (m.running_mean, m.running_var):
                    dist.all_reduce(buf)
                    buf /= world_size
        """
    ),
    fix=(
        "Keep BatchNorm buffers identical across ranks: use SyncBatchNorm, keep broadcast_buffers=True, or "
        "all-reduce (average) the running statistics before evaluating and saving."
    ),
    fix_variants={
        "compare_bn": (
            "use SyncBatchNorm (convert_sync_batchnorm before wrapping in DDP) or larger i.i.d. per-rank batches; "
            "re-estimate BN statistics over training data before evaluating a checkpoint"
        ),
        "shuffle_bn": (
            "Keep per-GPU BatchNorm here (SyncBatchNorm would undo the shuffle) and average running_mean and "
            "running_var across ranks (all_reduce / world size) before evaluating and saving."
        ),
    },
)
