"""Forward recorder: training-mode forwards of modules owned by a DDP that run outside DDP's forward (the model
trained through the unwrapped module: gradients are never all-reduced, replicas drift).

Two global module hooks keep a depth counter, so only the outermost bypassing call counts (not every submodule
it runs). Evaluation forwards (no grad, or eval mode) through the unwrapped module are normal and not counted.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "forward"


def install(probe: Probe) -> None:
    import torch
    from torch.nn.modules import module as module_mod

    owned = probe.registry.owned_modules
    state = {"depth": 0}
    seen: set[tuple[int, str, str, int]] = set()

    def pre_hook(module: Any, args: Any) -> None:
        if probe.ddp_forward_depth or not owned:
            return None
        entry = owned.get(id(module))
        if entry is None or entry[0]() is not module:
            return None
        state["depth"] += 1
        if state["depth"] == 1 and module.training and torch.is_grad_enabled():
            probe.counters["bypass_forwards"] += 1
            probe.safely("forward bypass", _first_bypass, probe, seen, module, entry)
        return None

    def post_hook(module: Any, args: Any, output: Any) -> None:
        if probe.ddp_forward_depth or not owned or state["depth"] == 0:
            return None
        entry = owned.get(id(module))
        if entry is not None and entry[0]() is module:
            state["depth"] -= 1
        return None

    h1 = module_mod.register_module_forward_pre_hook(pre_hook)
    try:
        h2 = module_mod.register_module_forward_hook(post_hook, always_call=True)
    except TypeError:  # older torch without always_call
        h2 = module_mod.register_module_forward_hook(post_hook)
    probe.patcher.add_undo(h1.remove)
    probe.patcher.add_undo(h2.remove)


def _first_bypass(probe: Probe, seen: set, module: Any, entry: tuple) -> None:
    site = probe.site()
    key = (entry[1], entry[2], (site or {}).get("file", ""), (site or {}).get("line", 0))
    if key in seen:
        return
    seen.add(key)
    probe.emit(
        "forward_bypass",
        ddp=entry[1],
        module_class=type(module).__name__,
        module_path=entry[2],
        site=site,
        step=probe.steps,
    )
