"""Process recorder: children that train as ranks (torch.multiprocessing.spawn, multiprocessing.Process).

Records the exception a spawned rank function raised (mp.spawn catches it and only passes text to the parent),
and ends a child that finished its work the probe's way (done, wait for peers, os._exit) so gloo's teardown
cannot turn a finished rank into a crash. DataLoader workers and helper processes are left alone.
"""

from __future__ import annotations

import functools
import multiprocessing.process
from typing import Any

from ddpdoctor.probe import launch_check
from ddpdoctor.probe.patching import wrap_everywhere
from ddpdoctor.probe.session import Probe, is_user_file

NAME = "processes"


def _is_clean_exit(exc: SystemExit) -> bool:
    return exc.code is None or exc.code == 0


def install_process_run(probe: Probe) -> None:
    """multiprocessing.Process.run in the child (torch-free, installed at start)."""

    def make_run(orig):
        def run(self) -> None:  # noqa: ANN001
            target = getattr(self, "_target", None)
            name = getattr(target, "__qualname__", "") or ""
            module = getattr(target, "__module__", "") or ""
            if target is None or module.startswith("torch.utils.data") or name == "_wrap" or probe.role == "main":
                return orig(self)
            try:
                orig(self)
            except SystemExit as exc:
                if not _is_clean_exit(exc):
                    probe.record_exception(exc, "process")
                raise
            except BaseException as exc:
                probe.record_exception(exc, "process")
                raise
            if probe.rank is not None:  # the target trained as a rank: finish like one
                probe.end_run("process target returned")

        return run

    probe.patcher.wrap(multiprocessing.process.BaseProcess, "run", make_run)

    def make_start(orig):
        def start(self) -> None:  # noqa: ANN001
            if launch_check.deciding(probe):
                probe.safely("launch check", _process_started, probe, self)
            return orig(self)

        return start

    probe.patcher.wrap(multiprocessing.process.BaseProcess, "start", make_start)


def _process_started(probe: Probe, process: Any) -> None:
    """A process whose target (or run method) is the user's own code trains as a rank; DataLoader workers,
    managers and resource trackers run library code."""
    target = getattr(process, "_target", None) or getattr(type(process), "run", None)
    code = getattr(target, "__code__", None)
    if code is not None and is_user_file(code.co_filename):
        launch_check.ranks_started(probe, "multiprocessing.Process", probe.site())


def install(probe: Probe) -> None:
    """torch.multiprocessing.spawn's child entry point (needs torch)."""
    import sys

    import torch.multiprocessing.spawn  # noqa: F401 - the package attribute `spawn` is the function, not the module

    spawn_mod = sys.modules["torch.multiprocessing.spawn"]

    original = spawn_mod._wrap

    def _rank_function(fn: Any) -> Any:
        @functools.wraps(fn)
        def rank_function(i: int, *args: Any) -> Any:
            probe.safely(
                "spawn index", probe.emit, "spawned_function", index=i, function=getattr(fn, "__qualname__", None)
            )
            try:
                fn(i, *args)
            except KeyboardInterrupt:
                raise
            except SystemExit as exc:
                if _is_clean_exit(exc):
                    probe.end_run("spawned function returned")
                probe.record_exception(exc, "spawned function")
                raise
            except BaseException as exc:
                probe.record_exception(exc, "spawned function")
                raise
            probe.end_run("spawned function returned")

        return rank_function

    def _wrap(fn: Any, i: int, args: Any, error_file: Any) -> Any:
        return original(_rank_function(fn), i, args, error_file)

    functools.update_wrapper(_wrap, original)
    probe.patcher.setattr(spawn_mod, "_wrap", _wrap)

    def make_start_processes(orig):
        def start_processes(*args: Any, **kwargs: Any) -> Any:
            probe.safely("launch check", launch_check.ranks_started, probe, "torch.multiprocessing.spawn", probe.site())
            return orig(*args, **kwargs)

        return start_processes

    # the parent's side: torch.multiprocessing.spawn() calls its module's start_processes
    wrap_everywhere(probe, (spawn_mod, sys.modules["torch.multiprocessing"]), "start_processes", make_start_processes)
