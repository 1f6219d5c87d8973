"""The recorders, one module per concern, installed in this order (an explicit list, no discovery).

Each module exposes `NAME` and `install(probe)`. A recorder patches through `probe.patcher` (undone in
`finally`), writes events documented in `ddpdoctor/events.py`, and may subscribe to `probe.step_hooks`
(called after every optimizer step) and `probe.end_hooks` (called once before `done`).

A new recorder is a module here and a line in `TORCH_RECORDERS` (or `EARLY_RECORDERS`); its event kinds are
documented in `ddpdoctor.events.EVENT_KINDS` first, and it reuses `probe.registry` (DDP models, optimizers,
loaders) rather than patching the same API twice (CONTRIBUTING.md, "Adding an event kind").
"""

from __future__ import annotations

from typing import Callable

from ddpdoctor.probe.recorders import (
    batchnorm,
    bn_applied,
    bn_conversion,
    bn_triage,
    checkpoint,
    cli_args,
    data,
    data_parallel,
    dataset,
    ddp,
    forward,
    optim_health,
    optimizer,
    params,
    process_group,
    processes,
    rng,
    sync_bn,
)
from ddpdoctor.probe.session import Probe

# Installed when the process starts (no torch needed).
EARLY_RECORDERS: tuple[tuple[str, Callable[[Probe], None]], ...] = (
    (cli_args.NAME, cli_args.install),
    ("process_run", processes.install_process_run),
)

# Installed right after the script's `import torch` finished (after the CUDA emulation, so these are outermost).
TORCH_RECORDERS: tuple[tuple[str, Callable[[Probe], None]], ...] = (
    (optim_health.NAME, optim_health.install),  # before process_group: its collective wrappers sit inside theirs
    (process_group.NAME, process_group.install),
    (ddp.NAME, ddp.install),
    (data_parallel.NAME, data_parallel.install),
    (sync_bn.NAME, sync_bn.install),
    (optimizer.NAME, optimizer.install),
    (data.NAME, data.install),
    (forward.NAME, forward.install),
    (params.NAME, params.install),
    (batchnorm.NAME, batchnorm.install),
    (bn_conversion.NAME, bn_conversion.install),
    (bn_applied.NAME, bn_applied.install),
    (bn_triage.NAME, bn_triage.install),  # triage arms only
    (rng.NAME, rng.install),
    (dataset.NAME, dataset.install),
    (checkpoint.NAME, checkpoint.install),
    (processes.NAME, processes.install),
)


def snapshot_signatures(probe: Probe) -> None:
    """Signatures of the functions recorders bind arguments of, taken before the CUDA emulation wraps them
    (its wrappers take *args/**kwargs and deliberately hide the original)."""
    import inspect

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    for key, fn in (("init_process_group", getattr(dist, "init_process_group", None)), ("DDP.__init__", DDP.__init__)):
        if fn is None:
            continue
        try:
            probe.signatures[key] = inspect.signature(fn)
        except (TypeError, ValueError):
            pass


def install_recorders(probe: Probe, recorders: tuple[tuple[str, Callable[[Probe], None]], ...]) -> list[str]:
    """Install each recorder; one that fails to install is reported (internal_error) and skipped."""
    installed: list[str] = []
    for name, install in recorders:
        try:
            install(probe)
        except Exception as exc:
            probe.internal_error(f"install {name}", exc)
        else:
            installed.append(name)
    probe.recorders.extend(installed)
    return installed
