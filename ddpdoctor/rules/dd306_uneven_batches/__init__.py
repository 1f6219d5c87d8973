"""DD306 uneven-batches: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD306"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="uneven-batches",
    severity=Severity.MEDIUM,
    summary="ranks run different numbers of batches or batch sizes (hang risk, biased BN)",
    what=prose(
        """
        The probe records the number of training batches and the batch size of every step on each rank, and
        fires when ranks run different numbers of batches in an epoch or different batch sizes at the same
        step.
        """
    ),
    why=prose(
        """
        DDP's backward is a collective. A rank that runs out of batches early leaves the others blocked in
        the all-reduce of their extra step until the timeout (unless the loop runs under `ddp.join()`).
        Unequal batch sizes at one step do not hang but bias the update: DDP averages gradients with equal
        weight per rank, so the samples in a smaller batch count more than those in a larger one, and per-GPU
        BatchNorm normalises a short last batch (a handful of samples) with very noisy statistics that also
        go into the running averages.
        """
    ),
    example=snippet(
        """
        # Bad: manual shards of unequal length and a short last batch
        shard = Subset(train_set, range(rank, len(train_set), world_size))
        loader = DataLoader(shard, batch_size=32)

        # Good: equal-length shards and full batches only
        sampler = DistributedSampler(train_set, shuffle=True)
        loader = DataLoader(train_set, batch_size=32, sampler=sampler, drop_last=True)
        """
    ),
    fix=(
        "Give every rank the same number of full batches: DistributedSampler plus DataLoader(drop_last=True); "
        "run genuinely uneven loops under ddp.join()."
    ),
)
