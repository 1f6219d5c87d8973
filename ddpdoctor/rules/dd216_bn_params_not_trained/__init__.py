"""DD216 bn-params-not-trained: the rule's catalog entry and its documentation.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half; `ddpdoctor triage` (ddpdoctor/triage/) also decides it across arms.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD216"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="bn-params-not-trained",
    severity=Severity.CRITICAL,
    summary=(
        "after conversion the BN weight/bias the model uses are not the ones the optimizer updates (a cloning "
        "converter applied after the optimizer was built)"
    ),
    what=prose(
        """
        Static analysis looks for an optimizer built over the model's parameters before a converter that
        makes new parameters (apex's `convert_syncbn_model`, or a function of the project that builds
        SyncBatchNorm layers and gives them new weight/bias tensors) is applied to that model.

        The probe checks, at the first optimizer step after a conversion, whether an optimizer holds the
        converted layers' weight and bias (and whether it holds the originals' instead), and at the first
        step of every DDP model whether its SyncBN parameters are in an optimizer at all.
        """
    ),
    why=prose(
        """
        An optimizer holds references to Parameter objects. torch's `convert_sync_batchnorm` reuses the
        original weight and bias, so an optimizer built before it still updates them (FACTS: 2.13). Converters
        that clone — apex's `convert_syncbn_model`, many hand-written ones — register new Parameters: an
        optimizer built before the conversion keeps updating the old, now unused tensors while the model's
        BN affine parameters never change (CenterPoint#146, horovod#2183). Training still converges somewhat,
        so nothing crashes; accuracy is simply lower.
        """
    ),
    example=snippet(
        """
        # Bad: the optimizer holds the pre-conversion parameters
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model = apex.parallel.convert_syncbn_model(model)

        # Good: convert first, then build the optimizer
        model = apex.parallel.convert_syncbn_model(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """
    ),
    fix="Convert the model to SyncBN before building the optimizer (and the DDP wrapper).",
)
