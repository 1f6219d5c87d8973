"""Finding and stopping every process of a probe run, whatever became of the process tree.

torch.distributed.run starts each worker in a new session, DataLoader workers and mp.spawn children hang below
them, and an orphan is re-parented away from us. Every process of a run inherits DDPDOCTOR_RUN_TAG in its
environment; on Linux /proc tells us which processes carry it. Elsewhere the parent/child links from `ps` are
used.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddpdoctor.probe.settings import RUN_TAG_ENV

_PROC = Path("/proc")


def _proc_table() -> dict[int, int]:
    """pid → ppid for every visible process."""
    table: dict[int, int] = {}
    if _PROC.is_dir():
        for entry in _PROC.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # the command name may contain spaces and parentheses: fields start after the last ')'
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) > 2:
                table[int(entry.name)] = int(fields[1])
        return table
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return table
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            table[int(parts[0])] = int(parts[1])
    return table


def _tagged(pid: int, tag: str) -> bool:
    try:
        environ = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return False
    return f"{RUN_TAG_ENV}={tag}".encode() in environ.split(b"\0")


def run_processes(tag: str, roots: list[int]) -> set[int]:
    """Live processes of the run: carrying the tag, or descendants of `roots`."""
    me = os.getpid()
    table = _proc_table()
    found: set[int] = set()
    if _PROC.is_dir():
        found |= {pid for pid in table if pid != me and _tagged(pid, tag)}
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    stack = [r for r in roots if r in table]
    while stack:
        pid = stack.pop()
        if pid in found or pid == me:
            continue
        found.add(pid)
        stack.extend(children.get(pid, ()))
    return found


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        state = (_PROC / str(pid) / "stat").read_text()
        return state[state.rfind(")") + 2 :].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def kill_run(tag: str, roots: list[int], timeout: float = 5.0) -> list[int]:
    """SIGKILL every process of the run until none is left (or `timeout`); returns the pids killed."""
    killed: set[int] = set()
    end = time.monotonic() + timeout
    while True:
        pids = {p for p in run_processes(tag, roots) if is_alive(p)}
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > end:
            break
        time.sleep(0.02)
    return sorted(killed)


def signal_processes(pids: list[int], signum: int, tag: str | None = None) -> list[int]:
    """Send `signum` to the live pids (those carrying `tag`, when /proc can tell)."""
    sent = []
    for pid in pids:
        if not is_alive(pid):
            continue
        if tag and _PROC.is_dir() and not _tagged(pid, tag):
            continue
        try:
            os.kill(pid, signum)
            sent.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return sent


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies. The probe's agent and ranks use it, so
    that even a ddpdoctor killed with SIGKILL (which cannot clean up) takes its run with it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)
    except (OSError, AttributeError):
        pass
