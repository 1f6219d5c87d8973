"""A supervising process between ddpdoctor and everything a run starts, so that nothing outlives the run however
ddpdoctor ends — normal end, timeout, Ctrl-C, SIGTERM, or a SIGKILL that leaves ddpdoctor no chance to clean up.

    ddpdoctor ──pipe──► supervisor (own session; Linux: child subreaper)
                            └─► the run's processes: torch.distributed.run's agent and its ranks, or the main
                                process of a self-spawning script and its children, or compare-bn's ranks

Decisions:
- The supervisor holds the read end of a pipe whose only write end is ddpdoctor's. End of file on it — ddpdoctor
  closed it, or died in any way, SIGKILL included — means: stop the run. There is no window at start-up: the
  write end is never inherited, so from the supervisor's first instruction an EOF means ddpdoctor is gone, and
  the supervisor looks before it starts anything.
- When every process it started has exited, whatever is left (a daemon a rank double-forked, a `sleep` started
  with `start_new_session=True` and a fresh environment) is stopped too: the run is over.
- On Linux it is a child subreaper, so descendants that double-fork or setsid stay its descendants
  (ddpdoctor.probe.procs); it reaps them. It also enforces a last-resort deadline of its own, in case ddpdoctor
  is alive but stopped (SIGSTOP, a suspended laptop lid is not one: monotonic time stops too).
- It starts its processes itself (fork, then exec): between the two the child asks for SIGKILL on the
  supervisor's death (PR_SET_PDEATHSIG) and checks the supervisor is still its parent, so a SIGKILL of the
  supervisor itself still takes the run's top processes with it.
- It removes the run's scratch directories (TMPDIR of the run: multiprocessing's pymp-* folders, elastic's
  error files; compare-bn's result files) after the last process is gone and ddpdoctor let it go (its caller may
  still be reading them), also when ddpdoctor was killed. Started with no command at all
  it is only that: a guard that removes its directories when ddpdoctor lets it go or dies (`guard`), which is
  how a temporary run directory never outlives a killed ddpdoctor.
- Status goes back on a second pipe as JSON lines: `started` (index, pid), `exited` (index, returncode as
  subprocess reports it: negative = signal), and the final `stopped` (reason, pids killed). The supervisor itself
  runs with `-E -s` (no PYTHONPATH, no user site: the run's sitecustomize hook is not for it) and the package's
  directory on sys.path.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpdoctor import WITHOUT_CWD
from ddpdoctor.probe import procs

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
_BOOT = WITHOUT_CWD + (
    "sys.path.insert(0, {root!r}); "
    "from ddpdoctor.probe.supervisor import main; sys.exit(main(sys.argv[1:]))"
)
GRACE = 30.0  # seconds the supervisor's own deadline leaves after the caller's


@dataclass(frozen=True, kw_only=True)
class Command:
    argv: list[str]
    stdout: str  # file path (appended to)
    stderr: str
    env: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's environment


# ------------------------------------------------------------------------------------------- caller's side


class Supervisor:
    """The caller's handle: start, poll each process's return code, stop (which always waits for the supervisor,
    so when `stop` returns every process of the run is gone)."""

    def __init__(
        self,
        commands: Sequence[Command],
        *,
        env: dict[str, str],
        cwd: str,
        tag: str,
        deadline: float,
        scratch: Sequence[str] = (),
        log: str | None = None,
    ) -> None:
        self.commands = list(commands)
        self.env = env
        self.cwd = cwd
        self.tag = tag
        self.deadline = deadline  # time.time() by which the caller will have stopped the run
        self.scratch = list(scratch)
        self.log = log
        self.pids: list[int | None] = [None] * len(self.commands)
        self.returncodes: list[int | None] = [None] * len(self.commands)
        self.final: dict[str, Any] | None = None
        self._proc: subprocess.Popen | None = None
        self._control: int | None = None
        self._status: int | None = None
        self._buffer = b""

    def start(self) -> Supervisor:
        spec = {
            "commands": [{"argv": c.argv, "stdout": c.stdout, "stderr": c.stderr, "env": c.env} for c in self.commands],
            "cwd": self.cwd,
            "tag": self.tag,
            "deadline": self.deadline + GRACE if self.deadline else 0,
            "scratch": self.scratch,
        }
        control_r, control_w = os.pipe()
        status_r, status_w = os.pipe()
        argv = [sys.executable, "-E", "-s", "-c", _BOOT.format(root=_PACKAGE_PARENT), str(control_r), str(status_w),
                json.dumps(spec)]
        err = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 - closed below
        try:
            self._proc = subprocess.Popen(
                argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                pass_fds=(control_r, status_w), start_new_session=True,
            )
        finally:
            os.close(control_r)
            os.close(status_w)
            if err is not subprocess.DEVNULL:
                err.close()
        self._control = control_w
        self._status = status_r
        os.set_blocking(status_r, False)
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _read_status(self) -> None:
        if self._status is None:
            return
        while True:
            try:
                chunk = os.read(self._status, 65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                break
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("event")
            if kind == "started":
                self.pids[event["index"]] = event["pid"]
            elif kind == "exited":
                self.returncodes[event["index"]] = event["returncode"]
            elif kind == "stopped":
                self.final = event

    def poll(self) -> list[int | None]:
        """Return codes so far (None: still running, or not started)."""
        self._read_status()
        return list(self.returncodes)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        """Stop the run (a no-op for processes that already exited) and wait until nothing of it is left."""
        if self._control is not None:
            os.close(self._control)
            self._control = None
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:  # the supervisor itself is stuck (stopped?): do its work here
                proc.kill()
                proc.wait()
        self._read_status()
        if self._status is not None:
            os.close(self._status)
            self._status = None
        final = dict(self.final or {})
        if not self.final:
            # the supervisor died without reporting (killed from outside): stop what it left ourselves
            killed = procs.kill_run(self.tag, [p for p in self.pids if p], below=self.pid)
            for path in self.scratch:
                shutil.rmtree(path, ignore_errors=True)
            final = {"event": "stopped", "reason": "supervisor lost", "killed": killed}
        final["returncodes"] = list(self.returncodes)
        final["pids"] = list(self.pids)
        return final

    @classmethod
    def guard(cls, paths: Sequence[str]) -> Supervisor:
        """A started supervisor with nothing to run that removes `paths` when stopped or when this process dies."""
        return cls([], env=dict(os.environ), cwd=os.getcwd(), tag="", deadline=0.0, scratch=paths).start()

    @classmethod
    def guarded_tempdir(cls, prefix: str) -> tuple[Path, Supervisor]:
        """A new private temporary directory and the guard that removes it. The guard is running before the
        directory exists, so no moment of a SIGKILL (or a SIGTERM before the caller traps it) leaves it behind."""
        import tempfile

        for _ in range(100):
            path = Path(tempfile.gettempdir()) / f"{prefix}{os.urandom(6).hex()}"
            if path.exists():
                continue
            guard = cls.guard([str(path)])
            try:
                path.mkdir(mode=0o700)
            except FileExistsError:
                guard.stop()
                continue
            except BaseException:
                guard.stop()
                raise
            return path, guard
        raise FileExistsError(f"no free temporary directory name for {prefix!r}")

    def __enter__(self) -> Supervisor:  # noqa: PYI034 - 3.10 has no typing.Self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Stopped(KeyboardInterrupt):
    """SIGTERM / SIGHUP while a supervised run goes on: the caller stops the run as Ctrl-C does (a KeyboardInterrupt,
    so that one escaping past the run's own handling still ends the command as `interrupted`, exit 2)."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum)


def trap_stop_signals() -> dict[int, Any]:
    """While a run goes on, SIGTERM and SIGHUP raise `Stopped` (their default action would skip the caller's
    `finally`, and with it `Supervisor.stop`). Returns the handlers to put back (`restore_signals`)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) != signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            previous[int(sig)] = signal.signal(sig, _raise_stopped)
    return previous


def restore_signals(previous: dict[int, Any]) -> None:
    """Put the caller's handlers back (those `trap_stop_signals` or `hold_signals` replaced)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class HeldSignals:
    """SIGINT, SIGTERM and SIGHUP that arrived while clean-up ran (`hold_signals`): recorded, not acted on."""

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}
        self.received: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.received)

    def release(self) -> None:
        """Put the handlers back as they were before `hold_signals`; what arrived meanwhile stays in `received`."""
        restore_signals(self.previous)
        self.previous = {}

    def raise_received(self) -> None:
        """After `release`: a held signal ends the command as Ctrl-C does (ddpdoctor exits 2, `interrupted`)."""
        if self.received:
            raise KeyboardInterrupt


def hold_signals(previous: dict[int, Any] | None = None) -> HeldSignals:
    """While the run is stopped and its files removed, SIGINT/SIGTERM/SIGHUP are recorded instead of acted on: a
    second Ctrl-C must not cut the clean-up short (a rank left running, a scratch folder left behind), and must not
    be lost either — ignoring it let the command go on to a full report and exit 0 as if nobody had asked it to
    stop. The caller releases them (`HeldSignals.release`) and raises if any came (`raise_received`)."""
    held = HeldSignals()
    if threading.current_thread() is not threading.main_thread():
        return held

    def record(signum: int, frame: Any) -> None:
        held.received.append(signum)

    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) != signal.SIG_IGN:  # ignored by whoever started us: stays so
            found = signal.signal(sig, record)
            held.previous[int(sig)] = (previous or {}).get(int(sig), found)
    return held


# ------------------------------------------------------------------------------------------- the supervisor


def _returncode(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 1


def _spawn(command: dict[str, Any], cwd: str, me: int) -> int:
    env = {**os.environ, **command.get("env", {})}
    out = os.open(command["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    err = out if command["stderr"] == command["stdout"] else os.open(
        command["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
    )
    pid = os.fork()
    if pid == 0:  # the child: nothing here may raise past os._exit
        try:
            procs.die_with_parent(me)
            for sig in ("SIGPIPE", "SIGXFSZ", "SIGINT", "SIGTERM", "SIGHUP"):
                if hasattr(signal, sig):
                    signal.signal(getattr(signal, sig), signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.chdir(cwd)
            os.execvpe(command["argv"][0], command["argv"], env)
        except BaseException as exc:  # noqa: BLE001 - report and leave; never return into the supervisor's loop
            try:
                os.write(2, f"ddpdoctor supervisor: cannot start {command['argv'][0]}: {exc}\n".encode())
            finally:
                os._exit(127)
    os.close(out)
    if err != out:
        os.close(err)
    return pid


def main(argv: list[str]) -> int:
    control, status = int(argv[0]), int(argv[1])
    spec = json.loads(argv[2])
    os.set_inheritable(control, False)
    os.set_inheritable(status, False)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    stop_requested: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        stop_requested.append(signal.Signals(signum).name)

    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        signal.signal(getattr(signal, name), on_signal)
    me = os.getpid()
    subreaper = procs.become_subreaper()
    os.environ[procs.PARENT_ENV] = str(me)
    os.environ[procs.SUPERVISOR_ENV] = str(me)

    def report(event: dict[str, Any]) -> None:
        try:
            os.write(status, (json.dumps(event) + "\n").encode())
        except OSError:
            pass  # ddpdoctor is gone: the run is stopped all the same

    def released(wait: float) -> bool:
        try:
            ready, _, _ = select.select([control], [], [], wait)
        except InterruptedError:
            return bool(stop_requested)
        if not ready:
            return bool(stop_requested)
        try:
            return os.read(control, 4096) == b""
        except OSError:
            return True

    children: dict[int, int] = {}  # pid -> command index
    deadline = float(spec.get("deadline") or 0)
    reason = "released"
    killed: list[int] = []
    try:
        if not released(0):
            for index, command in enumerate(spec["commands"]):
                pid = _spawn(command, spec["cwd"], me)
                children[pid] = index
                report({"event": "started", "index": index, "pid": pid})
            while True:
                while children:
                    try:
                        pid, st = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    if pid in children:
                        report({"event": "exited", "index": children.pop(pid), "returncode": _returncode(st)})
                if spec["commands"] and not children:
                    reason = "exited"
                    break
                if released(0.05):
                    reason = stop_requested[0] if stop_requested else "released"
                    break
                if deadline and time.time() > deadline:
                    reason = "deadline"
                    break
    finally:
        reaped: dict[int, int] = {}
        killed = procs.kill_run(spec.get("tag"), list(children), below=me, reaped=reaped)
        for pid in list(children):  # the processes it started: how they ended
            st = reaped.get(pid)
            if st is None:
                try:
                    _, st = os.waitpid(pid, 0)
                except ChildProcessError:
                    continue
            report({"event": "exited", "index": children.pop(pid), "returncode": _returncode(st)})
        if reason == "exited" and spec.get("scratch"):
            # the caller may still read what its processes left in a scratch directory (compare-bn's results):
            # those go when it lets us go or dies, not the moment the last process exits
            while not released(1.0) and not (deadline and time.time() > deadline):
                pass
        for path in spec.get("scratch") or ():
            shutil.rmtree(path, ignore_errors=True)
    report({"event": "stopped", "reason": reason, "killed": killed, "subreaper": subreaper})
    return 0
