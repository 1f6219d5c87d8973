"""DD101 sync-bn-after-ddp: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD101"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="sync-bn-after-ddp",
    severity=Severity.MEDIUM,
    summary=(
        "convert_sync_batchnorm applied to a model after it was wrapped in DDP; the probe reports whether "
        "the layers really sync on this torch"
    ),
    what=prose(
        """
        Static analysis looks for `nn.SyncBatchNorm.convert_sync_batchnorm(m)` (or apex's
        `convert_syncbn_model(m)`) where `m` is a module that was already passed to
        `DistributedDataParallel(...)` earlier in the same function, the DDP wrapper itself, or its `.module`.

        The probe measures what the late conversion did on the installed torch: whether the BatchNorm layers
        inside the DDP-wrapped module are SyncBatchNorm when the training forward runs, whether their batch
        statistics agree across ranks, whether DDP's `mixed_precision` is in use, and whether the optimizer
        holds the same parameter objects as the model. The finding's severity follows what was measured: low
        when the layers sync and nothing else was lost, higher when they do not.
        """
    ),
    why=prose(
        """
        The folklore says that converting after wrapping means BatchNorm never syncs. On torch >= 1.8 that is
        not what happens: `convert_sync_batchnorm` builds new SyncBatchNorm modules that reuse the same
        weight/bias Parameter objects and running-statistics tensors under the same child names, so DDP's
        gradient hooks (registered on those parameters) still reduce their gradients and the new layers do
        all-reduce their batch statistics. Training is correct.

        What the late conversion skips is what DDP's constructor does for SyncBatchNorm layers it can see: the
        refusal of SyncBN on CPU modules (so a CPU/gloo misconfiguration surfaces later, inside the forward),
        the `has_sync_bn` flag in DDP's logging data, and, with DDP's experimental `mixed_precision`
        option, the per-module forward pre-hooks that wait for the low-precision parameter copies and attach
        the gradient-reduction hooks to them: the replacement layers have neither.

        It did break training with older stacks. On torch <= 1.7, SyncBatchNorm.forward raised
        "SyncBatchNorm is only supported within torch.nn.parallel.DistributedDataParallel" unless DDP's
        constructor had registered the layer. apex's `convert_syncbn_model` clones weight and bias into new
        Parameters: an optimizer built before the conversion keeps updating the old tensors, so the BN affine
        weights the model uses never change, and DDP's hooks sit on the old parameters, so the new ones are
        never all-reduced and drift apart across ranks.
        """
    ),
    example=snippet(
        """
        # Bad: converted after wrapping
        model = Net().cuda(local_rank)
        ddp = DDP(model, device_ids=[local_rank])
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)

        # Good: convert, then wrap, then build the optimizer
        model = nn.SyncBatchNorm.convert_sync_batchnorm(Net()).cuda(local_rank)
        ddp = DDP(model, device_ids=[local_rank])
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        """
    ),
    fix=(
        "Convert with nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping the model in "
        "DistributedDataParallel, and build the optimizer after both."
    ),
    fix_variants={
        "probe": (
            "Convert first, then wrap: model = nn.SyncBatchNorm.convert_sync_batchnorm(model); "
            "model = DDP(model, ...)."
        ),
    },
)
