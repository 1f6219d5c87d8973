"""DD212 syncbn-scope: the rule's catalog entry and its documentation.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half; `ddpdoctor triage` (ddpdoctor/triage/) also decides it across arms.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD212"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="syncbn-scope",
    severity=Severity.HIGH,
    summary=(
        "SyncBN layers sync over a different set of ranks than intended (a singleton or wrong "
        "process_group): statistics are local"
    ),
    what=prose(
        """
        The probe records each SyncBN layer's process group on every rank (its global ranks) and, from the
        layer's input and output, which ranks' statistics it applied. It fires when a layer on a run with
        several ranks syncs over a group of one rank, over a group that does not contain the rank itself, or
        over groups the ranks disagree about.
        """
    ),
    why=prose(
        """
        `convert_sync_batchnorm(model, process_group=...)` scopes synchronisation to that group. Building
        one group per rank (`new_group([rank])`), passing another rank's group, or building groups with
        different rank lists on different ranks leaves every layer normalising over its own batch: the run
        pays for SyncBN and gets per-GPU statistics, or synchronises over a partition nobody intended.
        """
    ),
    example=snippet(
        """
        # Bad: every rank syncs with itself only
        groups = [dist.new_group([r]) for r in range(world)]
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=groups[rank])

        # Good: one group over the ranks meant to share statistics (here: all of them)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        """
    ),
    fix=(
        "Pass the process group of the ranks meant to share statistics (None for all); every rank must "
        "build the same groups in the same order."
    ),
)
