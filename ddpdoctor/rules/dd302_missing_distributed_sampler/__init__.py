"""DD302 missing-distributed-sampler: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import DDP_SET_UP, Rule, Setting, prose, snippet

CODE = "DD302"

# The probe half's thresholds.
THRESHOLD = 0.25  # fraction of a rank's samples also seen by another rank that is a finding
HIGH_OVERLAP = 0.5  # from this shared fraction (or identical batches) the finding is high; below it, medium

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("shared_samples", THRESHOLD, "fraction of a rank's samples",
                "also seen by another rank: a finding"),
        Setting("shared_samples_high", HIGH_OVERLAP, "fraction of a rank's samples",
                "from this shared fraction (or identical batches) the finding is high; below it, medium"),
    ),
    name="missing-distributed-sampler",
    severity=Severity.HIGH,
    summary="ranks iterate overlapping samples (no DistributedSampler or equivalent sharding)",
    what=prose(
        """
        Static analysis looks for a training DataLoader in a distributed script built without a
        DistributedSampler (or another sampler given the rank and world size) and without manual sharding of
        the dataset by rank.

        The probe records the dataset indices each rank loads per epoch — from what decides them: the sampler,
        or the `batch_sampler=` the loader was given — and fires when ranks overlap, with the overlap fraction
        (1.0: every rank reads the whole dataset) in evidence; high from half the samples shared or identical
        batches, medium below that. Repeated augmentation is recognised by
        measurement, not by name: the ranks' samplers share one pass over the dataset, each drawn sample recurs
        on several ranks, and the dataset augments it with a random stream that differs from rank to rank (each
        copy a different view): no finding. Batches not drawn through a loader (indices drawn in the loop
        from a generator seeded alike on every rank) are found from the digests of the model's first training
        inputs (a DDP or an FSDP2 `fully_shard` model): equal on every rank at each forward while they change
        from forward to forward (a fixed synthetic batch is a benchmark: no finding); where no DataLoader or
        Dataset was read and no sample recurs across the forwards (each batch generated fresh, as a benchmark
        draws it) the finding is low and says the data is synthetic.
        """
    ),
    why=prose(
        """
        Without sharding every rank iterates the whole dataset. If the ranks draw the same order (same seed),
        they compute the same gradient: the all-reduce averages N copies of one batch, the effective batch is
        the per-rank batch, and a learning rate scaled for N times that batch is N times too large. If the
        orders differ, each epoch processes every sample N times, so the epoch count, warmup and decay
        milestones of the recipe all stretch N-fold in samples seen, and an epoch takes as long as on one
        GPU. Either way the run is not the recipe it was ported from.
        """
    ),
    example=snippet(
        """
        # Bad: every rank iterates the whole dataset
        loader = DataLoader(train_set, batch_size=32, shuffle=True)

        # Good: each rank reads its own 1/N of every epoch
        sampler = DistributedSampler(train_set, shuffle=True)
        loader = DataLoader(train_set, batch_size=32, sampler=sampler)
        """
    ),
    example_context=DDP_SET_UP + snippet(
        """
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        ...
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        """
    ),
    fix=(
        "Shard the data: DataLoader(dataset, sampler=DistributedSampler(dataset), ...) instead of "
        "shuffle=True, and call sampler.set_epoch(epoch) every epoch."
    ),
    fix_variants={
        "probe": (
            "Give the training DataLoader sampler=DistributedSampler(dataset) (shuffle in the sampler, not the "
            "loader) and call sampler.set_epoch(epoch) every epoch."
        ),
        "seed": (
            "Give every rank's DistributedSampler the same seed (broadcast one drawn per process from rank 0) and "
            "pass the same epoch to sampler.set_epoch(epoch) on every rank."
        ),
        "split": (
            "Split with a seeded generator (random_split(..., generator=torch.Generator().manual_seed(s)), the "
            "same s on every rank) so every rank holds the same split and the DistributedSampler partitions it."
        ),
    },
    fix_names={"dataset": "dataset_name"},
    cost_note=prose(
        """
        high although on digits it cost nothing: with per-rank seeds each rank shuffles the whole data set, so
        an epoch is N passes and the run takes N times the steps of its recipe (the benchmark's defect arm scored
        0.8 points higher, p = 0.07, for twice the compute). The cost is the recipe lost: its schedule stretched
        N-fold in samples, the time, and, where the ranks share a seed, N copies of one batch per step.
        """
    ),
)
