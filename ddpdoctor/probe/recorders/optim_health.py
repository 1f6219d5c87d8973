"""Optimisation-health recorder: what each optimizer step was made of and whether it could teach the model anything.

- Backward passes: `Tensor.backward` and `torch.autograd.backward` are wrapped to see the loss (the tensor
  `.backward()` is called on: its value, bit-exact) and to count backward passes per optimizer step. A global
  forward pre-hook notes, for every training forward through DistributedDataParallel, whether DDP will all-reduce
  in the next backward (`require_backward_grad_sync`, which `no_sync()` clears; DDP reads it in its forward), so
  a backward is counted as all-reducing or not (DD403).
- Gradients: a global optimizer step pre-hook summarises the gradients the optimizer is about to use (how many
  are None, exactly zero, non-finite; their norm) and the learning rates (DD405, DD406, DD402).
- Hand reductions: collectives (`all_reduce`, `reduce`, `all_gather*`) called *by user code* whose tensor is, or
  shares memory with, the current `.grad` of a parameter DDP registered for reduction are recorded with the
  gradient norm before the call; the step pre-hook measures the norm the optimizer then used, so the report can
  say "the optimizer stepped with gradients 2x what DDP produced" (DD404). Collectives that ddpdoctor itself
  issues (the CPU SyncBatchNorm's per-channel sums in backward), that torch issues (DDP's built-in comm hooks,
  torch.distributed.nn) or that run inside a DDP communication hook (the user's own, reducing DDP's bucket) are
  DDP's or the library's reduction, not a hand reduction. A gradient is matched by its live storage at the time
  of the call, never by a remembered address: once `zero_grad()` frees a gradient, the allocator hands its
  memory to the next tensor of that size (the SyncBN sums, a logged loss), which is not a gradient.
- Non-finite values: the loss (at backward, and the output of `nn` loss modules), the gradients (step pre-hook),
  the parameters and the BatchNorm running statistics (after the step): the first step, rank and tensor (DD406).

Cost: one isinstance check per module call (hooks), a read of the loss per backward, two foreach norms over the
gradients per step and one over the parameters and norm buffers; per collective while a DDP model exists, a
step over the wrapper frames to its caller (a few µs) and, for calls from user code only, a dict lookup of the
tensor's storage. Values are read, never written; no generator is touched and no collective is added. Without
DDP, the optimizers' parameters are indexed instead: a script that averages gradients itself is seen doing so
(DD110 must not call its replicas unwrapped).

Size: one module (~600 lines) because the backward, step and collective wrappers share one per-process state (the
backward counters, the gradient index, the hand reductions of the current step) that each of them updates.

On a GPU every value is reduced on the device and read through `readback` (pinned, non-blocking, delivered in
order at a later step): no host synchronisation per backward or per step. The `train_step` event of a step is
emitted once its values (and its losses, read earlier) have landed. Only hand reductions of gradients (DD404,
rare) still read norms synchronously.

Size: one module because the backward wrappers, the step hooks and the collective wrappers share one per-step
state (`_State`: the backward counts, the losses as their reads land, the hand reductions of this step) that the
`train_step` event is made of; split, that state would travel between modules.

Install order: this recorder must be installed before `process_group`, so that its collective wrappers sit
*inside* the process-group recorder's (which looks at its direct caller to tell user code from library code).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from ddpdoctor.probe.patching import wrap_everywhere
from ddpdoctor.probe.recorders.ddp import in_training
from ddpdoctor.probe.session import Probe, is_user_file

NAME = "optim_health"
LOSSES_PER_STEP = 8  # loss values kept per optimizer step (accumulation micro-steps)
NAMES_SHOWN = 8  # tensor names kept per event
GRAD_COLLECTIVE_EVENTS = 20  # grad_collective events per process
NONFINITE_EVENTS = 3  # nonfinite events per kind of tensor per process
HAND_OPS = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor")


def _float(value: float) -> Any:
    """A float as JSON: finite numbers as numbers, the others as "nan"/"inf"/"-inf"."""
    return value if math.isfinite(value) else str(value)


class _State:
    def __init__(self) -> None:
        self.depth = 0  # inside a wrapped backward (Tensor.backward calls torch.autograd.backward)
        self.opt_depth = 0  # inside an optimizer step (an optimizer stepping an inner one)
        self.pending: tuple[str, int] | None = None  # ("sync" | "nosync", DDP id): a forward awaits its backward
        self.backward_serial = 0
        self.in_collective = False
        self.nonfinite_emitted: dict[str, int] = {}
        self.grad_events = 0
        self.names: dict[int, str] = {}  # id(param) -> qualified name (DDP modules)
        self.names_ddps: tuple[int, ...] = ()  # probe ids of the live DDP models `names` was built from
        # storage address of DDP gradients -> [(param, name)]: candidates only, each checked against p.grad at use
        self.grad_index: dict[int, list[tuple[Any, str]]] = {}
        self.grad_index_generation: tuple[int, int] | None = None  # (backward_serial, steps) it was built at
        self.comm_hooks = 0  # inside a DDP communication hook (DDP's own reduction of a bucket)
        self.wrapper_codes: dict[str, tuple[tuple[int, ...], frozenset[Any]]] = {}  # op -> (attr ids, codes)
        self.reader: Any = None  # the probe's readback (set at install)
        self.reset_step()

    def reset_step(self) -> None:
        self.backwards = 0
        self.syncing = 0
        self.nosync = 0
        self.plain = 0
        self.sync_by_ddp: dict[int, int] = {}
        self.losses: list[list[Any]] = []  # filled as the loss reads land (readback), in backward order
        self.loss_reads = 0
        self.loss_shapes: set[int] = set()
        self.backward_site: dict[str, Any] | None = None
        self.loss_module: dict[str, Any] | None = None
        self.hand: dict[int, dict[str, Any]] = {}  # id(param) -> first hand reduction this step


def install(probe: Probe) -> None:
    import torch
    import torch.autograd
    import torch.distributed as dist
    from torch.nn.modules import module as module_mod
    from torch.nn.modules.loss import _Loss
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from ddpdoctor.probe import readback

    st = _State()
    st.reader = readback.for_probe(probe)

    # -- which DDP forward precedes each backward
    def forward_pre_hook(module: Any, args: Any) -> None:
        if isinstance(module, DDP) and in_training(module) and torch.is_grad_enabled():
            st.pending = ("sync" if getattr(module, "require_backward_grad_sync", True) else "nosync", id(module))
        return None

    def forward_hook(module: Any, args: Any, output: Any) -> None:
        if isinstance(module, _Loss) and torch.is_grad_enabled() and torch.is_tensor(output) and output.numel() == 1:
            probe.safely("loss module", _loss_module_output, probe, st, module, args, output)
        return None

    h1 = module_mod.register_module_forward_pre_hook(forward_pre_hook)
    h2 = module_mod.register_module_forward_hook(forward_hook)
    probe.patcher.add_undo(h1.remove)
    probe.patcher.add_undo(h2.remove)

    # -- backward passes
    def make_backward(orig, first_tensors):
        def backward(*args: Any, **kwargs: Any) -> Any:
            if st.depth or probe.ending:
                return orig(*args, **kwargs)
            st.depth += 1
            try:
                probe.safely("backward", _before_backward, probe, st, first_tensors(args, kwargs))
                return orig(*args, **kwargs)
            finally:
                st.depth -= 1
                st.backward_serial += 1

        return backward

    def tensor_self(args: tuple, kwargs: dict) -> Any:
        return args[0] if args else None

    def autograd_tensors(args: tuple, kwargs: dict) -> Any:
        tensors = args[0] if args else kwargs.get("tensors")
        if isinstance(tensors, (list, tuple)):
            return tensors[0] if len(tensors) == 1 else None
        return tensors

    probe.patcher.wrap(torch.Tensor, "backward", lambda orig: make_backward(orig, tensor_self))
    probe.patcher.wrap(torch.autograd, "backward", lambda orig: make_backward(orig, autograd_tensors))

    # -- gradients before each step, parameters and norm buffers after it
    def pre_hook(optimizer: Any, args: Any, kwargs: Any) -> Any:
        st.opt_depth += 1
        if st.opt_depth == 1 and not probe.ending and not probe.quiet_steps:
            closure = kwargs.get("closure") if kwargs else None
            if closure is None and args:
                closure = args[0]
            if callable(closure):
                # `optimizer.step(closure)` (Lightning's automatic optimization, LBFGS): the forward, backward
                # and gradient reduction run inside the step, in the closure; the gradients are read after it
                return _closure_then_record(probe, st, optimizer, closure, args, kwargs)
            probe.safely("train_step", _before_step, probe, st, optimizer)
        return None

    def post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        st.opt_depth = max(0, st.opt_depth - 1)
        return None

    h3 = register_optimizer_step_pre_hook(pre_hook)
    h4 = register_optimizer_step_post_hook(post_hook)
    probe.patcher.add_undo(h3.remove)
    probe.patcher.add_undo(h4.remove)
    def optim_health_after_step(optimizer: Any) -> None:
        _after_step(probe, st, optimizer)

    probe.step_hooks.append(optim_health_after_step)

    # -- collectives on DDP gradients
    if dist.is_available():
        owners = (dist.distributed_c10d, dist)
        for op in HAND_OPS:
            if getattr(dist.distributed_c10d, op, None) is not None:
                wrap_everywhere(probe, owners, op, lambda fn, op=op: _make_collective(probe, st, owners, op, fn))
        if hasattr(DDP, "register_comm_hook"):
            probe.patcher.wrap(DDP, "register_comm_hook", lambda orig: _make_register_comm_hook(st, orig))


def _closure_then_record(probe: Probe, st: _State, optimizer: Any, closure: Any, args: Any, kwargs: Any) -> Any:
    """The step's (args, kwargs) with the closure replaced by one that records the gradients once it has run
    (once per step: LBFGS calls its closure several times)."""
    done = [False]

    def closure_then_record() -> Any:
        out = closure()
        if not done[0]:
            done[0] = True
            probe.safely("train_step", _before_step, probe, st, optimizer)
        return out

    if kwargs and kwargs.get("closure") is closure:
        return tuple(args), {**kwargs, "closure": closure_then_record}
    return (closure_then_record, *tuple(args)[1:]), dict(kwargs or {})


# ------------------------------------------------------------------------------------------------ backward


def _before_backward(probe: Probe, st: _State, loss: Any) -> None:
    import torch

    st.backwards += 1
    probe.backward_calls += 1
    kind, ddp = st.pending if st.pending is not None else (None, 0)
    if kind == "sync":
        st.syncing += 1
        st.sync_by_ddp[ddp] = st.sync_by_ddp.get(ddp, 0) + 1
    elif kind == "nosync":
        st.nosync += 1
    else:
        st.plain += 1
    st.pending = None
    st.backward_site = probe.site()
    if not torch.is_tensor(loss):
        return
    n = int(loss.numel())
    st.loss_shapes.add(n)
    if n != 1 or st.loss_reads >= LOSSES_PER_STEP:
        return
    st.loss_reads += 1
    # float32 as before (float64 losses are read at float32); integer losses exactly
    scalar = loss.detach().float().reshape(()) if loss.dtype.is_floating_point else loss.detach().double().reshape(())
    bucket, step, site = st.losses, probe.steps + 1, st.backward_site

    def record(host: list[Any]) -> None:
        value = float(host[0])
        bucket.append([_float(value), value.hex()])
        if not math.isfinite(value):
            _nonfinite(probe, st, "loss", step=step, names=["loss passed to backward()"], count=1, total=1,
                       value=str(value), site=site)

    st.reader.read([scalar], record, where="loss")


def _loss_module_output(probe: Probe, st: _State, module: Any, args: Any, output: Any) -> None:
    import torch

    if st.loss_module is None:  # the first loss module of the step: its class and input shape explain a dead loss
        first = args[0] if args else None
        st.loss_module = {
            "cls": type(module).__name__,
            "input_shape": list(first.shape) if torch.is_tensor(first) else None,
            "reduction": getattr(module, "reduction", None),
        }
    step, site = probe.steps + 1, probe.site()

    def check(host: list[Any]) -> None:
        value = float(host[0])
        if not math.isfinite(value):
            _nonfinite(probe, st, "loss", step=step, names=["output of the loss module"], count=1, total=1,
                       value=str(value), site=site)

    st.reader.read([output.detach().float().reshape(())], check, where="loss module")


def _nonfinite(probe: Probe, st: _State, what: str, **fields: Any) -> None:
    n = st.nonfinite_emitted.get(what, 0)
    if n >= NONFINITE_EVENTS:
        return
    st.nonfinite_emitted[what] = n + 1
    probe.emit("nonfinite", tensor=what, **fields)


# ------------------------------------------------------------------------------------------------ names


def _param_names(probe: Probe, st: _State) -> dict[int, str]:
    ddps = list(probe.registry.live_ddps())
    key = tuple(rec.pid for rec in ddps)  # not a count: a model can be freed and another one built (same count)
    if key != st.names_ddps:
        st.names = {}
        for rec in ddps:
            for name, p in rec.module.named_parameters():
                st.names.setdefault(id(p), name)
        st.names_ddps = key
    return st.names


def _optimizer_params(probe: Probe, st: _State, optimizer: Any) -> list[tuple[str, Any]]:
    names = _param_names(probe, st)
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group.get("params", ())):
            out.append((names.get(id(p)) or f"param_groups[{gi}][{pi}]", p))
    return out


def _max_abs(tensors: list[Any]) -> tuple[list[list[int]], list[Any]]:
    """max |x| of each tensor (NaN if it holds a NaN, inf if an inf): exact zero and non-finite in one pass.
    Computed on the tensors' devices: (index groups, one float32 tensor per group); `_assemble` puts the read
    values back in order."""
    import torch

    from ddpdoctor.probe.recorders.params import local

    tensors = [local(t) for t in tensors]  # a DTensor's shard: no collective inside a hook
    groups: dict[tuple[Any, Any], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    parts = []
    for idx in groups.values():
        ts = [tensors[i].detach() for i in idx]
        try:
            parts.append(torch.stack(torch._foreach_norm(ts, float("inf"))).float())
        except Exception:  # sparse or exotic tensors: the slow way
            parts.append(torch.tensor([float(t.to_dense().abs().max()) if t.numel() else 0.0 for t in ts]))
    return list(groups.values()), parts


def _assemble(n: int, groups: list[list[int]], host: list[Any]) -> list[float]:
    out: list[float] = [0.0] * n
    for idx, values in zip(groups, host):
        for i, v in zip(idx, values.tolist()):
            out[i] = v
    return out


def _l2_parts(tensors: list[Any]) -> list[Any]:
    """Per device/dtype group, the sum of the squared L2 norms (float64, on the device); `_l2` adds them up."""
    import torch

    from ddpdoctor.probe.recorders.params import local

    groups: dict[tuple[Any, Any], list[Any]] = {}
    for t in map(local, tensors):
        groups.setdefault((t.device, t.dtype), []).append(t.detach())
    parts = []
    for ts in groups.values():
        try:
            norms = torch.stack(torch._foreach_norm(ts, 2.0)).double()
        except Exception:
            norms = torch.stack([t.to_dense().double().norm() for t in ts])
        parts.append((norms**2).sum())
    return parts


def _l2(host: list[Any]) -> float:
    total = 0.0
    for part in host:
        total += float(part)
    return math.sqrt(total) if math.isfinite(total) else total


# ------------------------------------------------------------------------------------------------ steps


def _before_step(probe: Probe, st: _State, optimizer: Any) -> None:
    from ddpdoctor.probe.recorders.params import local

    step = probe.steps + 1  # the optimizer recorder counts this step in its post-hook
    params = _optimizer_params(probe, st, optimizer)
    with_grad = [(n, p.grad) for n, p in params if p.grad is not None]
    grad_tensors = [g for _, g in with_grad]
    groups, maxabs_parts = _max_abs(grad_tensors)
    l2_parts = _l2_parts(grad_tensors)
    hand = None
    if st.hand:
        by_id = {id(p): p for _, p in params}
        ratios = []
        for pid, h in st.hand.items():
            p = by_id.get(pid)
            if p is None or p.grad is None or not h["before"]:
                continue
            after = float(local(p.grad).detach().float().norm())
            ratios.append(after / h["before"])
        ratios.sort()
        hand = {
            "params": len(st.hand),
            "numel": int(sum(h["numel"] for h in st.hand.values())),
            "ops": sorted({h["op"] for h in st.hand.values()}),
            "sites": _unique_sites([h["site"] for h in st.hand.values()]),
            "after_ddp": sum(1 for h in st.hand.values() if h["after_ddp"]),
            "ratio_median": _float(ratios[len(ratios) // 2]) if ratios else None,
            "ratio_min": _float(ratios[0]) if ratios else None,
            "ratio_max": _float(ratios[-1]) if ratios else None,
        }
    fields = dict(
        step=step,
        opt=probe.registry.id_of(optimizer),
        backwards=st.backwards,
        syncing_backwards=st.syncing,
        max_syncs_per_ddp=max(st.sync_by_ddp.values(), default=0),
        nosync_backwards=st.nosync,
        plain_backwards=st.plain,
        losses=st.losses,  # this step's list: its loss reads land before this step's own read (readback order)
        loss_numel=sorted(st.loss_shapes),
        backward_site=st.backward_site,
        loss_module=st.loss_module,
    )
    lrs = [_lr(g.get("lr")) for g in optimizer.param_groups]
    initial_lrs = [_lr(g.get("initial_lr")) for g in optimizer.param_groups]
    site = st.backward_site

    def emit(host: list[Any]) -> None:
        maxabs = _assemble(len(grad_tensors), groups, host[: len(maxabs_parts)])
        zero = [n for (n, _), m in zip(with_grad, maxabs) if m == 0.0]
        bad = [n for (n, _), m in zip(with_grad, maxabs) if not math.isfinite(m)]
        norm = _l2(host[len(maxabs_parts):]) if with_grad else 0.0
        grads = {
            "params": len(params),
            "none": len(params) - len(with_grad),
            "zero": len(zero),
            "nonfinite": len(bad),
            "norm": _float(norm),
            "max_abs": _float(max(maxabs)) if maxabs else 0.0,
            "numel": int(sum(p.numel() for _, p in params)),
        }
        if bad:
            _nonfinite(probe, st, "grad", step=step, names=bad[:NAMES_SHOWN], count=len(bad), total=len(params),
                       site=site)
        probe.emit("train_step", **fields, grads=grads, zero_grads=zero[:NAMES_SHOWN], hand_reduced=hand, lrs=lrs,
                   initial_lrs=initial_lrs)

    st.reader.read(maxabs_parts + l2_parts, emit, where="train_step")
    st.reset_step()


def _lr(value: Any) -> Any:
    if value is None:
        return None
    try:
        return _float(float(value))
    except (TypeError, ValueError):
        return None


def _unique_sites(sites: list[Any]) -> list[Any]:
    seen = set()
    out = []
    for s in sites:
        key = (s or {}).get("file"), (s or {}).get("line")
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _after_step(probe: Probe, st: _State, optimizer: Any) -> None:
    """Parameters and BatchNorm running statistics after the update: a non-finite value there outlives the step."""
    from torch.nn.modules.batchnorm import _NormBase

    params = _optimizer_params(probe, st, optimizer)
    buffers: list[tuple[str, str, Any]] = []
    for rec in probe.registry.live_ddps():
        for name, m in rec.module.named_modules():
            if isinstance(m, _NormBase):
                for what in ("running_var", "running_mean"):
                    t = getattr(m, what, None)
                    if t is not None:
                        buffers.append((what, f"{name}.{what}" if name else what, t))
    param_groups, param_parts = _max_abs([p for _, p in params])
    buffer_groups, buffer_parts = _max_abs([t for _, _, t in buffers])
    step = probe.steps

    def check(host: list[Any]) -> None:
        maxabs = _assemble(len(params), param_groups, host[: len(param_parts)])
        bad = [n for (n, _), m in zip(params, maxabs) if not math.isfinite(m)]
        if bad:
            _nonfinite(probe, st, "param", step=step, names=bad[:NAMES_SHOWN], count=len(bad), total=len(params))
        if not buffers:
            return
        maxabs = _assemble(len(buffers), buffer_groups, host[len(param_parts):])
        for what in ("running_var", "running_mean"):
            names = [n for (w, n, _), m in zip(buffers, maxabs) if w == what and not math.isfinite(m)]
            if names:
                total = sum(1 for w, _, _ in buffers if w == what)
                _nonfinite(probe, st, what, step=step, names=names[:NAMES_SHOWN], count=len(names), total=total)

    st.reader.read(param_parts + buffer_parts, check, where="params after step")


# ------------------------------------------------------------------------------------------------ hand reductions


def _grad_arg(op: str, args: tuple, kwargs: dict) -> Any:
    if op in ("all_reduce", "reduce"):
        return args[0] if args else kwargs.get("tensor")
    if op == "all_gather":
        return args[1] if len(args) > 1 else kwargs.get("tensor")
    if op == "all_gather_into_tensor":
        return args[1] if len(args) > 1 else kwargs.get("input_tensor")
    return None


def _make_register_comm_hook(st: _State, orig):
    """DDP.register_comm_hook registering the hook inside a marker: collectives the hook issues reduce DDP's
    bucket (with gradient_as_bucket_view=True the bucket *is* the gradients' memory): DDP's own reduction."""
    import functools

    def register_comm_hook(self: Any, state: Any, hook: Any, *args: Any, **kwargs: Any) -> Any:
        if not callable(hook):
            return orig(self, state, hook, *args, **kwargs)  # DDP raises its own error

        # functools.wraps: DDP reads the hook's signature (`bucket` annotation), __name__ and __qualname__
        @functools.wraps(hook)
        def comm_hook(hook_state: Any, bucket: Any) -> Any:
            st.comm_hooks += 1
            try:
                return hook(hook_state, bucket)
            finally:
                st.comm_hooks -= 1

        return orig(self, state, comm_hook, *args, **kwargs)

    return register_comm_hook


def _wrapper_codes(st: _State, owners: tuple[Any, ...], op: str) -> frozenset[Any]:
    """Code objects of the pass-through wrappers now installed around `op` (this recorder's, the process-group
    recorder's outside it, torch's own decorators): frames running them are not the caller. Followed through
    `__wrapped__` from the attributes user code looks up; recomputed only when those attributes change."""
    fns = tuple(getattr(owner, op, None) for owner in owners)
    key = tuple(id(f) for f in fns)
    cached = st.wrapper_codes.get(op)
    if cached is not None and cached[0] == key:
        return cached[1]
    codes = set()
    for fn in fns:
        seen = 0
        while fn is not None and seen < 16:
            code = getattr(fn, "__code__", None)
            if code is not None:
                codes.add(code)
            fn = getattr(fn, "__wrapped__", None)
            seen += 1
    result = frozenset(codes)
    st.wrapper_codes[op] = (key, result)
    return result


def _user_caller(st: _State, owners: tuple[Any, ...], op: str, frame: Any) -> dict[str, Any] | None:
    """{file, line, function} of the code that called the collective, if that is the user's code; None when
    ddpdoctor (the SyncBatchNorm emulation, a recorder), torch (DDP comm hooks, torch.distributed.nn) or another
    library called it. The direct caller decides, not the innermost user frame further out: SyncBN's backward
    all-reduce runs *under* the user's `loss.backward()`, but the user did not ask for it. `frame` is the
    caller of this recorder's wrapper."""
    codes = _wrapper_codes(st, owners, op)
    while frame is not None and frame.f_code in codes:
        frame = frame.f_back
    if frame is None or not is_user_file(frame.f_code.co_filename):
        return None
    return {"file": frame.f_code.co_filename, "line": frame.f_lineno, "function": frame.f_code.co_name}


def _byte_span(t: Any) -> tuple[int, int]:
    """[first, last+1) byte addresses a strided tensor can touch."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1)
    return (start, start + (extent + 1) * t.element_size())


def _build_grad_index(probe: Probe, st: _State) -> None:
    import torch

    index: dict[int, list[tuple[Any, str]]] = {}
    names = _param_names(probe, st)
    ddps = list(probe.registry.live_ddps())
    for rec in ddps:
        for p in rec.module.parameters():
            g = p.grad
            if id(p) in rec.registered_params and g is not None and g.layout == torch.strided:
                index.setdefault(g.untyped_storage().data_ptr(), []).append((p, names.get(id(p), "?")))
    if not ddps:
        # no DDP: a script that averages gradients itself (all_reduce over each p.grad) does so on the parameters
        # its optimizers hold; DD110 must see that as averaging
        for ref, _ in list(probe.registry.optimizers.values()):
            opt = ref()
            for gi, group in enumerate(getattr(opt, "param_groups", ()) or ()):
                for pi, p in enumerate(group.get("params", ())):
                    g = p.grad
                    if g is not None and g.layout == torch.strided:
                        entry = (p, names.get(id(p)) or f"param_groups[{gi}][{pi}]")
                        index.setdefault(g.untyped_storage().data_ptr(), []).append(entry)
    st.grad_index = index
    st.grad_index_generation = (st.backward_serial, probe.steps)


def _ddp_grads(probe: Probe, st: _State, tensor: Any) -> list[tuple[Any, str]]:
    """The DDP-registered parameters (without DDP: the optimizers' parameters) whose *current* `.grad` shares
    memory with `tensor` (the gradient itself, a view of it, or a flat buffer the gradients are views of), in
    parameter order; [] for any other tensor."""
    import torch

    if not torch.is_tensor(tensor) or tensor.layout != torch.strided or tensor.numel() == 0:
        return []
    if st.grad_index_generation != (st.backward_serial, probe.steps):
        _build_grad_index(probe, st)
    hits = _matching_grads(st, tensor)
    if not hits and st.depth:
        # inside a backward (a user hook reducing gradients as they are accumulated): gradients are being created
        # right now, after the index was built
        _build_grad_index(probe, st)
        hits = _matching_grads(st, tensor)
    return hits


def _matching_grads(st: _State, tensor: Any) -> list[tuple[Any, str]]:
    import torch

    storage = tensor.untyped_storage().data_ptr()
    candidates = st.grad_index.get(storage)
    if not candidates:
        return []
    lo, hi = _byte_span(tensor)
    hits = []
    for p, name in candidates:
        g = p.grad
        # The index only remembers addresses: a gradient freed since (zero_grad) is not there any more, and its
        # memory may now hold the tensor being reduced.
        if g is None or g.layout != torch.strided or g.untyped_storage().data_ptr() != storage:
            continue
        glo, ghi = _byte_span(g)
        if glo < hi and lo < ghi:
            hits.append((p, name))
    return hits


def _make_collective(probe: Probe, st: _State, owners: tuple[Any, ...], op: str, fn):
    def collective(*args: Any, **kwargs: Any) -> Any:
        # in_collective: torch.distributed.all_reduce and distributed_c10d.all_reduce may be different layers
        # (the CUDA emulation wraps one of them) that call each other; the outermost call is the user's.
        if probe.ending or st.in_collective or st.comm_hooks or not (probe.registry.ddps or probe.registry.optimizers):
            return fn(*args, **kwargs)
        st.in_collective = True
        try:
            site = probe.safely("grad collective", _user_caller, st, owners, op, sys._getframe(1))
            tensor = _grad_arg(op, args, kwargs) if site is not None else None
            hits = probe.safely("grad collective", _ddp_grads, probe, st, tensor) if tensor is not None else None
            if not hits:
                return fn(*args, **kwargs)
            before = probe.safely("grad collective norm", _norms_before, tensor, hits)
            result = fn(*args, **kwargs)
            if before is not None:
                probe.safely("grad collective", _record_hand, probe, st, op, tensor, hits, before, site, kwargs)
            return result
        finally:
            st.in_collective = False

    return collective


def _norms_before(tensor: Any, hits: list[tuple[Any, str]]) -> tuple[float, list[float]]:
    """Norm of the tensor passed, and of each matched parameter's whole gradient (what DDP produced)."""
    return (float(tensor.detach().float().norm()), [float(p.grad.detach().float().norm()) for p, _ in hits])


def _record_hand(probe: Probe, st: _State, op: str, tensor: Any, hits: list[tuple[Any, str]],
                 before: tuple[float, list[float]], site: dict[str, Any], kwargs: dict) -> None:
    tensor_before, grads_before = before
    is_async = bool(kwargs.get("async_op"))
    after_ddp = st.syncing > 0
    for (param, _), grad_before in zip(hits, grads_before):
        if id(param) not in st.hand:
            st.hand[id(param)] = {"op": op, "site": site, "before": grad_before, "numel": int(param.grad.numel()),
                                  "after_ddp": after_ddp}
    if st.grad_events >= GRAD_COLLECTIVE_EVENTS:
        return
    st.grad_events += 1
    after = None
    if not is_async and op in ("all_reduce", "reduce"):
        after = float(tensor.detach().float().norm())
    probe.emit(
        "grad_collective",
        op=op,
        site=site,
        param=hits[0][1],
        numel=int(tensor.numel()),
        step=probe.steps + 1,
        after_ddp=after_ddp,
        syncing_backwards=st.syncing,
        norm_before=_float(tensor_before),
        norm_after=_float(after) if after is not None else None,
        async_op=is_async,
    )
