"""Triage recorder (only in `ddpdoctor triage` arms): what the arms are compared on.

- Pairing (`triage_pairing`): a digest of the parameters the model holds at its first training forward through DDP
  (at the first optimizer step where no DDP forward came first), and of the inputs of the first training forwards
  through DDP. Equal digests on the same rank of two arms mean the arms started from
  the same weights and saw the same batches (seeds, data order and augmentation included).
- Per-sample channel moments (`bn_samples`): for every gradient-enabled training forward of every BatchNorm
  layer, the biased variance of the input over the batch and the variance across samples of the per-sample channel
  means. Their ratio gives the effective number of independent values the batch mean averages (spatially
  correlated activations count for less than their number of positions): n_eff = 1 + B · var / var(sample means).
- Layer attributes (`bn_attrs`): at every optimizer step, each BatchNorm layer's class, mode, momentum, eps,
  requires_grad and the optimizer group (lr, weight decay) holding its weight and bias; the full list at the first
  step, then only the layers that changed.
- User modules (`user_modules`, at the end): the user's own source files the process imported, so that their copies
  are kept with the run (a class test in a helper module is named from them).
- Population statistics (`bn_population`, at the end): PreciseBN-style, on a copy of the model at the final weights
  — the running statistics reset, then accumulated as a cumulative average over the last HELD_BATCHES training
  batches in train mode (per-rank statistics, no collectives) — next to the running statistics the layers hold,
  and the relative change of the model's eval output on the first held batch between the two.
"""

from __future__ import annotations

import collections
import copy
import hashlib
from typing import Any

from ddpdoctor.probe.recorders.ddp import in_training
from ddpdoctor.probe.session import Probe

NAME = "bn_triage"
PAIRING_FORWARDS = 3
HELD_BATCHES = 4
FORWARDS_PER_STEP = 16  # per layer and step: per-sample moments kept


class _State:
    def __init__(self) -> None:
        self.initial_done = False
        self.forwards = 0
        self.held: collections.deque = collections.deque(maxlen=HELD_BATCHES)
        self.model: Any = None
        self.records: list[tuple[Any, int, int, int, Any]] = []
        self.per_step: dict[tuple[int, int], int] = {}
        self.attrs: dict[str, dict[str, Any]] = {}
        self.names: dict[int, str] = {}


def install(probe: Probe) -> None:
    if not probe.settings.arm:
        return
    import torch
    from torch.nn.modules import module as module_mod
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.parallel import DistributedDataParallel as DDP

    state = _State()

    def pre_hook(module: Any, args: Any) -> None:
        if (isinstance(module, _BatchNorm) and module.training and not probe.quiet and not probe.ending
                and torch.is_grad_enabled()):
            probe.safely("bn samples", _samples, probe, state, module, args, torch)

    handle = module_mod.register_module_forward_pre_hook(pre_hook)
    probe.patcher.add_undo(handle.remove)

    def make_forward(orig):
        def forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
            if (in_training(self) and probe.ddp_forward_depth == 0 and not probe.quiet and not probe.ending
                    and torch.is_grad_enabled()):
                probe.safely("triage batch", _ddp_forward, probe, state, self, inputs, kwargs, torch)
            return orig(self, *inputs, **kwargs)

        return forward

    probe.patcher.wrap(DDP, "forward", make_forward)

    _install_setters(probe, _BatchNorm)

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def step_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not state.initial_done:
            state.initial_done = True
            probe.safely("triage initial params", _initial_params, probe, optimizer, torch)

    h2 = register_optimizer_step_pre_hook(step_pre)
    probe.patcher.add_undo(h2.remove)

    def on_step(optimizer: Any) -> None:
        _flush_samples(probe, state, torch)
        probe.safely("bn attrs", _attrs, probe, state, _BatchNorm)

    probe.step_hooks.append(on_step)

    def on_end() -> None:
        _flush_samples(probe, state, torch)
        probe.safely("bn population", _population, probe, state, torch, _BatchNorm)
        probe.safely("user modules", _user_modules, probe)

    probe.end_hooks.append(on_end)


USER_MODULES = 64  # user source files named per process


def _user_modules(probe: Probe) -> None:
    """The user's own modules the run imported (`user_modules`, sites with line 0): their source is kept with the
    run, so an exact-class test in a helper module the script imports can be named (ddpdoctor.conversion)."""
    import sys

    from ddpdoctor.probe.session import is_user_file

    files = []
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.endswith(".py") and is_user_file(file):
            files.append(file)
    files = sorted(set(files))[:USER_MODULES]
    if files:
        probe.emit("user_modules", modules=[{"file": f, "line": 0} for f in files])


# ------------------------------------------------------------------------------------------------ setters

SETTER_SITES = 32  # distinct (attribute, line) places recorded per process
SET_ATTRS = ("momentum", "eps")


def _install_setters(probe: Probe, _BatchNorm: type) -> None:
    """Where the script's own code changes a BatchNorm layer's momentum/eps, mode (`m.eval()`) or requires_grad
    (`m.requires_grad_(False)`) directly: code that picks the layers by exact class runs these lines for plain
    BatchNorm and skips them for SyncBatchNorm, so comparing the arms' `bn_attr_set` sites names the line of the
    class test (DD209 file:line). Only calls made from user code; ddpdoctor's own are not the script's."""
    import sys

    from ddpdoctor.probe.session import is_user_file

    seen: set[tuple[str, str, int]] = set()

    import torch.nn.modules.module as module_py

    def note(module: Any, attr: str, frame: Any) -> None:
        while frame is not None and frame.f_code.co_filename == module_py.__file__:
            frame = frame.f_back  # `m.eval()` is Module.train(False): the line is the one that called eval
        if frame is None or probe.ending or probe.quiet or not is_user_file(frame.f_code.co_filename):
            return
        key = (attr, frame.f_code.co_filename, frame.f_lineno)
        if key in seen or len(seen) >= SETTER_SITES:
            return
        seen.add(key)
        probe.emit("bn_attr_set", attr=attr, cls=type(module).__name__, step=probe.steps,
                   site={"file": frame.f_code.co_filename, "line": frame.f_lineno, "function": frame.f_code.co_name})

    def make_setattr(orig):
        def __setattr__(self: Any, name: str, value: Any) -> None:
            if name in SET_ATTRS:
                probe.observe("bn attr set", note, self, name, sys._getframe(1))
            orig(self, name, value)

        return __setattr__

    def make_method(attr: str):
        def make(orig):
            def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                probe.observe("bn attr set", note, self, attr, sys._getframe(1))
                return orig(self, *args, **kwargs)

            return method

        return make

    probe.patcher.wrap(_BatchNorm, "__setattr__", make_setattr)
    probe.patcher.wrap(_BatchNorm, "train", make_method("training"))
    probe.patcher.wrap(_BatchNorm, "requires_grad_", make_method("requires_grad"))


# ------------------------------------------------------------------------------------------------ pairing


def _digest_tensors(tensors: list[Any]) -> str:
    import torch

    h = hashlib.blake2b(digest_size=12)
    for t in tensors:
        flat = t.detach().reshape(-1).contiguous()
        if flat.device.type != "cpu":
            flat = flat.cpu()
        h.update(str(tuple(t.shape)).encode())
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


def _tensors_in(obj: Any, out: list[Any], torch: Any, depth: int = 0) -> list[Any]:
    if depth > 4:
        return out
    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors_in(item, out, torch, depth + 1)
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            _tensors_in(obj[key], out, torch, depth + 1)
    return out


def _initial_params(probe: Probe, optimizer: Any, torch: Any) -> None:
    rec = next(iter(probe.registry.live_ddps()), None)
    if rec is not None:
        named = sorted(rec.module.named_parameters(), key=lambda kv: kv[0])
        source = "ddp"
    else:
        named = [(f"{gi}.{pi}", p) for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])]
        source = "optimizer"
    probe.emit("triage_pairing", what="initial_params", source=source, tensors=len(named),
               digest=_digest_tensors([p for _, p in named]), step=probe.steps)


def _ddp_forward(probe: Probe, state: _State, ddp: Any, args: Any, kwargs: Any, torch: Any) -> None:
    state.model = ddp.module
    if not state.initial_done:
        # the weights the model holds at its first training forward: what the arms start from. At the first
        # optimizer step they may already carry what a wrapper did before torch's step (fastai's OptimWrapper
        # decays weights itself, by layer class: a converted layer is decayed differently), which is a result of
        # the arms' difference, not a sign that they were not paired
        state.initial_done = True
        named = sorted(ddp.module.named_parameters(), key=lambda kv: kv[0])
        probe.emit("triage_pairing", what="initial_params", source="first_forward", tensors=len(named),
                   digest=_digest_tensors([p for _, p in named]), step=probe.steps)
    tensors = _tensors_in((args, kwargs), [], torch)
    state.forwards += 1
    if state.forwards <= PAIRING_FORWARDS:
        probe.emit("triage_pairing", what="batch", n=state.forwards, step=probe.steps,
                   shapes=[list(t.shape) for t in tensors[:4]], digest=_digest_tensors(tensors))

    def hold(obj: Any) -> Any:
        return obj.detach().clone() if torch.is_tensor(obj) else obj

    held_args = tuple(hold(a) for a in args)
    held_kwargs = {k: hold(v) for k, v in (kwargs or {}).items()}
    state.held.append((held_args, held_kwargs))


# ------------------------------------------------------------------------------------------------ per-sample moments


def _samples(probe: Probe, state: _State, module: Any, args: Any, torch: Any) -> None:
    x = args[0] if args else None
    if not torch.is_tensor(x) or x.dim() < 2 or x.shape[0] < 2 or x.shape[1] == 0:
        return
    key = (id(module), probe.steps)
    n = state.per_step.get(key, 0)
    if n >= FORWARDS_PER_STEP:
        return
    state.per_step[key] = n + 1
    with torch.no_grad():
        xd = x.detach().double()
        per_sample = xd.mean(dim=list(range(2, xd.dim()))) if xd.dim() > 2 else xd  # (N, C)
        between = per_sample.var(dim=0, unbiased=True)
        dims = [0, *range(2, xd.dim())]
        total = xd.var(dim=dims, unbiased=False)
        vec = torch.cat([total, between])
    state.records.append((module, probe.steps, int(x.shape[0]), int(x.numel() // x.shape[1]), vec))


def _name(probe: Probe, state: _State, module: Any) -> str:
    from ddpdoctor.probe.recorders.bn_conversion import layer_name

    fallback = state.names.setdefault(id(module), f"{type(module).__name__}#{len(state.names)}")
    return layer_name(probe, module, fallback)


def _flush_samples(probe: Probe, state: _State, torch: Any) -> None:
    records, state.records = state.records, []
    state.per_step = {k: v for k, v in state.per_step.items() if k[1] >= probe.steps}
    if not records:
        return
    by_step: dict[int, list] = {}
    for r in records:
        by_step.setdefault(r[1], []).append(r)
    for step, items in sorted(by_step.items()):
        vec = torch.cat([r[4] for r in items]).cpu()
        ref = probe.blob(vec.numpy().tobytes(), dtype="float64", count=int(vec.numel()))
        probe.emit("bn_samples", step=step, forwards={
            "name": [_name(probe, state, r[0]) for r in items],
            "samples": [r[2] for r in items],
            "count": [r[3] for r in items],
            "channels": [int(r[4].numel() // 2) for r in items],
        }, moments=ref)


# ------------------------------------------------------------------------------------------------ attributes


def _bn_layers(probe: Probe, state: _State, _BatchNorm: type) -> list[tuple[str, Any]]:
    rec = next(iter(probe.registry.live_ddps()), None)
    root = rec.module if rec is not None else state.model
    if root is None:
        return []
    return [(name or type(m).__name__, m) for name, m in root.named_modules() if isinstance(m, _BatchNorm)]


def _attrs(probe: Probe, state: _State, _BatchNorm: type) -> None:
    from ddpdoctor.probe.recorders.bn_conversion import layer_attributes, optimizer_index

    layers = _bn_layers(probe, state, _BatchNorm)
    if not layers:
        return
    index = optimizer_index(probe)
    changed: dict[str, dict[str, Any]] = {}
    for name, m in layers:
        entry = layer_attributes(m)
        for k in ("weight", "bias"):
            p = getattr(m, k, None)
            entry[f"{k}_optimizer"] = None if p is None else index.get(id(p))
        if state.attrs.get(name) != entry:
            state.attrs[name] = entry
            changed[name] = entry
    if changed:
        probe.emit("bn_attrs", step=probe.steps, full=len(changed) == len(layers) and probe.steps <= 1,
                   layers=changed, total=len(layers))


# ------------------------------------------------------------------------------------------------ population


def _population(probe: Probe, state: _State, torch: Any, _BatchNorm: type) -> None:
    from ddpdoctor.probe.arms import local_stats, no_collectives, process_group_memo
    from ddpdoctor.probe.equivalence import first_tensor

    model = state.model
    rec = next(iter(probe.registry.live_ddps()), None)
    if rec is not None:
        model = rec.module
    held = list(state.held)
    if model is None or not held:
        probe.emit("bn_population", ok=False, reason="no training forward through DDP was seen")
        return
    real = {name: m for name, m in model.named_modules() if isinstance(m, _BatchNorm)}
    probe.quiet += 1
    try:
        with torch.no_grad(), local_stats(), no_collectives():
            twin = copy.deepcopy(model, process_group_memo(model))
            args0, kwargs0 = held[-1]
            twin.eval()
            out_running = first_tensor(twin(*args0, **kwargs0))
            twin.train()
            layers = [(n, m) for n, m in twin.named_modules()
                      if isinstance(m, _BatchNorm) and m.training and m.track_running_stats
                      and m.running_mean is not None and n in real]
            batch_means: dict[str, list[Any]] = {n: [] for n, _ in layers}
            batch_samples: list[int] = []
            handles = []
            for n, m in layers:
                m.reset_running_stats()
                m.momentum = None

                def keep(mod: Any, a: Any, n: str = n) -> None:
                    x = a[0]
                    batch_means[n].append(x.detach().double().mean([0, *range(2, x.dim())]))

                handles.append(m.register_forward_pre_hook(keep))
            try:
                for args, kwargs in held:
                    t = _tensors_in(args, [], torch)
                    batch_samples.append(int(t[0].shape[0]) if t and t[0].dim() > 0 else 0)
                    twin(*args, **kwargs)
            finally:
                for h in handles:
                    h.remove()
            local = {n: (m.running_mean.detach().double().clone(), m.running_var.detach().double().clone())
                     for n, m in layers}
        pooled = _pool_over_ranks(probe, local, torch)
        with torch.no_grad(), local_stats(), no_collectives():
            for n, m in layers:  # evaluate with the population statistics of all ranks' batches
                mean, var = (pooled or local)[n]
                m.running_mean.copy_(mean.to(m.running_mean.dtype))
                m.running_var.copy_(var.to(m.running_var.dtype))
            twin.eval()
            out_population = first_tensor(twin(*args0, **kwargs0))
    except Exception as exc:
        probe.emit("bn_population", ok=False, reason=f"{type(exc).__name__}: {exc}"[:400])
        return
    finally:
        probe.quiet -= 1
    parts = []
    entries = []
    for n, m in layers:
        r = real[n]
        if r.running_mean is None or r.running_var is None:
            continue
        means = batch_means[n]
        c = int(m.running_mean.numel())
        if not means or any(bm.numel() != c for bm in means):
            continue
        pm, pv = local[n]
        gm, gv = (pooled or local)[n]
        parts.extend([r.running_mean.detach().double().reshape(-1).cpu(),
                      r.running_var.detach().double().reshape(-1).cpu(),
                      pm.reshape(-1).cpu(), pv.reshape(-1).cpu(), gm.reshape(-1).cpu(), gv.reshape(-1).cpu(),
                      torch.stack(means).reshape(-1).cpu()])
        entries.append({"name": n, "channels": c, "batches": len(means), "eps": float(m.eps),
                        "momentum": None if r.momentum is None else float(r.momentum),
                        "batches_tracked": (int(r.num_batches_tracked.item())
                                            if r.num_batches_tracked is not None else None)})
    shift = None
    if out_running is not None and out_population is not None and out_running.shape == out_population.shape:
        a, b = out_running.detach().double(), out_population.detach().double()
        denom = float(b.norm().item())
        shift = float((a - b).norm().item()) / denom if denom > 0 else None
    ref = None
    if parts:
        vec = torch.cat(parts)
        ref = probe.blob(vec.numpy().tobytes(), dtype="float64", count=int(vec.numel()))
    probe.emit("bn_population", ok=True, step=probe.steps, layers=entries, stats=ref, batches=len(held),
               batch_samples=batch_samples, eval_output_shift=shift, pooled=pooled is not None)


POOL_TIMEOUT = 20.0  # seconds a rank waits for its peers' population statistics at the end


def _pool_over_ranks(probe: Probe, local: dict[str, tuple[Any, Any]], torch: Any) -> dict[str, tuple[Any, Any]] | None:
    """The population statistics of every rank's held batches together: the ranks' PreciseBN means averaged, their
    variances averaged plus the spread of their means (the variance of the union). Exchanged through the process
    group's store with a deadline, never with a collective: a peer that ended differently cannot hang this one.
    None when there is no process group or a peer did not answer."""
    import time

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2 or not local:
        return None
    store = dist.distributed_c10d._get_default_store()
    world, rank = dist.get_world_size(), dist.get_rank()
    names = sorted(local)
    vec = torch.cat([t.reshape(-1) for n in names for t in local[n]]).cpu()
    store.set(f"ddpdoctor/triage/population/{rank}", vec.numpy().tobytes())
    keys = [f"ddpdoctor/triage/population/{r}" for r in range(world)]
    deadline = time.monotonic() + min(POOL_TIMEOUT, max(probe.settings.timeout / 4, 1.0))
    while not store.check(keys):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    import numpy as np

    vectors = [torch.from_numpy(np.frombuffer(store.get(k), dtype=np.float64).copy()) for k in keys]
    if any(v.numel() != vec.numel() for v in vectors):
        return None
    stacked = torch.stack(vectors)
    out: dict[str, tuple[Any, Any]] = {}
    offset = 0
    for n in names:
        c = local[n][0].numel()
        means, variances = stacked[:, offset: offset + c], stacked[:, offset + c: offset + 2 * c]
        offset += 2 * c
        mean = means.mean(0)
        out[n] = (mean, variances.mean(0) + ((means - mean) ** 2).mean(0))
    return out
