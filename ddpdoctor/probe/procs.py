"""Finding and stopping every process of a run, whatever became of the process tree.

A run's processes are found three ways, and stopped by whichever finds them:

- **descendants** of the run's supervisor (ddpdoctor.probe.supervisor). On Linux the supervisor is a child
  subreaper (PR_SET_CHILD_SUBREAPER): a process that double-forks or calls setsid() is re-parented to it, not to
  init, so it stays a descendant — also one that replaced its environment. Elsewhere parent links from `ps` are
  followed, and a re-parented orphan is out of reach unless the tag finds it.
- **the run tag**: every process of a run inherits DDPDOCTOR_RUN_TAG in its environment; on Linux /proc tells
  which processes carry it (a process started with a new environment does not).
- **process groups**, for what the two above cannot see on a system without /proc.

Stopping freezes first (SIGSTOP every process found, look again until nothing new appears, so a process that
forks in a loop cannot outrun us), then SIGKILLs: a script that ignores SIGINT/SIGTERM stops as surely as one
that does not.

Parent death: a process started by the probe's own launcher machinery asks the kernel (PR_SET_PDEATHSIG) for a
SIGKILL when its parent dies, and checks, after asking, that its parent is still the one that started it
(`DDPDOCTOR_PARENT_PID`); the supervisor does this between fork and exec for the process it starts, the
sitecustomize hook at interpreter start for the ranks. So a SIGKILL of the supervisor itself takes the launcher
and the ranks with it (Linux only).
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
# pid of the process that started this one through the probe's launcher machinery (supervisor → launcher →
# ranks); a process whose parent is no longer that pid when it starts has been orphaned already
PARENT_ENV = "DDPDOCTOR_PARENT_PID"
# pid of the run's supervisor: an orphaned process of the run is re-parented to it (Linux)
SUPERVISOR_ENV = "DDPDOCTOR_SUPERVISOR_PID"

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


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
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10, check=False).stdout
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


def run_processes(tag: str | None, roots: list[int], *, below: int | None = None) -> set[int]:
    """Live processes of the run: carrying the tag, descendants of `roots`, or descendants of `below` (the
    supervisor itself, not included)."""
    me = os.getpid()
    table = _proc_table()
    found: set[int] = set()
    if tag and _PROC.is_dir():
        found |= {pid for pid in table if pid not in (me, below) and _tagged(pid, tag)}
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    stack = [r for r in roots if r in table]
    if below is not None:
        stack.extend(children.get(below, ()))
    while stack:
        pid = stack.pop()
        if pid in found or pid in (me, below):
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


def _send(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _reap_children(reaped: dict[int, int]) -> None:
    """Collect exited children into `reaped` (pid → wait status). The supervisor inherits orphans as a subreaper:
    their zombies must not pile up, and where /proc cannot tell a zombie from a live process, only reaping can."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reaped[pid] = status


def kill_run(tag: str | None, roots: list[int], timeout: float = 5.0, *, below: int | None = None,
             reaped: dict[int, int] | None = None) -> list[int]:
    """Freeze, then SIGKILL every process of the run until none is left (or `timeout`); returns the pids killed.
    `reaped`: also collect this process's exited children there (pid → wait status; the supervisor's case)."""
    killed: set[int] = set()
    end = time.monotonic() + timeout
    stop = getattr(signal, "SIGSTOP", None)
    while True:
        frozen: set[int] = set()
        if stop is not None:
            # freeze until a look finds nothing new: a process that forks in a loop cannot outrun the kill
            for _ in range(20):
                new = {p for p in run_processes(tag, roots, below=below) if p not in frozen and is_alive(p)}
                if not new:
                    break
                frozen |= {p for p in new if _send(p, stop)}
        pids = frozen | {p for p in run_processes(tag, roots, below=below) if is_alive(p)}
        if reaped is not None:
            _reap_children(reaped)
            pids = {p for p in pids if p not in reaped}
        if not pids:
            break
        killed |= {p for p in pids if _send(p, signal.SIGKILL)}
        if time.monotonic() > end:
            break
        time.sleep(0.02)
    if reaped is not None:
        _reap_children(reaped)
    return sorted(killed)


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Linux: orphaned descendants of this process are re-parented to it instead of init."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(expected_parent: int) -> bool:
    """Linux: have the kernel SIGKILL this process when its parent dies. Checked against the parent that started
    it (not the parent it has now, read too late): if that one is already gone, leave at once. Returns whether
    the request was made."""
    if not _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL)):
        return False
    if expected_parent and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before the request took effect: nobody would stop us
    return True
