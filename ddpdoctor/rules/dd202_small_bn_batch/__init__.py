"""DD202 small-bn-batch: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, Setting, prose, snippet

CODE = "DD202"

# Below this many samples per rank, per-GPU BatchNorm statistics are too noisy (the default of
# `[tool.ddpdoctor] small_bn_batch`; the error curve in `why` is where it comes from).
SMALL_BN_BATCH = 16

# The probe half's thresholds.
VERY_SMALL = 4  # samples per rank at or below which the finding is high (27.3% vs 23.6% error, `why`)

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("small_bn_batch", SMALL_BN_BATCH, "samples per rank",
                "per-GPU BatchNorm normalising over fewer samples than this is a finding", option=True),
        Setting("very_small_bn_batch", VERY_SMALL, "samples per rank",
                "at or below this the finding is high (27.3% vs 23.6% error, `why`)"),
    ),
    name="small-bn-batch",
    severity=Severity.MEDIUM,
    summary=f"local BN normalises over a per-rank batch below {SMALL_BN_BATCH} samples",
    what=prose(
        f"""
        The probe records the input shape of every training-mode forward of a per-GPU (not synchronised)
        BatchNorm layer and fires when the per-rank batch it normalises over is below {SMALL_BN_BATCH} samples (the
        threshold is `small_bn_batch` in `[tool.ddpdoctor]`), with the per-rank and global batch sizes.
        """
    ),
    why=prose(
        """
        In training mode BatchNorm normalises with the mean and variance of the current batch. Splitting a
        single-GPU recipe's batch over N GPUs keeps the global batch, and so the gradient noise, the same,
        but BatchNorm now sees batch / N samples: its statistics are noisier, the running averages used at
        evaluation are built from them, and training and evaluation normalise differently. The loss is
        sharp below about 16 per GPU: ResNet-50 on ImageNet with per-GPU BatchNorm reaches 23.6% top-1 error
        at 32 images per GPU, 23.7% at 16, 24.8% at 8, 27.3% at 4 and 34.7% at 2 (Wu and He, Group
        Normalization, 2018).
        """
    ),
    example=snippet(
        """
        # Bad: the recipe's batch of 64 spread over 8 GPUs; BN normalises over 8
        loader = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set))

        # Good: normalise over the global batch of 64
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        ddp = DDP(model.cuda(local_rank), device_ids=[local_rank])
        """
    ),
    fix=(
        f"Raise the per-GPU batch to {SMALL_BN_BATCH} or more, or normalise over more samples with nn.SyncBatchNorm "
        "(or use GroupNorm)."
    ),
    fix_variants={
        "compare_bn": f"use SyncBatchNorm, or raise the per-rank batch to at least {SMALL_BN_BATCH} samples",
        "shuffle_bn": (
            f"Keep per-GPU BatchNorm here (shuffle-BN needs each GPU's own statistics; SyncBatchNorm would undo "
            f"the shuffle) and raise the per-GPU batch to {SMALL_BN_BATCH} or more."
        ),
    },
)
