"""DataParallel recorder: every nn.DataParallel (where, on which devices, what it wraps) and its first forwards
(how the batch was split: replicas and chunk sizes), so DD106 can say what DataParallel did to BatchNorm in this run
— or that it never split anything (one device, no GPU).

The chunks are computed the way DataParallel's scatter splits a tensor (Tensor.chunk over the devices along `dim`),
from the first tensor argument; the BatchNorm recorder sees each replica's forward on its own (replica 0 is the
wrapped module itself).
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "data_parallel"
FORWARDS_RECORDED = 8  # data_parallel_forward events per wrapper (training forwards with grad first)


def _first_tensor(obj: Any, torch: Any) -> Any:
    if torch.is_tensor(obj):
        return obj
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _first_tensor(item, torch)
            if found is not None:
                return found
    if isinstance(obj, dict):
        for item in obj.values():
            found = _first_tensor(item, torch)
            if found is not None:
                return found
    return None


def install(probe: Probe) -> None:
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    counts: dict[int, int] = {}

    def make_init(orig):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            site = probe.site()
            orig(self, *args, **kwargs)
            probe.safely("data_parallel_init", _constructed, probe, self, site, _BatchNorm)

        return __init__

    def make_forward(orig):
        def forward(self, *inputs: Any, **kwargs: Any) -> Any:
            pid = probe.registry.id_of(self)
            n = counts.get(pid, 0)
            if n < FORWARDS_RECORDED and not probe.ending:
                counts[pid] = n + 1
                probe.safely("data_parallel_forward", _forward, probe, self, pid, inputs, kwargs, torch)
            return orig(self, *inputs, **kwargs)

        return forward

    probe.patcher.wrap(torch.nn.DataParallel, "__init__", make_init)
    probe.patcher.wrap(torch.nn.DataParallel, "forward", make_forward)


def _constructed(probe: Probe, dp: Any, site: Any, BatchNorm: type) -> None:
    module = dp.module
    probe.emit(
        "data_parallel_init",
        dp=probe.registry.id_of(dp),
        site=site,
        module_class=type(module).__name__,
        device_ids=[int(d) for d in dp.device_ids],
        output_device=None if not dp.device_ids else int(dp.output_device),
        dim=int(getattr(dp, "dim", 0)),
        bn_layers=sum(1 for m in module.modules() if isinstance(m, BatchNorm)),
    )


def _forward(probe: Probe, dp: Any, pid: int, inputs: tuple, kwargs: dict, torch: Any) -> None:
    x = _first_tensor(inputs, torch)
    if x is None:
        x = _first_tensor(kwargs, torch)
    devices = len(dp.device_ids)
    dim = int(getattr(dp, "dim", 0))
    batch = int(x.shape[dim]) if x is not None and x.dim() > dim else None
    chunks = [int(c.shape[dim]) for c in x.chunk(devices, dim)] if x is not None and devices > 1 and x.numel() else []
    probe.emit(
        "data_parallel_forward",
        dp=pid,
        step=probe.steps,
        training=bool(dp.training),
        grad=bool(torch.is_grad_enabled()),
        batch=batch,
        replicas=len(chunks) if chunks else 1,
        chunk_sizes=chunks or ([batch] if batch is not None else []),
        site=probe.site(),
    )
