"""DD209 bn-type-check-misses-syncbn: the rule's catalog entry and its documentation.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half; `ddpdoctor triage` (ddpdoctor/triage/) also decides it across arms.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD209"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="bn-type-check-misses-syncbn",
    severity=Severity.HIGH,
    summary=(
        "code that finds norm layers by exact class stops matching after conversion: weight-decay "
        "exclusions, momentum schedules, freezing, precise-BN helpers silently change"
    ),
    what=prose(
        """
        Static analysis looks, in a script that converts to SyncBatchNorm, for code that picks BatchNorm
        layers by a class that SyncBatchNorm is not: `type(m) is nn.BatchNorm2d`, `type(m) ==
        nn.BatchNorm2d`, `isinstance(m, nn.BatchNorm2d)` (1d/3d alike), `m.__class__.__name__ ==
        "BatchNorm2d"`.

        The probe compares every BatchNorm layer between two arms, at the same optimizer step (the arms of
        `ddpdoctor triage`; `check` runs two short ones itself whenever its run used SyncBatchNorm): with the
        conversion (A) and without it (P), the layer's momentum, eps, training mode,
        requires_grad, the lr and weight decay of the optimizer group holding its parameters, and how many
        train-mode forwards without gradients (precise-BN recalibration) it ran. A difference the conversion
        itself did not make is code that stopped recognising the layer, reported at its class test: the
        `if` around the line that set the attribute, or the exact-class test in the user code that built the
        optimizer's groups or changed the layers only without the conversion. A static suspicion the arms
        found harmless is cleared. Within one run, a converter that did not carry momentum or eps over to the
        new layer is reported too.
        """
    ),
    why=prose(
        """
        `isinstance(nn.SyncBatchNorm(8), nn.BatchNorm2d)` is False: SyncBatchNorm derives from `_BatchNorm`,
        not from the BatchNorm*d classes. Code written for the plain model silently stops matching the
        converted layers: weight-decay exclusions for norm parameters (BN weights decay again), BN-momentum
        schedules, freezing of early stages, precise-BN or EMA recalibration helpers and custom
        initialisation all skip them. Likewise a hand-written converter that builds the new layer with
        default arguments loses a tuned momentum or eps. Each of these changes training as much as a
        hyper-parameter change would, and only the SyncBN run has it.
        """
    ),
    example=snippet(
        """
        # Bad: SyncBatchNorm is not an nn.BatchNorm2d, so BN weights get weight decay after conversion
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        no_decay = [p for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()]

        # Good: match every BatchNorm, SyncBatchNorm included
        from torch.nn.modules.batchnorm import _BatchNorm
        no_decay = [p for m in model.modules() if isinstance(m, _BatchNorm) for p in m.parameters()]
        """
    ),
    fix=(
        "Select norm layers with isinstance(m, torch.nn.modules.batchnorm._BatchNorm) (or _NormBase), and "
        "carry momentum and eps over in custom converters."
    ),
)
