"""The one poll loop of a launch (`watch`), used by a launch of its own (ddpdoctor.probe.launcher) and by each run
of a shared launch (ddpdoctor.probe.shared), and what it reads of the run directory while it waits: the stack dumps
at the timeout, the ranks' exit events.

Timeout: every instrumented process dumps its Python stacks into the run directory STACK_LEAD seconds before it
(faulthandler's timer: no signal, ddpdoctor.probe.session.StackTimer); at the timeout the loop waits up to
STACK_WAIT for the dumps to be complete, then the caller stops the whole run."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpdoctor.events import EVENTS_DIR
from ddpdoctor.live import Neighbours
from ddpdoctor.probe.supervisor import Stopped, hold_signals, trap_stop_signals
from ddpdoctor.records import LaunchEnd

STACK_LEAD = 1.0  # seconds before the timeout at which every process dumps its stacks
STACK_WAIT = 2.0  # how long, at the timeout, the launcher waits for the dumps to be complete
POLL = 0.05  # seconds between two looks at a running launch


def _started_processes(run_dir: Path) -> list[tuple[int, str]]:
    """(pid, stack file) of every instrumented process that arranged to dump its stacks before the timeout."""
    out = []
    for log in (run_dir / EVENTS_DIR).glob("*.jsonl"):
        try:
            with log.open("r", encoding="utf-8") as fh:
                first = json.loads(fh.readline() or "{}")
        except (OSError, ValueError):
            continue
        if first.get("kind") == "process_start" and first.get("stacks_at") and first.get("stack_file"):
            out.append((int(first["pid"]), first["stack_file"]))
    return out


def wait_for_stack_dumps(run_dir: Path, wait: float = STACK_WAIT) -> list[int]:
    """Every live instrumented process dumps its stacks STACK_LEAD seconds before the timeout (session.StackTimer):
    wait until their dumps are written (or `wait`). Returns the pids whose dump is there."""
    from ddpdoctor.probe.procs import is_alive

    live = [(pid, run_dir / EVENTS_DIR / f) for pid, f in _started_processes(run_dir) if is_alive(pid)]
    end = time.monotonic() + wait
    sizes: dict[Path, int] = {}
    while True:
        now = {f: (f.stat().st_size if f.exists() else 0) for _, f in live}
        if (all(v > 0 for v in now.values()) and now == sizes) or time.monotonic() >= end:
            break
        sizes = now
        time.sleep(0.1)
    return [pid for pid, f in live if f.exists() and f.stat().st_size > 0]


def dumped_stacks(run_dir: Path) -> list[int]:
    """The pids whose stack dump is in the run directory (the processes are gone already)."""
    out = []
    for pid, name in _started_processes(run_dir):
        try:
            if (run_dir / EVENTS_DIR / name).stat().st_size > 0:
                out.append(pid)
        except OSError:
            continue
    return out


@dataclass(frozen=True)
class Watched:
    """What `watch` saw of a launch: how it ended, and what the clean-up returned."""

    end: LaunchEnd
    timed_out: bool  # the timeout came (also when a signal during the clean-up then made the end INTERRUPTED)
    dumped: list[int]  # pids whose stacks were dumped at the timeout
    stopped: Any  # what `clean_up` returned


def watch(
    *,
    run_dir: Path,
    deadline: float,
    scratch: str,
    ended: Callable[[], LaunchEnd | None],
    clean_up: Callable[[LaunchEnd | None], Any],
    start: Callable[[], Any] | None = None,
    tick: Callable[[int], LaunchEnd | None] | None = None,
    progress: Any = None,
    neighbours: Neighbours | None = None,
) -> Watched:
    """The one poll loop of a launch, alone (`_launch_once`) or one run of a shared launch
    (ddpdoctor.probe.shared): `start` it, then every POLL seconds `ended()` says whether the run is over; else at
    the timeout every process's stacks are dumped (STACK_LEAD before it) and waited for, and the run ends
    TIMED_OUT; else `tick(polls)` may end it (RANKS_EXITED) or act (stop a failed rank's peers); the progress
    display is redrawn and, every tenth poll, the neighbouring runs looked at. Ctrl-C, SIGTERM and SIGHUP end it
    INTERRUPTED. Whatever ended it, `clean_up(end)` (None: an error escaped) stops what runs and `scratch` is
    removed, with Ctrl-C / SIGTERM / SIGHUP held meanwhile: one that came makes the end INTERRUPTED."""
    previous = trap_stop_signals()
    end: LaunchEnd | None = None
    timed_out = False
    dumped: list[int] = []
    try:
        if start is not None:
            start()
        polls = 0
        while (end := ended()) is None:
            if time.monotonic() >= deadline:
                end, timed_out = LaunchEnd.TIMED_OUT, True
                dumped = wait_for_stack_dumps(run_dir)
                break
            polls += 1
            if tick is not None and (end := tick(polls)) is not None:
                break
            if progress is not None:
                progress.update()
            if neighbours is not None and polls % 10 == 0:
                neighbours.look()
            time.sleep(POLL)
    except (KeyboardInterrupt, Stopped):
        end = LaunchEnd.INTERRUPTED
    finally:
        held = hold_signals(previous)  # a Ctrl-C or SIGTERM during the clean-up is kept for after it
        try:
            stopped = clean_up(end)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            held.release()
    if held:  # asked to stop while the run was being stopped: the command ends as interrupted
        end = LaunchEnd.INTERRUPTED
    assert end is not None
    return Watched(end=end, timed_out=timed_out, dumped=dumped, stopped=stopped)


def drop_empty_stacks(run_dir: Path) -> None:
    for stack in (run_dir / EVENTS_DIR).glob("*.stack"):
        if stack.stat().st_size == 0:  # nothing was dumped: no need to keep the placeholder
            stack.unlink()


def _last_event(log: Path) -> dict[str, Any] | None:
    try:
        with log.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 8192))
            lines = fh.read().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def ranks_exited(run_dir: Path, nproc: int) -> bool:
    """All `nproc` rank processes wrote their `exit` event and are no longer alive."""
    from ddpdoctor.probe.procs import is_alive

    exited = 0
    for log in (run_dir / EVENTS_DIR).glob("*.jsonl"):
        last = _last_event(log)
        if last is None:
            return False
        if last.get("kind") != "exit":
            if last.get("rank") is not None or last.get("kind") == "process_start":
                return False
            continue
        if is_alive(int(last["pid"])):
            return False
        exited += 1
    return exited >= nproc
