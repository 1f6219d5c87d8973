"""DD211 syncbn-stats-wrong: the rule's catalog entry and its documentation.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half; `ddpdoctor triage` (ddpdoctor/triage/) also decides it across arms.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD211"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="syncbn-stats-wrong",
    severity=Severity.HIGH,
    summary=(
        "the statistics a SyncBN layer applied differ from the exact global-batch statistics (a custom or "
        "buggy implementation, e.g. equal-weight averaging of unequal batches)"
    ),
    what=prose(
        """
        The probe records, for the first optimizer steps, the per-channel mean, variance and covariance of
        every SyncBN-like layer's input and output on each rank, and its weight and bias. Training-mode batch
        norm is an affine map per channel, so the mean and variance the layer applied follow from them; the
        analysis compares them with the exact statistics of the layer's process group (Chan's combination of
        the ranks' counts, means and variances) and of the rank's own batch, with a tolerance derived from
        the output's floating-point rounding. Channels whose output carries no information about the
        statistics (weight near zero) and layers whose output is not affine (a fused activation) are not
        measured, and the finding says how many were.
        """
    ),
    why=prose(
        """
        SyncBN exists to normalise with the statistics of the union of the ranks' batches. Implementations
        that average per-rank means and variances with equal weights are exact only when every rank has the
        same batch size and the same mean; with unequal batches (the last batch of an epoch, uneven shards)
        or non-i.i.d. ranks the applied statistics are biased, and naive sum-of-squares variants lose
        precision when activations sit far from zero. Old and third-party implementations
        (pytorch#22192-era bugs, hand-rolled NaiveSyncBN ports) shift every layer's normalisation in a way
        plain DDP never does.
        """
    ),
    example=snippet(
        """
        # Bad: equal-weight average of per-rank statistics
        mean = x.mean((0, 2, 3)); dist.all_reduce(mean); mean /= world

        # Good: torch's SyncBatchNorm combines counts, means and variances exactly
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        """
    ),
    fix=(
        "Use torch.nn.SyncBatchNorm, or weight each rank's mean and variance by its count and add the "
        "between-rank term (Chan's formula)."
    ),
)
