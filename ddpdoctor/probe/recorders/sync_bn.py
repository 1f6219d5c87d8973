"""SyncBatchNorm recorder: convert_sync_batchnorm calls (where, on what, whether a DDP already owned the model)
and SyncBatchNorm layers registered under a module already wrapped by DDP (convert after wrap)."""

from __future__ import annotations

import functools
from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "sync_bn"
_REGISTERED: dict[int, int] = {}

# SyncBatchNorm classes that are not torch.nn.SyncBatchNorm subclasses: Horovod's and apex's (the real packages
# and ddpdoctor's stand-ins load under these names)
OTHER_SYNC_BN = {
    "horovod.torch.sync_batch_norm.SyncBatchNorm",
    "apex.parallel.sync_batchnorm.SyncBatchNorm",
    "apex.parallel.optimized_sync_batchnorm.SyncBatchNorm",
}


def is_sync_batchnorm(module: Any) -> bool:
    """A BatchNorm layer that synchronises its statistics across ranks: torch's SyncBatchNorm, Horovod's, apex's."""
    return _is_sync_type(type(module))


@functools.lru_cache(maxsize=256)
def _is_sync_type(cls: type) -> bool:
    from torch.nn import SyncBatchNorm

    if issubclass(cls, SyncBatchNorm):
        return True
    return any(f"{c.__module__}.{c.__qualname__}" in OTHER_SYNC_BN for c in cls.__mro__)


def install(probe: Probe) -> None:
    from torch.nn import SyncBatchNorm
    from torch.nn.modules import module as module_mod
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.parallel import DistributedDataParallel as DDP

    state = {"depth": 0}

    def make_convert(orig):
        # `orig` is the underlying function of the classmethod: orig(cls, module, process_group=None)
        def convert_sync_batchnorm(cls: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
            if state["depth"]:  # recursive call on a child
                return orig(cls, module, *args, **kwargs)
            site = probe.site()
            before = probe.safely("sync_bn before", _describe, probe, module, DDP, _BatchNorm, SyncBatchNorm)
            state["depth"] += 1
            try:
                result = orig(cls, module, *args, **kwargs)
            finally:
                state["depth"] -= 1
            if before is not None:
                probe.safely("sync_bn after", _converted, probe, site, before, result, SyncBatchNorm)
            return result

        return convert_sync_batchnorm

    probe.patcher.wrap(SyncBatchNorm, "convert_sync_batchnorm", make_convert)

    def registration_hook(parent: Any, name: str, submodule: Any) -> None:
        if submodule is None or not probe.registry.owned_modules:
            return None
        owner = probe.registry.owner_of(parent)
        if owner is None:
            return None
        probe.safely("module registration", _registered, probe, owner, parent, name, submodule, SyncBatchNorm)
        return None

    handle = module_mod.register_module_module_registration_hook(registration_hook)
    probe.patcher.add_undo(handle.remove)
    probe.step_hooks.append(lambda optimizer: _model_check(probe, SyncBatchNorm))


def _fraction(part: set[int], whole: set[int]) -> float | None:
    return round(len(part & whole) / len(part), 6) if part else None


def _model_check(probe: Probe, SyncBatchNorm: type) -> None:
    """At the first optimizer step after a DDP exists: is what DDP reduces, what the optimizer updates and what
    the forward runs still the same set of layers and parameters? (Convert-after-wrap is harmless exactly when
    it is.)"""
    from ddpdoctor.probe.recorders.ddp import norm_layer_kinds

    for rec in probe.registry.live_ddps():
        if rec.checked:
            continue
        rec.checked = True
        module = rec.module
        params = {id(p) for p in module.parameters()}
        syncbn = [m for m in module.modules() if is_sync_batchnorm(m)]
        sb_params = {id(p) for m in syncbn for p in m.parameters(recurse=False)}
        in_optimizers: set[int] = set()
        for ref, _pid in list(probe.registry.optimizers.values()):
            opt = ref()
            if opt is not None:
                in_optimizers |= {id(p) for g in opt.param_groups for p in g.get("params", ())}
        probe.emit(
            "model_check",
            ddp=rec.pid,
            step=probe.steps,
            norm_layers=norm_layer_kinds(module),
            syncbn_layers=len(syncbn),
            ddp_param_coverage=_fraction(params, rec.registered_params),
            optimizer_param_coverage=_fraction(params, in_optimizers),
            syncbn_params_in_optimizer=_fraction(sb_params, in_optimizers),
            syncbn_params_in_ddp=_fraction(sb_params, rec.registered_params),
            mixed_precision=rec.mixed_precision,
        )


def _describe(probe: Probe, module: Any, DDP: type, BatchNorm: type, SyncBatchNorm: type) -> dict[str, Any]:
    target = module.module if isinstance(module, DDP) else module
    owner = None
    if isinstance(module, DDP):
        owner = probe.registry.id_of(module)
    else:
        found = probe.registry.owner_of(target)
        if found is not None:
            owner = found[0]
        else:
            owner = probe.registry.ddp_owning_params(list(target.parameters()) if hasattr(target, "parameters") else [])
    plain = sum(1 for m in module.modules() if isinstance(m, BatchNorm) and not isinstance(m, SyncBatchNorm))
    return {"arg_class": type(module).__name__, "arg_is_ddp": isinstance(module, DDP), "owned_by_ddp": owner,
            "bn_layers": plain}


def _converted(probe: Probe, site: Any, before: dict[str, Any], result: Any, SyncBatchNorm: type) -> None:
    syncbn = sum(1 for m in result.modules() if isinstance(m, SyncBatchNorm)) if hasattr(result, "modules") else 0
    probe.emit(
        "sync_bn_convert",
        site=site,
        arg_class=before["arg_class"],
        arg_is_ddp=before["arg_is_ddp"],
        owned_by_ddp=before["owned_by_ddp"],
        converted=before["bn_layers"],
        syncbn_layers=syncbn,
    )


def _registered(
    probe: Probe, owner: tuple[int, str], parent: Any, name: str, submodule: Any, SyncBatchNorm: type
) -> None:
    ddp_pid, parent_path = owner
    path = f"{parent_path}.{name}" if parent_path else name
    probe.registry.own(submodule, ddp_pid, path)
    if is_sync_batchnorm(submodule):
        _REGISTERED[ddp_pid] = _REGISTERED.get(ddp_pid, 0) + 1
        if _REGISTERED[ddp_pid] > 3:  # one per layer would be noise: the first ones say it
            return
        probe.emit(
            "syncbn_registered_in_ddp",
            ddp=ddp_pid,
            name=path,
            parent_class=type(parent).__name__,
            site=probe.site(),
        )


def _optimizer_params(probe: Probe) -> set[int]:
    held: set[int] = set()
    for ref, _pid in list(probe.registry.optimizers.values()):
        opt = ref()
        if opt is not None:
            held |= {id(p) for g in opt.param_groups for p in g.get("params", ())}
    return held


def record_conversion(probe: Probe, before: Any, result: Any, pairs: list[tuple[Any, Any]], site: Any,
                      converter: str) -> None:
    """A converter other than torch's (apex's convert_syncbn_model) replaced `pairs` (old, new) BatchNorm layers:
    the same `sync_bn_convert` event as torch's converter (what DD101 reads), plus whether it cloned weight and
    bias and whether an optimizer built before it holds the replaced ones. (The bn_conversion recorder follows
    every converted layer to the first optimizer step.)"""
    is_wrapper = any(rec.ddp is before for rec in probe.registry.live_ddps())
    target = getattr(before, "module", before) if is_wrapper else before
    owner = probe.registry.owner_of(target)
    owned_by = owner[0] if owner is not None else probe.registry.ddp_owning_params(
        list(target.parameters()) if hasattr(target, "parameters") else [])
    cloned = sum(1 for old, new in pairs if getattr(old, "weight", None) is not None and new.weight is not old.weight)
    old_params = {id(p) for old, _ in pairs for p in old.parameters(recurse=False)}
    syncbn = sum(1 for m in result.modules() if is_sync_batchnorm(m)) if hasattr(result, "modules") else 0
    probe.emit(
        "sync_bn_convert",
        site=site,
        converter=converter,
        arg_class=type(before).__name__,
        arg_is_ddp=is_wrapper,
        owned_by_ddp=owned_by,
        converted=len(pairs),
        syncbn_layers=syncbn,
        cloned_params=cloned,
        replaced_params_in_optimizer=_fraction(old_params, _optimizer_params(probe)),
        optimizers=len(probe.registry.optimizers),
    )
