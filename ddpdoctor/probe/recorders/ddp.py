"""DDP recorder: every DistributedDataParallel construction (where, what it wraps, its options) and a flag that
tells the forward recorder when a forward runs inside DDP's own forward."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

from ddpdoctor.probe.recorders import process_group
from ddpdoctor.probe.session import Probe

NAME = "ddp"


def norm_layer_kinds(module: Any) -> dict[str, int]:
    """{class name: count} of the normalisation layers inside `module` (BatchNorm*, SyncBatchNorm, GroupNorm...)."""
    from torch.nn.modules.batchnorm import _NormBase

    out: dict[str, int] = {}
    for m in module.modules():
        if isinstance(m, _NormBase):
            name = type(m).__name__
            out[name] = out.get(name, 0) + 1
    return out


def install(probe: Probe) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpdoctor.probe import readback

    readback.for_probe(probe)  # now, not in a forward: it adds a step hook (the input digests read back through it)

    signature = probe.signatures.get("DDP.__init__")
    if signature is None:
        try:
            signature = inspect.signature(DDP.__init__)
        except (TypeError, ValueError):
            signature = None

    def make_init(orig):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            site = probe.site()
            options = probe.safely("ddp arguments", _options, signature, self, args, kwargs) or {}
            try:
                orig(self, *args, **kwargs)
            except BaseException as exc:
                probe.emit("ddp_init", ok=False, site=site, error=f"{type(exc).__name__}: {exc}"[:2000], **options)
                raise
            probe.safely("ddp_init", _constructed, probe, self, site, options)

        return __init__

    inputs_seen: set[int] = set()
    digests: dict[int, int] = {}

    def make_forward(orig):
        def forward(self, *inputs: Any, **kwargs: Any) -> Any:
            if id(self) not in inputs_seen and in_training(self) and not probe.ending:
                inputs_seen.add(id(self))
                probe.safely("ddp_inputs", _inputs, probe, self, inputs, kwargs)
            if (self.training and torch.is_grad_enabled() and not probe.ending and not probe.quiet
                    and digests.get(id(self), 0) < INPUT_DIGESTS):
                digests[id(self)] = digests.get(id(self), 0) + 1
                probe.safely("ddp_input_digest", _input_digest, probe, self, inputs, kwargs, digests[id(self)])
            if not probe.ending and not probe.quiet and probe.safely("ddp buffer sync", _syncs_buffers, self):
                probe.safely("ddp buffer sync", process_group.record_implicit, probe, "broadcast", probe.site(),
                             "ddp_buffers")
            probe.ddp_forward_depth += 1
            try:
                out = orig(self, *inputs, **kwargs)
            finally:
                probe.ddp_forward_depth -= 1
            if in_training(self) and torch.is_grad_enabled() and trains(self.module):
                probe.counters["ddp_forwards"] += 1
            return out

        return forward

    probe.patcher.wrap(DDP, "__init__", make_init)
    probe.patcher.wrap(DDP, "forward", make_forward)
    _install_sharded(probe)


def _install_sharded(probe: Probe) -> None:
    """FSDP (the wrapper class) and FSDP2 (`fully_shard`) keep the ranks' models consistent without DDP: a
    `sharded_init` event per construction, so no analysis reads "no DDP" as "each rank trains alone". Patched
    when the script imports torch.distributed.fsdp, never imported by the probe itself."""
    from ddpdoctor.probe.importhook import when_imported

    def patch() -> None:
        from torch.distributed import fsdp

        def make_init(orig):
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                site = probe.site()
                orig(self, *args, **kwargs)
                probe.safely("sharded_init", probe.emit, "sharded_init", wrapper="FullyShardedDataParallel", site=site)

            return __init__

        state = {"depth": 0, "digests": {}}

        def make_fully_shard(orig):
            def fully_shard(*args: Any, **kwargs: Any) -> Any:
                site = probe.site()
                out = orig(*args, **kwargs)
                probe.safely("sharded_init", probe.emit, "sharded_init", wrapper="fully_shard", site=site)
                probe.safely("sharded inputs", _digest_sharded_inputs, probe, state, out)
                return out

            return fully_shard

        cls = getattr(fsdp, "FullyShardedDataParallel", None)
        if cls is not None:
            probe.patcher.wrap(cls, "__init__", make_init)
        if callable(getattr(fsdp, "fully_shard", None)):
            probe.patcher.wrap(fsdp, "fully_shard", make_fully_shard)

    when_imported("torch.distributed.fsdp", lambda: probe.safely("fsdp patches", patch))


def _text(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_text(v) for v in value]
    return str(value)


def _options(signature: inspect.Signature | None, self: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    if signature is None:
        return {}
    bound = signature.bind(self, *args, **kwargs)
    a = bound.arguments
    module = a.get("module")
    out: dict[str, Any] = {
        "module_class": type(module).__name__ if module is not None else None,
        "broadcast_buffers": a.get("broadcast_buffers", True) if a.get("broadcast_buffers", True) is not None else True,
        "device_ids": _text(a.get("device_ids")),
        "output_device": _text(a.get("output_device")),
        "find_unused_parameters": bool(a.get("find_unused_parameters", False)),
        "static_graph": bool(a.get("static_graph", False)),
        "mixed_precision": a.get("mixed_precision") is not None,
    }
    if module is not None and hasattr(module, "modules"):
        out["norm_layers"] = norm_layer_kinds(module)
    return out


def placement(obj: Any) -> str | None:
    """Where the script put a tensor or module, as it would be on a GPU machine: "cuda:N" (a real or an emulated
    GPU: `.cuda()` without an index means the device current at that moment), "cpu", or None (nothing to tell)."""
    import torch

    if isinstance(obj, torch.nn.Module):
        first = next(iter(obj.parameters()), None)
        if first is None:
            first = next(iter(obj.buffers()), None)
        target: Any = first
    else:
        target = obj
    if not torch.is_tensor(target):
        return None
    if target.device.type != "cpu":
        return node_device(target.device)
    try:
        from ddpdoctor.probe import emulation
    except Exception:  # noqa: BLE001 - no emulation: the CPU is where it is
        return "cpu"
    device = emulation.emulated_device(target) if emulation.emulation_active() else None
    return node_device(device) if device is not None else "cpu"


def node_device(device: Any) -> str:
    """A CUDA device as the node numbers its GPUs: cuda:i of a process whose CUDA_VISIBLE_DEVICES lists GPUs is the
    i-th of them (a worker that sets CUDA_VISIBLE_DEVICES to its own GPU and uses cuda:0 is on that GPU, not on
    the node's GPU 0). Other devices as torch names them."""
    import os

    text = str(device)
    if getattr(device, "type", None) != "cuda" or device.index is None:
        return text
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible or not 0 <= device.index < len(visible):
        return text
    return f"cuda:{visible[device.index]}"


def _digest_sharded_inputs(probe: Probe, state: dict[str, Any], modules: Any) -> None:
    """The inputs of an FSDP2 model's first training forwards digested as DDP's are (`ddp_input_digest`): the
    outermost `fully_shard` module's call only (nested ones run inside it), so the ranks' batches can be compared
    whatever feeds them (a loader, indices drawn in the loop)."""
    import torch

    for module in modules if isinstance(modules, (list, tuple)) else [modules]:
        if not isinstance(module, torch.nn.Module):
            continue

        def pre(mod: Any, args: Any, kwargs: Any) -> None:
            state["depth"] += 1
            n = state["digests"].get(id(mod), 0)
            if (state["depth"] == 1 and mod.training and torch.is_grad_enabled() and not probe.ending
                    and not probe.quiet and n < INPUT_DIGESTS):
                state["digests"][id(mod)] = n + 1
                probe.safely("ddp_input_digest", _input_digest, probe, mod, args, kwargs or {}, n + 1,
                             wrapper="fully_shard")

        def post(mod: Any, args: Any, kwargs: Any, out: Any) -> None:
            state["depth"] = max(0, state["depth"] - 1)

        h1 = module.register_forward_pre_hook(pre, with_kwargs=True)
        h2 = module.register_forward_hook(post, with_kwargs=True, always_call=True)
        probe.patcher.add_undo(h1.remove)
        probe.patcher.add_undo(h2.remove)


def _first_tensor(value: Any, depth: int = 0) -> Any:
    import torch

    if torch.is_tensor(value):
        return value
    if depth < 3:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        for v in items:
            t = _first_tensor(v, depth + 1)
            if t is not None:
                return t
    return None


INPUT_DIGESTS = 4  # training forwards per DDP whose input is digested (a fixed batch reused every step: DD203)
DIGEST_VALUES = 4096  # values of the input sampled (evenly strided) into the digest
ROW_DIGESTS = 64  # samples of each digested input digested one by one (does one recur in another forward?)


def _input_digest(probe: Probe, ddp: Any, inputs: tuple, kwargs: dict, n: int, wrapper: str = "ddp") -> None:
    """A digest of the first input tensor of the n-th training forward: equal digests at every step mean the model
    is fed one fixed batch (a synthetic benchmark), not batches drawn from data. The values sampled are gathered
    on the input's device and read back without a host synchronisation (ddpdoctor.probe.readback)."""
    tensor = _first_tensor(list(inputs) + list(kwargs.values()))
    if tensor is None:
        return
    from ddpdoctor.probe.readback import for_probe

    t = tensor.detach()
    flat = t.reshape(-1)
    sampled = [flat[:: max(1, flat.numel() // DIGEST_VALUES)].float()]
    if t.dim() >= 1:  # each of the first ROW_DIGESTS samples, its values strided as the whole input's are
        per_row = int(flat.numel() // t.shape[0]) if t.shape[0] else 0
        rows = t[:ROW_DIGESTS].reshape(min(ROW_DIGESTS, t.shape[0]), per_row)
        sampled.append(rows[:, :: max(1, per_row // DIGEST_VALUES)].float())
    shape, step = (tuple(tensor.shape), str(tensor.dtype)), probe.steps

    def then(host: list[Any]) -> None:
        import hashlib

        h = hashlib.blake2b(digest_size=12)
        h.update(str(shape).encode())
        h.update(host[0].contiguous().numpy().tobytes())
        rows = [hashlib.blake2b(row.contiguous().numpy().tobytes(), digest_size=6).hexdigest()
                for row in (host[1] if len(host) > 1 else ())]
        probe.emit("ddp_input_digest", ddp=probe.registry.id_of(ddp), n=n, step=step, digest=h.hexdigest(),
                   rows=rows, **({"wrapper": wrapper} if wrapper != "ddp" else {}))

    for_probe(probe).read(sampled, then, where="ddp_input_digest")


def _inputs(probe: Probe, ddp: Any, inputs: tuple, kwargs: dict) -> None:
    """The device of the first training forward's input, once per DDP (DD105: do the ranks feed one GPU?)."""
    tensor = _first_tensor(list(inputs) + list(kwargs.values()))
    probe.emit("ddp_inputs", ddp=probe.registry.id_of(ddp), device=placement(tensor) if tensor is not None else None,
               params_device=placement(ddp.module), site=probe.site())


def _constructed(
    probe: Probe, ddp: Any, site: Any, options: dict[str, Any], registered: set[int] | None = None
) -> None:
    params = list(ddp.module.parameters())
    if registered is None:
        registered = {id(p) for p in getattr(ddp, "_module_parameters", params)}
    rec = probe.registry.add_ddp(ddp, registered, bool(options.get("mixed_precision")))
    try:
        world = ddp.process_group.size()
    except Exception:
        world = _world_size()
    probe.emit(
        "ddp_init",
        ok=True,
        ddp=rec.pid,
        site=site,
        params=len(params),
        numel=int(sum(p.numel() for p in params)),
        world_size=world,
        params_device=placement(ddp.module),
        current_device=_current_device(),
        **options,
    )


def _current_device() -> int | None:
    """torch.cuda.current_device() (emulated or real) when CUDA is in play, else None."""
    import torch

    try:
        return int(torch.cuda.current_device()) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken CUDA setup is not this recorder's finding
        return None


def _world_size() -> int | None:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def record_wrapper(probe: Probe, wrapper: Any, site: Any, options: dict[str, Any]) -> None:
    """A data-parallel wrapper other than torch's DDP (apex's DistributedDataParallel, real or stand-in): recorded
    and registered like DDP — a `ddp_init` event whose `wrapper` field names it, the modules it owns, the
    parameters whose gradients it averages — so the analyses of DDP models apply to it."""
    opts = dict(options)
    opts.setdefault("norm_layers", norm_layer_kinds(wrapper.module))
    registered = {id(p) for p in wrapper.module.parameters() if p.requires_grad}
    _constructed(probe, wrapper, site, opts, registered)


@contextlib.contextmanager
def wrapper_forward(probe: Probe, wrapper: Any) -> Iterator[None]:
    """The forward of such a wrapper: what runs inside is not a bypass, and a training forward counts."""
    import torch

    probe.ddp_forward_depth += 1
    try:
        yield
    finally:
        probe.ddp_forward_depth -= 1
    if wrapper.training and torch.is_grad_enabled() and trains(wrapper):
        probe.counters["ddp_forwards"] += 1


def _syncs_buffers(ddp: Any) -> bool:
    """Whether this DDP forward starts with DDP's broadcast of rank 0's buffers (torch's own test: buffers to
    sync, broadcast_buffers on, and the previous forward one that armed the gradient sync; a collective every rank
    must join, although the script calls none)."""
    check = getattr(ddp, "_check_sync_bufs_pre_fwd", None)
    return bool(check()) if callable(check) else False


def in_training(ddp: Any) -> bool:
    """Whether a DDP forward is a training forward: the mode of the module it wraps, which is what its layers run
    in. The wrapper's own flag can lag: Lightning's validation loop calls `trainer.model.eval()` on the wrapper and
    restores only the LightningModule's mode afterwards, so the wrapper stays `training=False` while it trains."""
    return bool(getattr(getattr(ddp, "module", ddp), "training", False))


def trains(module: Any) -> bool:
    """A training forward is one of a model with parameters that learn: DINO's teacher is a DDP model in training
    mode, forwarded with autograd on, but its parameters stop requiring grad after the wrap (an EMA of the
    student): counting its forward made every step look like 2-step gradient accumulation (DD215). Stops at the
    first trainable parameter."""
    return any(p.requires_grad for p in module.parameters())
