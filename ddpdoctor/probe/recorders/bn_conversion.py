"""BN-conversion recorder: every plain BatchNorm layer the script (or a library converter) replaced by a SyncBN-like
layer, what changed about it, and whether it still computes the same function (DD208, DD209, DD210, DD216).

Generic over converters: torch's `convert_sync_batchnorm`, timm's, mmengine/mmcv's, apex-style and the script's own
all end by registering the new layer on the parent (`setattr` / `add_module`), which fires torch's global
module-registration hook while the parent still holds the original. At that moment the recorder keeps a copy of
the original layer and notes its attributes (class, own forward, training, momentum, eps, affine,
track_running_stats, requires_grad of weight and bias) and those of the replacement, and whether the replacement
reuses the original's Parameter objects (a cloning converter does not).

At the replacement's first forward, `ddpdoctor.probe.equivalence.compare_functions` runs the original and the
replacement on that input, on copies, at identical weights and statistics, in train and eval mode (DD208). At the
first optimizer step after the conversion, one `bn_conversion` event per layer: all of the above, the
replacement's attributes at that step, and which optimizer holds the original's and the replacement's parameters
(DD216: a cloning converter applied after the optimizer was built).

Cost: one copy of each converted layer (a BatchNorm is small), one extra pair of forwards per layer, once.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "bn_conversion"
MAX_CONVERSIONS = 1024


def standard_forwards() -> set[Any]:
    """The forwards that are plain batch norm: _BatchNorm's and SyncBatchNorm's (whatever patches it now)."""
    from torch.nn import SyncBatchNorm
    from torch.nn.modules.batchnorm import _BatchNorm

    return {_BatchNorm.forward, SyncBatchNorm.forward, getattr(SyncBatchNorm.forward, "__wrapped__", None)}


def own_forward(module: Any) -> str | None:
    """The class that defines the layer's forward when it is not plain batch norm (a fused subclass), else None."""
    forward = type(module).forward
    if forward in standard_forwards():
        return None
    for cls in type(module).__mro__:
        if "forward" in cls.__dict__:
            return f"{cls.__module__}.{cls.__qualname__}"
    return None


def layer_attributes(module: Any) -> dict[str, Any]:
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    momentum = getattr(module, "momentum", None)
    return {
        "cls": type(module).__name__,
        "module": type(module).__module__,
        "own_forward": own_forward(module),
        "training": bool(module.training),
        "momentum": None if momentum is None else float(momentum),
        "eps": float(getattr(module, "eps", 0.0)),
        "affine": bool(getattr(module, "affine", False)),
        "track_running_stats": bool(getattr(module, "track_running_stats", False)),
        "weight_requires_grad": None if weight is None else bool(weight.requires_grad),
        "bias_requires_grad": None if bias is None else bool(bias.requires_grad),
    }


def optimizer_index(probe: Probe) -> dict[int, dict[str, Any]]:
    """id(parameter) → {opt, group, lr, weight_decay, momentum} over every live optimizer."""
    out: dict[int, dict[str, Any]] = {}
    for ref, pid in list(probe.registry.optimizers.values()):
        opt = ref()
        if opt is None:
            continue
        for gi, group in enumerate(getattr(opt, "param_groups", ())):
            hyper = {"opt": pid, "group": gi, "lr": _num(group.get("lr")),
                     "weight_decay": _num(group.get("weight_decay")), "momentum": _num(group.get("momentum"))}
            for p in group.get("params", ()):
                out.setdefault(id(p), hyper)
    return out


def _num(value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)[:40]


def layer_name(probe: Probe, module: Any, fallback: str) -> str:
    """The layer's path inside the (first) DDP-wrapped module, as the batchnorm recorder names it."""
    owner = probe.registry.owner_of(module)
    if owner is not None:
        pid, path = owner
        first = next((rec.pid for rec in probe.registry.ddps), pid)
        base = path or type(module).__name__
        return base if pid == first else f"ddp{pid}:{base}"
    for rec in probe.registry.live_ddps():
        for path, m in rec.module.named_modules():
            if m is module:
                return path or type(module).__name__
    return fallback


class _Conversion:
    def __init__(self, index: int, parent: Any, child: str, original: Any, new: Any, site: Any) -> None:
        self.index = index
        self.parent_ref = weakref.ref(parent)
        self.parent_cls = type(parent).__name__
        self.child = child
        self.new = new
        self.site = site
        self.before = layer_attributes(original)
        self.after = layer_attributes(new)
        self.same_params = {
            k: (getattr(original, k, None) is getattr(new, k, None)) if getattr(original, k, None) is not None else None
            for k in ("weight", "bias")
        }
        self.same_buffers = {
            k: (getattr(original, k, None) is getattr(new, k, None)) if getattr(original, k, None) is not None else None
            for k in ("running_mean", "running_var")
        }
        self.original_param_ids = {k: id(getattr(original, k)) for k in ("weight", "bias")
                                   if getattr(original, k, None) is not None}
        self.snapshot: Any = None
        self.equivalence: dict[str, Any] | None = None
        self.checked = False
        self.emitted = False


class _State:
    def __init__(self) -> None:
        self.by_new: dict[int, _Conversion] = {}
        self.order: list[_Conversion] = []
        self.unchecked: dict[int, _Conversion] = {}


def install(probe: Probe) -> None:
    from torch.nn.modules import module as module_mod
    from torch.nn.modules.batchnorm import _BatchNorm

    from ddpdoctor.probe.arms import sync_like

    state = _State()

    def registration_hook(parent: Any, name: str, submodule: Any) -> None:
        if submodule is None or not isinstance(submodule, _BatchNorm) or not sync_like(submodule):
            return
        current = parent.__dict__.get("_modules", {}).get(name)
        if current is None or current is submodule or not isinstance(current, _BatchNorm) or sync_like(current):
            return
        if len(state.order) < MAX_CONVERSIONS:
            probe.safely("bn conversion", _record, probe, state, parent, name, current, submodule)
        return

    def pre_hook(module: Any, args: Any) -> None:
        if not state.unchecked or probe.quiet or probe.ending:
            return
        conv = state.unchecked.get(id(module))
        if conv is None or conv.new is not module:
            return
        del state.unchecked[id(module)]
        probe.safely("bn conversion equivalence", _check, probe, conv, module, args)
        return

    h1 = module_mod.register_module_module_registration_hook(registration_hook)
    h2 = module_mod.register_module_forward_pre_hook(pre_hook)
    probe.patcher.add_undo(h1.remove)
    probe.patcher.add_undo(h2.remove)
    probe.step_hooks.append(lambda optimizer: _emit_pending(probe, state, at_step=True))
    probe.end_hooks.append(lambda: _emit_pending(probe, state, at_step=False))


def _record(probe: Probe, state: _State, parent: Any, name: str, original: Any, new: Any) -> None:
    from ddpdoctor.probe.arms import process_group_memo

    conv = _Conversion(len(state.order), parent, name, original, new, probe.site())
    try:
        conv.snapshot = copy.deepcopy(original, process_group_memo(original))
    except Exception as exc:
        conv.equivalence = {"status": "not_measurable", "reason": f"the original layer cannot be copied: {exc}"[:300]}
        conv.checked = True
    old = state.by_new.get(id(new))
    if old is not None and old in state.order:
        state.order.remove(old)
    state.by_new[id(new)] = conv
    state.order.append(conv)
    if not conv.checked:
        state.unchecked[id(new)] = conv


def _check(probe: Probe, conv: _Conversion, module: Any, args: Any) -> None:
    import torch

    from ddpdoctor.probe.arms import CollectiveInCheck
    from ddpdoctor.probe.equivalence import compare_functions

    conv.checked = True
    x = args[0] if args else None
    if not torch.is_tensor(x) or conv.snapshot is None:
        conv.equivalence = {"status": "not_measurable", "reason": "no tensor input at the first forward"}
        return
    probe.quiet += 1
    try:
        result = compare_functions(conv.snapshot, module, x)
    except CollectiveInCheck:
        conv.equivalence = {"status": "not_measurable",
                            "reason": "the converted layer's own forward communicates; it cannot run on one rank"}
        return
    except Exception as exc:
        conv.equivalence = {"status": "not_measurable", "reason": f"{type(exc).__name__}: {exc}"[:300]}
        return
    finally:
        probe.quiet -= 1
    conv.equivalence = {"status": "measured", "step": probe.steps, "input_shape": list(x.shape),
                        "dtype": str(x.dtype).replace("torch.", ""), **result}
    conv.snapshot = None


def _emit_pending(probe: Probe, state: _State, at_step: bool) -> None:
    pending = [c for c in state.order if not c.emitted]
    if not pending:
        return
    index = optimizer_index(probe)
    for conv in pending:
        new = conv.new
        conv.emitted = True
        opt_new = {k: index.get(id(getattr(new, k))) for k in ("weight", "bias") if getattr(new, k, None) is not None}
        opt_original = {k: index.get(pid) for k, pid in conv.original_param_ids.items()}
        parent = conv.parent_ref()
        fallback = f"{conv.parent_cls}.{conv.child}"
        name = layer_name(probe, new, fallback)
        in_model = parent is not None and parent.__dict__.get("_modules", {}).get(conv.child) is new
        probe.emit(
            "bn_conversion",
            n=conv.index,
            name=name,
            parent_class=conv.parent_cls,
            child=conv.child,
            site=conv.site,
            before=conv.before,
            after=conv.after,
            at_step=layer_attributes(new),
            step=probe.steps,
            at_first_step=at_step,
            in_model=in_model,
            same_params=conv.same_params,
            same_buffers=conv.same_buffers,
            optimizer_new=opt_new,
            optimizer_original=opt_original,
            optimizers=len(probe.registry.optimizers),
            equivalence=conv.equivalence,
        )
        conv.snapshot = None
