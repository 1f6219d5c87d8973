"""Random-stream recorder: the state of the generators that dropout and the data pipeline draw from, per rank, at
the same points of the run, so the analysis can tell whether every rank draws the same random numbers (DD304).

Recorded points:
- each of the first FORWARDS_RECORDED training forwards through DistributedDataParallel: torch's default CPU
  generator and the current device's generator, before the forward, and whether the forward advanced each one
  (dropout, stochastic depth, noise layers draw there);
- each training DataLoader iteration (`iter(loader)` with grad enabled): torch's, numpy's and `random`'s global
  states as the main process's data pipeline will draw from them (num_workers=0), and the base seed the
  DataLoader drew for its workers (num_workers>0: worker k seeds torch and `random` with base_seed + k and numpy
  from (base_seed, k), so equal base seeds mean equal worker streams on every rank).

Nothing is drawn from the user's generators: states are read (`get_state`, `np.random.get_state`,
`random.getstate`) and digested, and the "next draws" shown in the evidence come from a *copy* of each state in a
private generator. The base seed is an attribute the DataLoader iterator already holds.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "rng"
FORWARDS_RECORDED = 8
LOADER_ITERATIONS_RECORDED = 8
NEXT_DRAWS = 3
SEED_CALLS_RECORDED = 12


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def torch_state(generator: Any, draws: bool = True) -> dict[str, Any]:
    """{digest, next} of a torch generator; `next` = its next uniform draws, computed on a copy (CPU states only)."""
    import torch

    state = generator.get_state()
    out: dict[str, Any] = {"digest": _digest(state.numpy().tobytes())}
    if draws and getattr(generator, "device", torch.device("cpu")).type == "cpu":
        clone = torch.Generator()
        clone.set_state(state)
        out["next"] = [round(v, 6) for v in torch.rand(NEXT_DRAWS, generator=clone).tolist()]
    return out


def numpy_state() -> dict[str, Any] | None:
    np = sys.modules.get("numpy")
    if np is None:  # the script never imported numpy: nothing of it can draw
        return None
    state = np.random.get_state()
    h = hashlib.blake2b(digest_size=12)
    h.update(state[1].tobytes())
    h.update(repr(state[2:]).encode())
    clone = np.random.RandomState()
    clone.set_state(state)
    return {"digest": h.hexdigest(), "next": [round(float(v), 6) for v in clone.random_sample(NEXT_DRAWS)]}


def python_state() -> dict[str, Any]:
    import random

    state = random.getstate()
    clone = random.Random()
    clone.setstate(state)
    return {"digest": _digest(repr(state).encode()), "next": [round(clone.random(), 6) for _ in range(NEXT_DRAWS)]}


def device_generator() -> Any:
    """The current device's generator when CUDA is in use (emulated or real), else None. Never initialises CUDA."""
    import torch

    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        gens = torch.cuda.default_generators
        return gens[torch.cuda.current_device()] if gens else None
    except Exception:
        return None


def install(probe: Probe) -> None:
    import torch
    from torch.nn.modules import module as module_mod
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    state: dict[str, Any] = {"forwards": 0, "before": {}, "loader_iters": 0, "loader_iteration": {}}

    def pre_hook(module: Any, args: Any) -> None:
        if (
            state["forwards"] < FORWARDS_RECORDED
            and isinstance(module, DDP)
            and module.training
            and torch.is_grad_enabled()
            and not probe.ending
        ):
            probe.safely("rng forward", _before_forward, probe, state, module)
        return None

    def post_hook(module: Any, args: Any, output: Any) -> None:
        if state["before"] and id(module) in state["before"]:
            probe.safely("rng forward", _after_forward, probe, state, module)
        return None

    h1 = module_mod.register_module_forward_pre_hook(pre_hook)
    h2 = module_mod.register_module_forward_hook(post_hook)
    probe.patcher.add_undo(h1.remove)
    probe.patcher.add_undo(h2.remove)

    def make_iter(orig):
        def __iter__(self):  # noqa: ANN001
            it = orig(self)
            if state["loader_iters"] < LOADER_ITERATIONS_RECORDED and torch.is_grad_enabled() and not probe.ending:
                probe.safely("rng loader", _loader_iteration, probe, state, self, it)
            return it

        return __iter__

    probe.patcher.wrap(DataLoader, "__iter__", make_iter)
    _install_seed_calls(probe)


def _install_seed_calls(probe: Probe) -> None:
    """Record the script's own seeding calls (which generator, the seed, where): the evidence can then say which
    line made the streams equal on every rank, or that the script already seeds with its rank."""
    import random

    import torch

    from ddpdoctor.probe.importhook import when_imported
    from ddpdoctor.probe.patching import wrap_everywhere
    from ddpdoctor.probe.session import is_user_file

    counts = {"n": 0}

    def make_seed(which: str):
        def make(orig):
            def seed(*args: Any, **kwargs: Any) -> Any:
                if not probe.ending and is_user_file(sys._getframe(1).f_code.co_filename):
                    probe.user_seeded = True  # the script seeds itself: triage's per-rank seed stands aside (arms)
                if counts["n"] < SEED_CALLS_RECORDED and not probe.ending:
                    caller = sys._getframe(1)
                    if is_user_file(caller.f_code.co_filename):  # DataLoader workers seed from torch's own code
                        counts["n"] += 1
                        value = args[0] if args else kwargs.get("seed")
                        site = {"file": caller.f_code.co_filename, "line": caller.f_lineno,
                                "function": caller.f_code.co_name}
                        probe.safely("rng seed", probe.emit, "rng_seed", generator=which, seed=_seed_value(value),
                                     site=site, step=probe.steps)
                return orig(*args, **kwargs)

            return seed

        return make

    wrap_everywhere(probe, (torch, torch.random), "manual_seed", make_seed("torch"))
    probe.patcher.wrap(random, "seed", make_seed("random"))

    def numpy_imported() -> None:
        np = sys.modules.get("numpy")
        if np is not None and getattr(np, "random", None) is not None:
            probe.safely("numpy seed", probe.patcher.wrap, np.random, "seed", make_seed("numpy"))

    when_imported("numpy", numpy_imported)


def _seed_value(value: Any) -> Any:
    try:
        return int(value)
    except Exception:
        return None if value is None else repr(value)[:60]


def _before_forward(probe: Probe, state: dict[str, Any], module: Any) -> None:
    import torch

    dev = device_generator()
    state["before"][id(module)] = {
        "torch": torch_state(torch.default_generator),
        "device": torch_state(dev, draws=False) if dev is not None else None,
        "device_gen": dev,
        "step": probe.steps,
    }


def _after_forward(probe: Probe, state: dict[str, Any], module: Any) -> None:
    import torch

    before = state["before"].pop(id(module))
    state["forwards"] += 1
    after_torch = torch_state(torch.default_generator, draws=False)
    dev = before.pop("device_gen")
    advanced = {"torch": after_torch["digest"] != before["torch"]["digest"]}
    if dev is not None and before["device"] is not None:
        advanced["device"] = torch_state(dev, draws=False)["digest"] != before["device"]["digest"]
    probe.emit(
        "rng_forward",
        n=state["forwards"],
        step=before["step"],
        epoch=probe.epoch,
        ddp=probe.registry.id_of(module),
        generators={"torch": before["torch"], "device": before["device"]},
        advanced=advanced,
    )


def _loader_iteration(probe: Probe, state: dict[str, Any], loader: Any, it: Any) -> None:
    import torch

    state["loader_iters"] += 1
    lid = probe.registry.id_of(loader)
    seq = state["loader_iteration"].get(lid, 0)
    state["loader_iteration"][lid] = seq + 1
    workers = int(getattr(loader, "num_workers", 0) or 0)
    base_seed = getattr(it, "_base_seed", None) if workers > 0 else None
    probe.emit(
        "rng_loader",
        loader=lid,
        iteration=seq,
        site=probe.site(),
        num_workers=workers,
        worker_base_seed=int(base_seed) if isinstance(base_seed, int) else None,
        loader_generator=getattr(loader, "generator", None) is not None,
        worker_init_fn=getattr(getattr(loader, "worker_init_fn", None), "__qualname__", None),
        generators={"torch": torch_state(torch.default_generator), "numpy": numpy_state(), "random": python_state()},
    )
