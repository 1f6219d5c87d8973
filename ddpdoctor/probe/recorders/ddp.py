"""DDP recorder: every DistributedDataParallel construction (where, what it wraps, its options) and a flag that
tells the forward recorder when a forward runs inside DDP's own forward."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

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

    def make_forward(orig):
        def forward(self, *inputs: Any, **kwargs: Any) -> Any:
            probe.ddp_forward_depth += 1
            try:
                out = orig(self, *inputs, **kwargs)
            finally:
                probe.ddp_forward_depth -= 1
            if self.training and torch.is_grad_enabled():
                probe.counters["ddp_forwards"] += 1
            return out

        return forward

    probe.patcher.wrap(DDP, "__init__", make_init)
    probe.patcher.wrap(DDP, "forward", make_forward)


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
        **options,
    )


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
    if wrapper.training and torch.is_grad_enabled():
        probe.counters["ddp_forwards"] += 1
