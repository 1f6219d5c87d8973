"""DD304 identical-rng-streams: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD304"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="identical-rng-streams",
    severity=Severity.LOW,
    summary="augmentation/dropout random streams identical on every rank",
    what=prose(
        """
        The probe compares, across ranks, the state of the random number generators that augmentation and
        dropout draw from (torch's default generator in the training process and the seeds of the DataLoader
        workers) at the same step, and fires when they are identical on every rank.
        """
    ),
    why=prose(
        """
        Scripts seed every process with the same `torch.manual_seed(seed)` for reproducibility. DataLoader
        workers derive their seeds (torch, `random` and numpy) from a base seed drawn from that generator, so
        worker k produces the same random stream on every rank (with `num_workers=0` the augmentations draw
        from the training process's generator, equally shared), and dropout in the training process draws
        the same masks on every rank at the same step. Different images then receive the same crop, flip
        and colour jitter at the same position of every rank's batch, which cuts the augmentation diversity
        within a global batch N-fold and correlates the noise the ranks were meant to average. The effect on
        accuracy is usually small, hence the low severity. Initial weights do not need the shared seed: DDP
        broadcasts rank 0's parameters when it is constructed. DistributedSampler's own `seed` must stay the
        same on every rank.
        """
    ),
    example=snippet(
        """
        # Bad: the same seed everywhere: the same crops, flips and dropout masks on every rank
        torch.manual_seed(0)

        # Good: per-rank streams; DDP broadcasts rank 0's initial weights anyway
        torch.manual_seed(0 + dist.get_rank())
        sampler = DistributedSampler(train_set, seed=0)  # the sampler seed stays shared
        """
    ),
    fix=(
        "Seed augmentation and dropout per rank (seed + rank); keep DistributedSampler's seed the same on "
        "every rank (DDP already broadcasts rank 0's initial weights)."
    ),
)
