"""DD203 non-iid-shards: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, Setting, prose, snippet

CODE = "DD203"

# The probe half's thresholds.
SURE = 1e-9  # p-value below which the non-i.i.d. test is certain (else likely)
MATERIAL_EFFECT = 0.1  # ranks' channel means at least this many within-batch standard deviations apart

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("non_iid_certain_p", SURE, "p-value",
                "below this the non-i.i.d. test is certain (else likely)"),
        Setting("non_iid_effect", MATERIAL_EFFECT, "within-batch standard deviations",
                "ranks' channel means at least this far apart are a finding"),
    ),
    name="non-iid-shards",
    severity=Severity.HIGH,
    summary="per-rank BN input statistics differ beyond i.i.d. sampling noise (scipy test, p < 1e-3)",
    what=prose(
        """
        The probe records the per-channel batch mean of every BatchNorm layer's input on each rank at every
        observed step, and a scipy test asks whether the ranks' batch means differ by more than i.i.d.
        sampling from one distribution would explain. It fires at
        p < 1e-3, with the layers, channels, test statistic and p-value in evidence.
        """
    ),
    why=prose(
        """
        Per-GPU BatchNorm subtracts each rank's own batch mean and divides by its own batch spread. When the
        ranks see differently distributed data (contiguous slices of a dataset sorted by class or source, one
        file per rank, a different augmentation per rank) that normalisation removes exactly the
        shard-specific differences the network should learn from, and each replica's features are
        normalised differently while their gradients are averaged as if they were comparable. The running
        statistics, taken from rank 0's shard (DD201), then describe rank 0's data rather than the whole
        distribution, so evaluation normalises with the wrong statistics. Synchronised BatchNorm or a global
        shuffle removes the effect.
        """
    ),
    example=snippet(
        """
        # Bad: contiguous slices of a dataset sorted by class (or one file per rank)
        n = len(train_set) // world_size
        shard = Subset(train_set, range(rank * n, (rank + 1) * n))
        loader = DataLoader(shard, batch_size=32, shuffle=True)

        # Good: shuffle globally, then interleave
        sampler = DistributedSampler(train_set, shuffle=True)
        loader = DataLoader(train_set, batch_size=32, sampler=sampler)
        """
    ),
    fix=(
        "Shuffle globally before sharding (DistributedSampler(dataset, shuffle=True) over the whole dataset); "
        "if the shards must differ, use SyncBatchNorm."
    ),
    fix_variants={
        "compare_bn": (
            "shuffle globally before sharding (DistributedSampler(shuffle=True) and set_epoch every epoch), or use "
            "SyncBatchNorm so every rank normalises with global-batch statistics"
        ),
    },
)
