"""Applied-statistics recorder: what each BatchNorm layer's output says about the statistics it normalised with
(DD211, DD212), for the first APPLIED_STEPS optimizer steps.

Training-mode batch norm is, per channel, an affine map y = a x + b with a = weight / sqrt(var + eps) and
b = bias - a mean, where (mean, var) are the statistics the layer applied. From the per-channel moments of its
input and output on each rank — means, variances and the covariance, in float64 — plus the layer's weight and bias
at that forward, the analysis recovers (mean, var) and compares them with the exact statistics of this rank's batch,
of the layer's process group and of the whole world (Chan's combination of the recorded per-rank moments). The
covariance also tells whether the output is affine in the input at all (a fused activation is not; then the
layer's statistics cannot be recovered and the check says so).

Cost: four float64 reductions over the input and output of the first two gradient-enabled training forwards of
each layer in each of the first APPLIED_STEPS steps, one blob per step.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "bn_applied"
APPLIED_STEPS = 2  # optimizer steps whose forwards are recorded (0 and 1: before the first and second step)
FORWARDS_PER_STEP = 2  # per layer and step


class _Record:
    __slots__ = (
        "affine",
        "count",
        "dtype",
        "eps",
        "group_ranks",
        "local_mode",
        "module",
        "momentum",
        "samples",
        "step",
        "sync_like",
        "synced",
        "vec",
    )

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


def install(probe: Probe) -> None:
    import torch
    from torch.nn.modules import module as module_mod
    from torch.nn.modules.batchnorm import _BatchNorm

    from ddpdoctor.probe.arms import local_stats_active, sync_like

    records: list[_Record] = []
    per_step: dict[tuple[int, int], int] = {}
    fallback_names: dict[int, str] = {}

    def hook(module: Any, args: Any, output: Any) -> None:
        if (probe.steps >= APPLIED_STEPS or probe.quiet or probe.ending or not isinstance(module, _BatchNorm)
                or not module.training or not torch.is_grad_enabled()):
            return
        key = (id(module), probe.steps)
        if per_step.get(key, 0) >= FORWARDS_PER_STEP:
            return
        per_step[key] = per_step.get(key, 0) + 1
        probe.safely("bn applied", _record, probe, records, module, args, output, torch, sync_like,
                     local_stats_active)
        return

    def on_step(optimizer: Any) -> None:
        if records:
            probe.safely("bn applied flush", _flush, probe, records, fallback_names, torch)
        if probe.steps >= APPLIED_STEPS:
            per_step.clear()

    handle = module_mod.register_module_forward_hook(hook)
    probe.patcher.add_undo(handle.remove)
    probe.step_hooks.append(on_step)
    probe.end_hooks.append(lambda: probe.safely("bn applied flush", _flush, probe, records, fallback_names, torch))


def io_moments(x: Any, y: Any) -> tuple[Any, Any, Any, Any, Any]:
    """Per-channel (input mean, input biased variance, output mean, output biased variance, covariance), float64."""
    dims = [0, *range(2, x.dim())]
    view = (1, -1, *([1] * (x.dim() - 2)))
    xd, yd = x.detach().double(), y.detach().double()
    mx, my = xd.mean(dims), yd.mean(dims)
    xc, yc = xd - mx.view(view), yd - my.view(view)
    return mx, (xc * xc).mean(dims), my, (yc * yc).mean(dims), (xc * yc).mean(dims)


def _group_of(module: Any, probe: Probe) -> tuple[bool | None, list[int] | None]:
    """(synchronises, global ranks of its process group) as the layer stands after its forward."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    if "process_group" not in module.__dict__ and not hasattr(type(module), "process_group"):
        return None, None
    group = getattr(module, "process_group", None) or dist.group.WORLD
    try:
        ranks = [int(r) for r in dist.get_process_group_ranks(group)]
    except Exception:
        return None, None
    return len(ranks) > 1, ranks


def _record(probe: Probe, records: list[_Record], module: Any, args: Any, output: Any, torch: Any,
            sync_like: Any, local_stats_active: Any) -> None:
    from ddpdoctor.probe.equivalence import first_tensor

    x = args[0] if args else None
    y = first_tensor(output)
    if not torch.is_tensor(x) or y is None or x.dim() < 2 or y.shape != x.shape or x.shape[1] == 0:
        return
    channels = x.shape[1]
    count = x.numel() // channels
    if count < 2:
        return
    with torch.no_grad():
        mx, vx, my, vy, cxy = io_moments(x, y)
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        w = weight.detach().double().reshape(-1) if weight is not None else torch.ones_like(mx)
        b = bias.detach().double().reshape(-1) if bias is not None else torch.zeros_like(mx)
        vec = torch.cat([mx, vx, my, vy, cxy, w, b])
    is_sync = sync_like(module)
    synced, ranks = _group_of(module, probe) if is_sync else (False, None)
    local = bool(local_stats_active() or probe.settings.bn_mode == "local")
    momentum = getattr(module, "momentum", None)
    records.append(_Record(
        module=module, step=probe.steps, samples=int(x.shape[0]), count=int(count), vec=vec,
        eps=float(module.eps), affine=weight is not None, momentum=None if momentum is None else float(momentum),
        sync_like=is_sync, synced=synced, group_ranks=ranks, local_mode=local,
        dtype=str(y.dtype).replace("torch.", ""),
    ))


def _flush(probe: Probe, records: list[_Record], fallback_names: dict[int, str], torch: Any) -> None:
    from ddpdoctor.probe.recorders.bn_conversion import layer_name

    recs, records[:] = list(records), []
    by_step: dict[int, list[_Record]] = {}
    for r in recs:
        by_step.setdefault(r.step, []).append(r)
    for step, items in sorted(by_step.items()):
        names = []
        for r in items:
            fallback = fallback_names.setdefault(id(r.module), f"{type(r.module).__name__}#{len(fallback_names)}")
            names.append(layer_name(probe, r.module, fallback))
        vec = torch.cat([r.vec for r in items]).cpu()
        ref = probe.blob(vec.numpy().tobytes(), dtype="float64", count=int(vec.numel()))
        probe.emit(
            "bn_applied",
            step=step,
            forwards={
                "name": names,
                "cls": [type(r.module).__name__ for r in items],
                "channels": [int(r.vec.numel() // 7) for r in items],
                "samples": [r.samples for r in items],
                "count": [r.count for r in items],
                "eps": [r.eps for r in items],
                "affine": [r.affine for r in items],
                "momentum": [r.momentum for r in items],
                "sync_like": [r.sync_like for r in items],
                "synced": [r.synced for r in items],
                "group_ranks": [r.group_ranks for r in items],
                "local_mode": [r.local_mode for r in items],
                "dtype": [r.dtype for r in items],
            },
            moments=ref,
        )
