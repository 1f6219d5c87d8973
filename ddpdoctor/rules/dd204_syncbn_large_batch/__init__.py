"""DD204 syncbn-large-batch: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, Setting, prose, snippet

CODE = "DD204"

# A per-rank batch at which local BatchNorm statistics are already good: syncing them gains nothing (`why`).
LARGE_SYNC_BATCH = 32

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("large_sync_batch", LARGE_SYNC_BATCH, "samples per rank",
                "local BatchNorm statistics from this many samples are already good: syncing them gains nothing"),
    ),
    name="syncbn-large-batch",
    severity=Severity.LOW,
    summary=(
        f"SyncBN over a per-rank batch already >= {LARGE_SYNC_BATCH}: no statistical gain, lost BN noise (ghost-BN "
        "regularisation) — a known reason SyncBN runs score lower"
    ),
    what=prose(
        f"""
        The probe records every training-mode SyncBatchNorm forward and fires when the per-rank batch is
        already {LARGE_SYNC_BATCH} samples or more, with the per-rank and global normalisation batch and the number of
        synchronised layers.
        """
    ),
    why=prose(
        """
        SyncBatchNorm normalises with the statistics of the global batch (per-rank batch × ranks). That
        helps when per-GPU batches are small (DD202); at 32 or more per GPU the per-GPU estimate is already
        good (23.6% vs 23.7% ResNet-50 error at 32 vs 16 per GPU in the Group Normalization paper), so syncing
        buys no accuracy and takes away the noise of per-batch statistics. That noise regularises: "ghost"
        batch norm over small virtual batches improves the generalisation of large-batch training (Hoffer et
        al., 2017), and the large-batch ImageNet recipe (Goyal et al., 2017) deliberately computes BN
        statistics per worker over 32 images, noting that the BN batch size is part of the loss being
        optimised. A recipe tuned with per-GPU BatchNorm therefore tends to score lower after switching to
        SyncBN, and every BN layer adds a blocking all-gather to each forward.
        """
    ),
    example=snippet(
        """
        # Bad (for this batch): 64 images per GPU, synchronised over 8 GPUs = BN over 512
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        ddp = DDP(model.cuda(local_rank), device_ids=[local_rank])

        # Good: keep the recipe's per-GPU BatchNorm
        ddp = DDP(model.cuda(local_rank), device_ids=[local_rank])
        """
    ),
    fix=(
        f"Keep per-GPU BatchNorm when the per-GPU batch is {LARGE_SYNC_BATCH} or more; use SyncBatchNorm "
        "(optionally over a small process_group) where per-GPU batches are small."
    ),
    fix_variants={
        "compare_bn": "keep plain BN (or ghost batch norm) unless per-rank batches are small or shards are not i.i.d.",
    },
)
