"""DD210 frozen-bn-unfrozen: the rule's catalog entry and its documentation.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half; `ddpdoctor triage` (ddpdoctor/triage/) also decides it across arms.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD210"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="frozen-bn-unfrozen",
    severity=Severity.HIGH,
    summary="BN layers frozen before conversion (eval mode and/or requires_grad False) train again after it",
    what=prose(
        """
        The probe records, for every BatchNorm layer a converter replaces, the original's training mode and
        the requires_grad of its weight and bias, and the same of the replacement when it is registered and at
        the first optimizer step. In `ddpdoctor triage` it also compares the layer between the arm with the
        conversion (A) and the arm without it (P) at the same step. A layer frozen without the conversion and
        training with it is the finding.
        """
    ),
    why=prose(
        """
        Detection and segmentation recipes freeze BatchNorm in pretrained backbones (eval mode, parameters
        without gradients), because their per-GPU batches are too small to re-estimate the statistics. A
        converter that builds fresh SyncBatchNorm layers without copying `training` and `requires_grad` —
        torch's own before 2.2, mmengine's (mmengine#1624), many hand-written ones — unfreezes them: the
        pretrained statistics get overwritten and the affine parameters start moving, which is exactly what
        freezing was there to prevent.
        """
    ),
    example=snippet(
        """
        # Bad: a converter that drops requires_grad and eval mode
        def to_syncbn(m):
            new = nn.SyncBatchNorm(m.num_features, m.eps, m.momentum)
            new.weight.data.copy_(m.weight.data)
            new.bias.data.copy_(m.bias.data)
            return new

        # Good: keep the frozen state
        new.weight.requires_grad_(m.weight.requires_grad)
        new.bias.requires_grad_(m.bias.requires_grad)
        new.train(m.training)
        """
    ),
    fix=(
        "Copy training and requires_grad in the converter (torch >= 2.2 does), or freeze after converting."
    ),
)
