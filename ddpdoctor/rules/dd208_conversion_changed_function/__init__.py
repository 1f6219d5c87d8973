"""DD208 conversion-changed-function: the rule's catalog entry and its documentation.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half; `ddpdoctor triage` (ddpdoctor/triage/) also decides it across arms.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD208"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="conversion-changed-function",
    severity=Severity.CRITICAL,
    summary=(
        "converting BN to SyncBN changed what a layer computes (a BatchNorm subclass with its own forward, "
        "e.g. a fused activation, replaced by plain SyncBatchNorm)"
    ),
    what=prose(
        """
        The probe notices every plain BatchNorm layer that a converter (torch's `convert_sync_batchnorm`,
        timm's, mmengine's, apex-style or the script's own) replaces by a SyncBN-like layer, keeps a copy of
        the original, and at the replacement's first forward runs both on that same input, at identical
        weights and running statistics, in train and in eval mode, with the replacement normalising over the
        rank's own batch (what `ddpdoctor triage` calls arm L against arm P). eps and momentum are equalised
        first, so only the forward code is compared. A relative difference above float rounding is a changed
        function; the finding names the layer, both classes and the difference in each mode.
        """
    ),
    why=prose(
        """
        `nn.SyncBatchNorm.convert_sync_batchnorm` replaces every `_BatchNorm` instance by a plain
        `SyncBatchNorm` built from its attributes. A subclass that does more than batch norm in its forward —
        timm's `BatchNormAct2d` applies the activation (and drop) inside the norm layer, fused or multi-step
        BN variants, BN with a custom eval path — loses that behaviour: its activation child is still
        registered, but SyncBatchNorm's forward never calls it (pytorch/pytorch#187298, timm#1254). The model
        then trains a different network (no ReLU after the norm, for instance) and scores lower for a reason
        that has nothing to do with statistics.
        """
    ),
    example=snippet(
        """
        # Bad: torch's converter turns BatchNormAct2d into a SyncBatchNorm without the activation
        model = timm.create_model("resnet50")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)

        # Good: the library's converter keeps the fused layer (SyncBatchNormAct)
        from timm.layers import convert_sync_batchnorm
        model = convert_sync_batchnorm(timm.create_model("resnet50"))
        """
    ),
    fix=(
        "Convert with a converter that knows the subclass (timm.layers.convert_sync_batchnorm for timm "
        "models), or give the subclass a SyncBN counterpart that keeps its forward."
    ),
)
