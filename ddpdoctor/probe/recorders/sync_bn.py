"""SyncBatchNorm recorder: convert_sync_batchnorm calls (where, on what, whether a DDP already owned the model)
and SyncBatchNorm layers registered under a module already wrapped by DDP (convert after wrap)."""

from __future__ import annotations

from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "sync_bn"
_REGISTERED: dict[int, int] = {}


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
        syncbn = [m for m in module.modules() if isinstance(m, SyncBatchNorm)]
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


def _registered(probe: Probe, owner: tuple[int, str], parent: Any, name: str, submodule: Any, SyncBatchNorm: type) -> None:
    ddp_pid, parent_path = owner
    path = f"{parent_path}.{name}" if parent_path else name
    probe.registry.own(submodule, ddp_pid, path)
    if isinstance(submodule, SyncBatchNorm):
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
