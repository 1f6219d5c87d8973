"""Optimizer recorder: construction (class, lr and size of each param group, where) and every step (lr per group,
what happened since the previous step). Steps drive the probe: step hooks (parameter digests) and the step limit.
"""

from __future__ import annotations

import math
from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "optimizer"
_HYPER = ("lr", "momentum", "weight_decay", "betas", "eps", "nesterov", "dampening", "alpha", "initial_lr")


def _scalar(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        out = [_scalar(v) for v in value]
        return out if all(not isinstance(v, str) or v in ("nan", "inf", "-inf") for v in out) else None
    try:  # tensor lr
        return float(value)
    except Exception:
        return None


def group_summary(group: dict[str, Any]) -> dict[str, Any]:
    params = list(group.get("params", ()))
    out: dict[str, Any] = {"params": len(params), "numel": int(sum(p.numel() for p in params))}
    for key in _HYPER:
        if key in group:
            out[key] = _scalar(group[key])
    return out


def install(probe: Probe) -> None:
    from torch.optim.optimizer import (
        Optimizer,
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    state = {"depth": 0, "opt_steps": {}}

    def make_init(orig):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            probe.safely("optimizer_init", _constructed, probe, self)

        return __init__

    probe.patcher.wrap(Optimizer, "__init__", make_init)

    def pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        state["depth"] += 1
        return None

    def post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        state["depth"] = max(0, state["depth"] - 1)
        if state["depth"]:  # an optimizer stepping an inner one (ZeroRedundancyOptimizer): count the outer step
            return None
        if probe.quiet_steps:  # a library's own step (Horovod initialising optimizer state), not training
            return None
        probe.steps += 1
        probe.safely("optimizer_step", _stepped, probe, state, optimizer)
        probe.after_step(optimizer)
        return None

    h1 = register_optimizer_step_pre_hook(pre_hook)
    h2 = register_optimizer_step_post_hook(post_hook)
    probe.patcher.add_undo(h1.remove)
    probe.patcher.add_undo(h2.remove)


def _constructed(probe: Probe, optimizer: Any) -> None:
    params = [p for g in optimizer.param_groups for p in g.get("params", ())]
    ids = {id(p) for p in params}
    in_ddp = None
    ddps = list(probe.registry.live_ddps())
    if ddps and ids:
        owned = set()
        for rec in ddps:
            owned |= {id(p) for p in rec.module.parameters()}
        in_ddp = round(len(ids & owned) / len(ids), 6)
    opt_id = probe.registry.id_of(optimizer)
    probe.registry.optimizers[id(optimizer)] = (probe.registry._ids[id(optimizer)][0], opt_id)
    probe.emit(
        "optimizer_init",
        opt=opt_id,
        cls=type(optimizer).__name__,
        module=type(optimizer).__module__,
        site=probe.site(),
        groups=[group_summary(g) for g in optimizer.param_groups],
        params_in_ddp=in_ddp,
    )


def _stepped(probe: Probe, state: dict[str, Any], optimizer: Any) -> None:
    opt_id = probe.registry.id_of(optimizer)
    n = state["opt_steps"].get(opt_id, 0) + 1
    state["opt_steps"][opt_id] = n
    counters = dict(probe.counters)
    for k in probe.counters:
        probe.counters[k] = 0
    probe.emit(
        "optimizer_step",
        opt=opt_id,
        step=probe.steps,
        opt_step=n,
        lrs=[_scalar(g.get("lr")) for g in optimizer.param_groups],
        epoch=probe.epoch,
        **counters,
    )
