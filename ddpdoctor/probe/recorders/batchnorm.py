"""BatchNorm recorder: what every BatchNorm layer normalised over, on every rank, during the probe's steps.

Per layer (first seen at its first forward): its kind — plain `_BatchNorm`, SyncBatchNorm, or SyncBatchNorm run by
ddpdoctor's CPU emulation —, momentum, eps, its process group for SyncBN, where the script placed it, and its
running statistics before the first forward. Per forward: the mode (training with grad, training without grad,
eval), the normalisation batch (samples, and values per channel = samples x spatial positions), whether SyncBN
synchronised, and for every training-mode forward the per-channel mean and (biased) variance of the input. At the
end (or when recording stops), the running statistics each rank holds.

Cost: two float64-accumulating reductions on the detached input per training-mode BN forward (`channel_moments`),
kept on the tensor's device until the step is over (no host synchronisation inside the forward), one transfer per
step. Recording stops after `RECORD_STEPS` optimizer steps when the probe does not end the run itself (attach
mode); a layer called more than `FORWARDS_PER_STEP` times in training mode within one step keeps counting but stops
recording moments (the analyses then know that layer's replay is incomplete).

The statistics are what the analyses DD201–DD207 and the BN table need: the cross-rank comparison of running
statistics, the SyncBN replay (what SyncBN would have accumulated from the same per-rank moments), the non-i.i.d.
test on per-rank input means, and the noise of local and global batch statistics.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from ddpdoctor.probe.recorders.sync_bn import is_sync_batchnorm
from ddpdoctor.probe.session import Probe, is_user_file

NAME = "batchnorm"
RECORD_STEPS = 64  # steps recorded when the probe does not limit the run (attach mode)
FORWARDS_PER_STEP = 64  # training-mode forwards per layer and step whose moments are kept
MODES_CAP = 128  # characters of the per-step mode string kept per layer
NO_GRAD_SITES = 8  # first call sites of training-mode forwards without grad that get an event

# Mode letters of the per-step mode string: training with grad, training without grad (evaluation left in
# train mode), eval mode.
TRAIN, TRAIN_NO_GRAD, EVAL = "T", "t", "E"


class _Layer:
    """What the recorder knows about one BatchNorm module in this process."""

    __slots__ = (
        "index", "module", "root_ref", "cls", "kind", "num_features", "momentum", "eps", "affine", "track",
        "initial", "placed", "group_size", "group_ranks", "site", "announced", "name", "modes", "recorded",
        "dropped", "train_forwards", "no_grad_forwards", "eval_forwards", "would_raise",
    )

    def __init__(self, index: int, module: Any) -> None:
        self.index = index
        # A strong reference: a script that returns frees its model before the end-of-run snapshot, and a BN
        # layer alone (its own buffers and affine parameters) is small.
        self.module = module
        self.root_ref: Any = None
        self.cls = type(module).__name__
        self.kind = "plain"
        self.num_features = int(getattr(module, "num_features", 0) or 0)
        self.momentum = module.momentum if module.momentum is None else float(module.momentum)
        self.eps = float(module.eps)
        self.affine = bool(module.affine)
        self.track = bool(module.track_running_stats)
        self.initial: tuple[Any, Any, Any] | None = None  # running_mean, running_var, num_batches_tracked
        self.placed: str | None = None
        self.group_size: int | None = None
        self.group_ranks: list[int] | None = None
        self.site: dict[str, Any] | None = None
        self.announced = False
        self.name = ""
        self.modes: list[str] = []
        self.recorded = 0  # training forwards recorded in the current step
        self.dropped = 0  # training forwards of the whole run whose moments were not kept
        self.train_forwards = 0
        self.no_grad_forwards = 0
        self.eval_forwards = 0
        self.would_raise = False


class _Record:
    """One training-mode forward: its moments stay tensors (on the input's device) until the step is flushed."""

    __slots__ = ("layer", "step", "grad", "samples", "count", "synced", "mean", "var")

    def __init__(
        self, layer: int, step: int, grad: bool, samples: int, count: int, synced: bool, mean: Any, var: Any
    ) -> None:
        self.layer = layer
        self.step = step
        self.grad = grad
        self.samples = samples
        self.count = count
        self.synced = synced
        self.mean = mean
        self.var = var


class _State:
    def __init__(self) -> None:
        self.layers: dict[int, _Layer] = {}  # id(module) -> layer
        self.order: list[_Layer] = []
        self.records: list[_Record] = []
        self.active = True
        self.final_emitted = False
        self.roots: dict[int, tuple[Any, int]] = {}  # id(root module) -> (weakref, root number)
        self.no_grad_sites: dict[tuple[str, int], int] = {}  # call site -> model forwards
        # per outermost module (a model and its EMA/teacher copy are two): the layer whose no-grad forwards count
        # that model's forwards
        self.no_grad_first: dict[int, int] = {}
        # evaluation done right: model forwards with gradients off and BatchNorm in eval mode, per call site (what
        # clears a static DD207 suspicion there)
        self.eval_sites: dict[tuple[str, int], int] = {}
        self.eval_first: dict[int, int] = {}
        self.flushed_steps = 0
        self.names: set[str] = set()


def install(probe: Probe) -> None:
    import torch
    from torch.nn import SyncBatchNorm
    from torch.nn.modules import module as module_mod
    from torch.nn.modules.batchnorm import _BatchNorm

    from ddpdoctor.probe import readback

    state = _State()
    call_codes = {torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__}
    readback.for_probe(probe)  # now, not at the first step: it adds a step hook

    def pre_hook(module: Any, args: Any) -> None:
        if not isinstance(module, _BatchNorm) or not state.active or probe.ending or probe.quiet:
            return None
        probe.safely("batchnorm forward", _forward, probe, state, module, args, torch, SyncBatchNorm, call_codes)
        return None

    handle = module_mod.register_module_forward_pre_hook(pre_hook)
    probe.patcher.add_undo(handle.remove)

    def on_step(optimizer: Any) -> None:
        _flush(probe, state, torch)
        state.flushed_steps += 1
        # a limited probe ends the run itself after a few steps; otherwise stop recording after RECORD_STEPS
        if state.active and not probe.settings.limited and state.flushed_steps >= RECORD_STEPS:
            state.active = False
            _final(probe, state, torch, reason="recording stopped")

    def on_end() -> None:
        _flush(probe, state, torch)
        if not state.final_emitted:
            _final(probe, state, torch, reason="end of run")

    probe.step_hooks.append(on_step)
    probe.end_hooks.append(on_end)


# ----------------------------------------------------------------------------------------------- in the forward


def _forward(
    probe: Probe, state: _State, module: Any, args: Any, torch: Any, SyncBatchNorm: type, call_codes: set
) -> None:
    x = args[0] if args else None
    if not torch.is_tensor(x) or x.dim() < 2:
        return
    layer = state.layers.get(id(module))
    if layer is None or layer.module is not module:
        layer = _new_layer(probe, state, module, x, torch, SyncBatchNorm, call_codes)
    training = bool(module.training)
    grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    mode = (TRAIN if grad else TRAIN_NO_GRAD) if training else EVAL
    if len(layer.modes) < MODES_CAP:
        layer.modes.append(mode)
    if not training:
        layer.eval_forwards += 1
        if not grad:
            root = layer.root_ref() if layer.root_ref is not None else None
            if state.eval_first.setdefault(id(root) if root is not None else -1, layer.index) == layer.index:
                _note_eval(state, call_codes)
        return
    if grad:
        layer.train_forwards += 1
    else:
        layer.no_grad_forwards += 1
        root = layer.root_ref() if layer.root_ref is not None else None
        root_key = id(root) if root is not None else -1
        if state.no_grad_first.setdefault(root_key, layer.index) == layer.index:  # once per model forward
            _note_no_grad(probe, state, module, torch, call_codes)
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    samples = int(x.shape[0])
    synced = _syncs(layer, module) if is_sync_batchnorm(module) and not _local(probe) else False
    if layer.recorded >= FORWARDS_PER_STEP or count == 0:
        layer.dropped += 1
        return
    layer.recorded += 1
    mean, var = channel_moments(x, torch)
    state.records.append(_Record(layer.index, probe.steps, grad, samples, count, synced, mean, var))


def _local(probe: Probe) -> bool:
    """SyncBN layers normalise with per-rank statistics here (triage arm L, or an in-process check)."""
    if probe.settings.bn_mode == "local":
        return True
    try:
        from ddpdoctor.probe.arms import local_stats_active
    except Exception:
        return False
    return local_stats_active()


def channel_moments(x: Any, torch: Any) -> tuple[Any, Any]:
    """Per-channel mean and biased variance of a BN input, accumulated in float64, on the input's device.

    Two float64-accumulating means (the mean, then the mean squared deviation from its float32 rounding,
    corrected by the known rounding) instead of `var_mean` on a float64 copy: on CPU `var_mean` over
    (N, H, W) is several times slower (ResNet-18, 16 x 64 x 64 images, 20 BN layers: 25 ms per step against
    5.7 ms, the step itself ~135 ms) and the result agrees with exact float64 moments to 6e-8 relative, inputs
    offset by 1000 x their spread included. Half-precision inputs (autocast) are widened to float32 first."""
    xd = x.detach()
    if xd.dtype not in (torch.float32, torch.float64):
        xd = xd.float()
    dims = [0, *range(2, xd.dim())]
    mean = torch.mean(xd, dim=dims, dtype=torch.float64)
    shift = mean.to(xd.dtype)
    dev = xd - shift.view(1, -1, *([1] * (xd.dim() - 2)))
    var = torch.mean(dev * dev, dim=dims, dtype=torch.float64) - (mean - shift.double()) ** 2
    return mean, var


def _new_layer(
    probe: Probe, state: _State, module: Any, x: Any, torch: Any, SyncBatchNorm: type, call_codes: set
) -> _Layer:
    layer = _Layer(len(state.order), module)
    state.layers[id(module)] = layer
    state.order.append(layer)
    root, site, _direct = _outermost_call(call_codes)
    layer.site = site
    if root is not None:
        try:
            layer.root_ref = weakref.ref(root)
        except TypeError:
            layer.root_ref = None
    layer.num_features = int(x.shape[1])
    from torch.nn.parameter import is_lazy

    rm, rv, nbt = module.running_mean, module.running_var, module.num_batches_tracked
    if rm is not None and rv is not None and not is_lazy(rm) and not is_lazy(rv):
        # a lazy layer materialises its buffers after this hook (reset to 0 / 1): no snapshot then
        layer.initial = (
            rm.detach().double().clone(),
            rv.detach().double().clone(),
            None if nbt is None else nbt.detach().clone(),
        )
    if is_sync_batchnorm(module):
        emulated = False
        if x.device.type == "cpu":
            try:
                from ddpdoctor.probe import emulation

                emulated = emulation.emulation_active()
            except Exception:
                emulated = False
        layer.kind = "emulated_sync" if emulated else "sync"
    layer.placed = _placement(module, x)
    return layer


def _placement(module: Any, x: Any) -> str | None:
    """Where the script put the layer, as it would be on a GPU machine: "cuda:N" (a real or an emulated GPU),
    "cpu" (the script kept it on the CPU), None (unknown: emulation could not tell)."""
    if x.device.type != "cpu":
        return str(x.device)
    try:
        from ddpdoctor.probe import emulation
    except Exception:
        return "cpu"
    if not emulation.emulation_active():
        return "cpu"
    device = emulation.emulated_device(module)
    if device is None:
        device = emulation.emulated_device(x)
    return str(device) if device is not None else "cpu"


def _syncs(layer: _Layer, module: Any) -> bool:
    """Does this training-mode SyncBatchNorm forward synchronise (a process group exists and has > 1 rank)?"""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if layer.group_size is None:
        group = getattr(module, "process_group", None) or dist.group.WORLD
        layer.group_size = int(dist.get_world_size(group))
        try:
            layer.group_ranks = [int(r) for r in dist.get_process_group_ranks(group)]
        except Exception:
            layer.group_ranks = None
        # PyTorch's own SyncBatchNorm raises on a non-GPU input once a process group exists (whatever its size):
        # it would here if the script itself kept the layer on the CPU.
        from torch.nn import SyncBatchNorm as TorchSyncBatchNorm

        layer.would_raise = layer.placed == "cpu" and isinstance(module, TorchSyncBatchNorm)
    return layer.group_size > 1


def _outermost_call(call_codes: set) -> tuple[Any, dict[str, Any] | None, bool]:
    """The outermost module being called (the model or its DDP wrapper), the user line that called it, and
    whether that call came straight from user code (not through a library helper such as
    torch.optim.swa_utils.update_bn)."""
    f = sys._getframe(1)
    outer = None
    while f is not None:
        if f.f_code in call_codes:
            outer = f
        f = f.f_back
    if outer is None:
        return None, None, False
    root = outer.f_locals.get("self")
    f = outer.f_back
    direct = f is not None and is_user_file(f.f_code.co_filename)
    while f is not None:
        code = f.f_code
        if is_user_file(code.co_filename):
            return root, {"file": code.co_filename, "line": f.f_lineno, "function": code.co_name}, direct
        f = f.f_back
    return root, None, direct


def _note_eval(state: _State, call_codes: set) -> None:
    """A no-grad model forward with BatchNorm in eval mode, counted per user call site (first NO_GRAD_SITES)."""
    _, site, _ = _outermost_call(call_codes)
    if site is None:
        return
    key = (site["file"], site["line"])
    if key in state.eval_sites or len(state.eval_sites) < NO_GRAD_SITES:
        state.eval_sites[key] = state.eval_sites.get(key, 0) + 1


def _note_no_grad(probe: Probe, state: _State, module: Any, torch: Any, call_codes: set) -> None:
    """A training-mode BN forward with gradients disabled (evaluation under no_grad without model.eval()):
    forwards counted per call site; one event for each of the first NO_GRAD_SITES sites."""
    root, site, direct = _outermost_call(call_codes)
    key = ((site or {}).get("file", ""), (site or {}).get("line", 0))
    n = state.no_grad_sites.get(key)
    if n is not None:
        state.no_grad_sites[key] = n + 1
        return
    if len(state.no_grad_sites) >= NO_GRAD_SITES:
        return
    state.no_grad_sites[key] = 1
    bn_layers = 0
    syncbn = 0
    if root is not None and hasattr(root, "modules"):
        from torch.nn import SyncBatchNorm
        from torch.nn.modules.batchnorm import _BatchNorm

        for m in root.modules():
            if isinstance(m, _BatchNorm) and m.training:
                bn_layers += 1
                syncbn += is_sync_batchnorm(m)
    probe.emit(
        "bn_train_no_grad",
        site=site,
        step=probe.steps,
        inference_mode=bool(torch.is_inference_mode_enabled()),
        direct=direct,
        root_class=type(root).__name__ if root is not None else None,
        bn_layers_in_train_mode=bn_layers,
        syncbn_layers_in_train_mode=syncbn,
        tracks_running_stats=bool(module.track_running_stats),
        untrained_module=probe.safely("untrained module", _untrained_module, probe, call_codes),
        # momentum None = a cumulative average over the batches since the statistics were reset: what a precise-BN
        # recalibration sets up (recompute the running statistics over many batches), not an evaluation
        cumulative_average=module.momentum is None,
    )


def _trained_params(probe: Probe) -> set[int]:
    """ids of the parameters some optimizer of this process trains (holds, with requires_grad)."""
    out: set[int] = set()
    for ref, _ in list(probe.registry.optimizers.values()):
        opt = ref()
        for group in getattr(opt, "param_groups", ()) or ():
            out.update(id(p) for p in group.get("params", ()) if getattr(p, "requires_grad", False))
    return out


def _untrained_module(probe: Probe, call_codes: set) -> dict[str, Any] | None:
    """The outermost module being called whose parameters no optimizer trains (none held with requires_grad): a
    momentum / EMA / teacher encoder (MoCo's key encoder, BYOL's target, DINO's teacher), forwarded without
    gradients on purpose. None when every module on the call stack is trained (an evaluation forward), or when
    no optimizer exists yet (nothing to tell)."""
    trained = _trained_params(probe)
    if not trained:
        return None
    chain = []
    f = sys._getframe(1)
    while f is not None:
        if f.f_code in call_codes:
            chain.append(f.f_locals.get("self"))
        f = f.f_back
    names: dict[int, str] = {}
    outer = chain[-1] if chain else None
    if outer is not None and hasattr(outer, "named_modules"):
        names = {id(m): n for n, m in outer.named_modules()}
    for m in reversed(chain):  # outermost first
        params = list(m.parameters()) if hasattr(m, "parameters") else []
        if params and not any(id(p) in trained for p in params):
            return {"cls": type(m).__name__, "path": names.get(id(m), ""), "params": len(params),
                    "requires_grad": sum(1 for p in params if p.requires_grad)}
    return None


# ----------------------------------------------------------------------------------------------- after the step


def _resolve_name(probe: Probe, state: _State, layer: _Layer) -> str:
    """The layer's qualified name in the user's model: its path inside the (first) DDP-wrapped module, else
    inside the outermost module it was called through; a second model gets its class as a prefix."""
    module = layer.module
    owner = probe.registry.owner_of(module)
    if owner is not None:
        pid, path = owner
        first = next((rec.pid for rec in probe.registry.ddps), pid)
        base = path or layer.cls
        return base if pid == first else f"ddp{pid}:{base}"
    root = layer.root_ref() if layer.root_ref is not None else None
    if root is not None and hasattr(root, "named_modules"):
        from torch.nn.parallel import DistributedDataParallel

        inner = root.module if isinstance(root, DistributedDataParallel) else root
        for path, m in inner.named_modules():
            if m is module:
                entry = state.roots.get(id(inner))
                if entry is None or entry[0]() is not inner:
                    entry = (weakref.ref(inner), len(state.roots))
                    state.roots[id(inner)] = entry
                base = path or layer.cls
                return base if entry[1] == 0 else f"{type(inner).__name__}:{base}"
    return f"{layer.cls}#{layer.index}"


def _announce(probe: Probe, state: _State, layer: _Layer, torch: Any) -> None:
    name = _resolve_name(probe, state, layer)
    if name in state.names:  # a third model of the same class: keep names unique within the process
        name = f"{name}#{layer.index}"
    state.names.add(name)
    layer.name = name
    initial_ref = None
    nbt0 = None
    if layer.initial is not None:
        rm, rv, nbt = layer.initial
        if rm is not None and rv is not None:
            vec = torch.cat([rm, rv]).cpu()
            initial_ref = probe.blob(vec.numpy().tobytes(), dtype="float64", count=int(vec.numel()))
        nbt0 = int(nbt.item()) if nbt is not None else None
        layer.initial = None
    probe.emit(
        "bn_layer",
        layer=layer.index,
        name=layer.name,
        cls=layer.cls,
        bn_kind=layer.kind,
        num_features=layer.num_features,
        momentum=layer.momentum,
        eps=layer.eps,
        affine=layer.affine,
        track_running_stats=layer.track,
        placed=layer.placed,
        group_size=layer.group_size,
        group_ranks=layer.group_ranks,
        would_raise=layer.would_raise,
        site=layer.site,
        initial=initial_ref,
        initial_batches_tracked=nbt0,
    )
    layer.announced = True


def _flush(probe: Probe, state: _State, torch: Any) -> None:
    """Write the forwards since the last step: one `bn_step` event per step number, moments in one blob."""
    records, state.records = state.records, []
    touched = [layer for layer in state.order if layer.modes or layer.recorded]
    if not records and not touched:
        return
    for layer in state.order:
        if not layer.announced:
            _announce(probe, state, layer, torch)
    by_step: dict[int, list[_Record]] = {}
    for rec in records:
        by_step.setdefault(rec.step, []).append(rec)
    if not by_step:
        by_step[probe.steps] = []
    last = max(by_step)
    from ddpdoctor.probe import readback

    reader = readback.for_probe(probe)
    for step in sorted(by_step):
        recs = by_step[step]
        fields: dict[str, Any] = {
            "step": step,
            "forwards": {
                "layer": [r.layer for r in recs],
                "grad": [r.grad for r in recs],
                "samples": [r.samples for r in recs],
                "count": [r.count for r in recs],
                "synced": [r.synced for r in recs],
                "channels": [int(r.mean.numel()) for r in recs],
            },
            "moments": None,
        }
        if step == last:  # per-layer counters since the previous flush go with the latest step
            fields["modes"] = {str(layer.index): "".join(layer.modes) for layer in touched if layer.modes}
            fields["dropped"] = {str(layer.index): layer.dropped for layer in state.order if layer.dropped}
        if not recs:
            probe.emit("bn_step", **fields)
            continue

        def emit(host: list[Any], fields: dict[str, Any] = fields) -> None:
            vec = host[0]
            fields["moments"] = probe.blob(vec.numpy().tobytes(), dtype="float64", count=int(vec.numel()))
            probe.emit("bn_step", **fields)

        # the moments stay on the input's device until read back without a synchronisation (readback)
        with torch.no_grad():
            moments = torch.cat([t for r in recs for t in (r.mean, r.var)])
        reader.read([moments], emit, where="bn_step moments")
    for layer in state.order:
        layer.modes = []
        layer.recorded = 0


def _final(probe: Probe, state: _State, torch: Any, reason: str) -> None:
    """The running statistics every layer holds now (what evaluation and the checkpoint use)."""
    state.final_emitted = True
    if not state.order:
        return
    layers: list[dict[str, Any]] = []
    parts = []
    with torch.no_grad():
        for layer in state.order:
            module = layer.module
            entry: dict[str, Any] = {"layer": layer.index, "name": layer.name or f"{layer.cls}#{layer.index}"}
            if module.running_mean is None or module.running_var is None:
                entry["channels"] = 0
                layers.append(entry)
                continue
            rm = module.running_mean.detach().double().reshape(-1)
            rv = module.running_var.detach().double().reshape(-1)
            parts.extend([rm, rv])
            nbt = module.num_batches_tracked
            entry.update(
                channels=int(rm.numel()),
                batches_tracked=int(nbt.item()) if nbt is not None else None,
                momentum=module.momentum if module.momentum is None else float(module.momentum),
                training=bool(module.training),
                dropped=layer.dropped,
                train_forwards=layer.train_forwards,
                no_grad_forwards=layer.no_grad_forwards,
                eval_forwards=layer.eval_forwards,
            )
            layers.append(entry)
        ref = None
        if parts:
            vec = torch.cat(parts).cpu()
            ref = probe.blob(vec.numpy().tobytes(), dtype="float64", count=int(vec.numel()))
    no_grad = [{"file": f, "line": line, "forwards": n} for (f, line), n in state.no_grad_sites.items()]
    evals = [{"file": f, "line": line, "forwards": n} for (f, line), n in state.eval_sites.items()]
    probe.emit("bn_final", step=probe.steps, reason=reason, layers=layers, stats=ref, no_grad_sites=no_grad,
               eval_no_grad_sites=evals)
