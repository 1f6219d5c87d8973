"""DD215 micro-batch-bn: the rule's catalog entry and its documentation.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half; `ddpdoctor triage` (ddpdoctor/triage/) also decides it across arms.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD215"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="micro-batch-bn",
    severity=Severity.LOW,
    summary=(
        "with gradient accumulation, BN normalises (and updates running stats) per micro-batch, not over the "
        "batch the optimizer sees"
    ),
    what=prose(
        """
        The probe counts the backward passes of every optimizer step and the batch sizes BatchNorm normalised
        over. Two or more backward passes per step is gradient accumulation: the finding gives the samples BN
        normalised over per forward (per rank, and with SyncBN per group) against the samples the optimizer step
        averages over. Forwards alone are not counted: a multi-view or multi-crop recipe (SimSiam, BYOL, DINO)
        forwards each view of the same batch and takes one backward of the summed loss, and a DDP-wrapped EMA
        teacher's forward trains nothing.
        """
    ),
    why=prose(
        """
        Gradient accumulation makes the optimizer see a large batch, but BatchNorm still normalises each
        micro-batch on its own and updates its running statistics once per micro-batch. A recipe ported to
        fewer GPUs with accumulation "to keep the batch size" therefore has the gradient of the large batch
        and the BN noise of the small one, and running statistics averaged over micro-batches. SyncBN
        recovers part of the normalisation batch across ranks; only a larger micro-batch recovers all of it.
        """
    ),
    example=snippet(
        """
        # Bad (for BN): 4 micro-batches of 8 per step, BN sees 8
        for i, (x, y) in enumerate(loader):
            loss_fn(ddp(x), y).backward()
            if (i + 1) % 4 == 0:
                opt.step(); opt.zero_grad()

        # Good: larger micro-batches, SyncBN across ranks, or GroupNorm
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        """
    ),
    fix=(
        "Prefer larger micro-batches (or SyncBN across ranks, or GroupNorm) when BN batches under "
        "accumulation are small."
    ),
)
