"""Instrumenting a process: the early recorders now, the CUDA emulation and the torch recorders as soon as the
script has imported torch. Used by the bootstrap (ranks, main process) and by sitecustomize (spawned children)."""

from __future__ import annotations

import os
from typing import Any

from ddpdoctor.errors import EMULATION_FAILED
from ddpdoctor.probe import arms, session
from ddpdoctor.probe.importhook import when_imported
from ddpdoctor.probe.recorders import EARLY_RECORDERS, TORCH_RECORDERS, install_recorders, snapshot_signatures
from ddpdoctor.probe.settings import ProbeSettings
from ddpdoctor.probe.standins import install_finder
from ddpdoctor.records import LaunchMode
from ddpdoctor.world import place_from_env


def instrument_process(settings: ProbeSettings, role: str) -> session.Probe:
    probe = session.start(settings, role)
    redirect_writes(probe)
    install_recorders(probe, EARLY_RECORDERS)
    arms.seed_process(probe)
    # `import horovod` / `import apex` find ddpdoctor's stand-ins when the real packages are not importable
    probe.safely("stand-in finder", install_finder)
    when_imported("torch", lambda: _torch_imported(probe))
    return probe


def redirect_writes(probe: session.Probe) -> None:
    """Launcher modes: the script's writes go under the run directory (ddpdoctor.probe.fsview)."""
    settings = probe.settings
    if settings.mode is LaunchMode.ATTACH:
        return
    from ddpdoctor.probe import fsview

    fsview.install(settings.run_dir, settings.scratch or None, lambda event: probe.emit("file_write", **event))


def resolve_device(settings: ProbeSettings) -> str:
    """cpu when asked for; cuda when asked for, or (auto) when this node has a GPU for every local rank, or (attach
    mode) whenever the launcher's node has one; cpu otherwise."""
    import torch

    if settings.device == "cpu":
        return "cpu"
    if settings.device == "cuda" or settings.mode is LaunchMode.ATTACH:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= _local_ranks(settings) else "cpu"


def _local_ranks(settings: ProbeSettings) -> int:
    """Ranks on this node: the launcher's local world size (torchrun's LOCAL_WORLD_SIZE, SLURM's tasks on this
    node), else the probe's --nproc (the main process of a self-spawning script has no launcher)."""
    return place_from_env(os.environ).local_world_size or settings.nproc


def emulates(settings: ProbeSettings, device: str) -> bool:
    """CUDA is emulated on CPU: `check` on a machine without enough GPUs, or attach mode with --device cpu (the
    user's own launcher, on CPU, rehearsing a GPU job). Attach mode on its own never emulates: it runs on what
    the launcher gives."""
    return device == "cpu" and (settings.mode is not LaunchMode.ATTACH or settings.device == "cpu")


def _drop_detail_debug() -> str | None:
    """`TORCH_DISTRIBUTED_DEBUG=DETAIL` makes every rank of a DDP script segfault on CPU torch (torch's bug, under
    a bare torchrun too: docs/facts.md#pytorchs-own-distributed-debug-modes). An emulated rank runs without it:
    torch read the variable when it imported torch.distributed, so the level is reset as well as the variable
    (DDP and init_process_group read either). Returns the value dropped (the report says so), None when unset."""
    value = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    if value is None or value.strip().upper() != "DETAIL":
        return None
    del os.environ["TORCH_DISTRIBUTED_DEBUG"]
    import torch.distributed as dist

    if dist.is_available():
        dist.set_debug_level_from_env()  # unset: OFF
    return value


def _notify(probe: session.Probe):
    def notify(what: Any = None, detail: Any = None, *args: Any, **kwargs: Any) -> None:
        probe.emit("emulation", what=str(what), detail=detail if isinstance(detail, dict) else {"value": detail})

    return notify


def _torch_imported(probe: session.Probe) -> None:
    try:
        _install_torch_side(probe)
    except Exception as exc:  # never break the script's `import torch`
        probe.internal_error("torch instrumentation", exc)


def _install_torch_side(probe: session.Probe) -> None:
    import time

    import torch

    t0 = time.perf_counter()
    settings = probe.settings
    snapshot_signatures(probe)
    device = resolve_device(settings)
    emulate = emulates(settings, device)
    emulated = False
    error = None
    if emulate:
        try:
            from ddpdoctor.probe import emulation  # written separately; optional until it lands
        except ImportError as exc:
            error = f"CUDA emulation unavailable: {exc}"
        else:
            try:
                if not emulation.emulation_active():
                    undo = emulation.install_cuda_emulation(_local_ranks(settings), notify=_notify(probe))
                    if callable(undo):
                        probe.patcher.add_undo(undo)
                emulated = bool(emulation.emulation_active())
            except Exception as exc:
                error = f"{EMULATION_FAILED}{type(exc).__name__}: {exc}"
                probe.internal_error("emulation", exc)
    debug_dropped = _drop_detail_debug() if emulate else None
    try:
        arms.install_early(probe)  # inside the recorders: they see the script's calls and the arm's results
        arms.seed_torch(probe)
    except Exception as exc:
        probe.internal_error("arm switches", exc)
    installed = install_recorders(probe, TORCH_RECORDERS)
    try:
        arms.install_late(probe)
    except Exception as exc:
        probe.internal_error("arm switches (outer)", exc)
    try:
        available, count = bool(torch.cuda.is_available()), int(torch.cuda.device_count())
    except Exception:
        available, count = False, 0
    probe.emit(
        "torch_ready",
        torch=torch.__version__,
        device=device,
        cuda_emulated=emulated,
        emulation_error=error,
        distributed_debug_dropped=debug_dropped,
        recorders=probe.recorders,
        installed_now=installed,
        cuda_available=available,
        device_count=count,
        install_seconds=round(time.perf_counter() - t0, 4),
    )
