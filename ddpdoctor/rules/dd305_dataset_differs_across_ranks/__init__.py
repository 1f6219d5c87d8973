"""DD305 dataset-differs-across-ranks: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD305"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="dataset-differs-across-ranks",
    severity=Severity.HIGH,
    summary=(
        "the same index yields different samples on different ranks (unseeded synthetic data, per-rank files)"
    ),
    what=prose(
        """
        The probe compares digests of the samples the dataset returns for the same index on different ranks
        and fires when an index yields different content, with the indices and per-rank digests in evidence.
        """
    ),
    why=prose(
        """
        DistributedSampler shards indices: it assumes that index i is the same sample on every rank. When each
        process builds its own version of the dataset (synthetic data from an unseeded or rank-seeded
        generator, a file list in directory order or shuffled per process, a `random_split` without a fixed
        generator) the union of the ranks' shards is not the dataset: some samples are trained on several
        times per epoch, others never. A per-process random train/validation split also leaks: one rank's
        validation images are another rank's training images, so validation scores are optimistic.
        """
    ),
    example=snippet(
        """
        # Bad: each process draws its own random split
        train_set, val_set = random_split(full_set, [0.9, 0.1])

        # Good: the same split on every rank
        g = torch.Generator().manual_seed(42)
        train_set, val_set = random_split(full_set, [0.9, 0.1], generator=g)
        """
    ),
    fix=(
        "Build the dataset identically on every rank: generators seeded independently of the rank, sorted "
        "file lists, and splits made with a fixed generator."
    ),
    fix_variants={
        "split": (
            "Split with a seeded generator (random_split(..., generator=torch.Generator().manual_seed(s)), the "
            "same s on every rank) so every rank holds the same split."
        ),
    },
)
