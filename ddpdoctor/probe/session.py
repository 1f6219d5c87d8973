"""The per-process probe: event writer, patch registry, step/epoch accounting and the clean end of a run.

One `Probe` lives in every instrumented process (rank, main process of a self-spawning script, its children).
Recorders (ddpdoctor/probe/recorders/) patch torch through `probe.patcher`, write through `probe.emit`, and
subscribe to `probe.step_hooks` / `probe.end_hooks`. A failure inside a recorder becomes an `internal_error`
event (`probe.safely`); the user's own exceptions always propagate untouched.

Size: one module (~650 lines) because the event writer, the stack timer, the user-frame filter and the clean
end of a process share the one Probe object every recorder holds; each part is a class or a small group of
functions here, and nothing outside the probe imports them separately.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import sysconfig
import threading
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, Callable

from ddpdoctor.events import EVENTS_DIR, SCHEMA, default_host, file_name_for
from ddpdoctor.probe.patching import Patcher
from ddpdoctor.probe.registry import TrackedObjects
from ddpdoctor.probe.settings import ProbeSettings
from ddpdoctor.records import LaunchMode
from ddpdoctor.world import WORLD_ENV

WRITE_WAIT_MARGIN = 2.0  # a write still open this close to the probe's timeout is left (and reported)
THREAD_GRACE = 1.0  # seconds the script's other non-daemon threads get to start their writes
# what each process records of its launcher: torchrun's, SLURM's and Open MPI's variables (ddpdoctor.world)
_LAUNCH_ENV = tuple(dict.fromkeys(("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", *WORLD_ENV)))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return item()
        except Exception:
            pass
    return repr(obj)[:200]


# --------------------------------------------------------------------------------------------- user frames

_PROBE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ddpdoctor package
_LIB_DIRS = tuple(
    {
        os.path.realpath(p) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
)
_USER_FILE: dict[str, bool] = {}


def is_user_file(filename: str) -> bool:
    """User code: not the probe, not the standard library, not an installed package (torch included)."""
    known = _USER_FILE.get(filename)
    if known is not None:
        return known
    if not filename or filename.startswith("<"):
        result = False
    else:
        real = os.path.realpath(filename)
        result = not (
            real.startswith(_PROBE_DIR + os.sep)
            or any(real.startswith(d) for d in _LIB_DIRS)
            or "site-packages" in real
            or "dist-packages" in real
        )
    _USER_FILE[filename] = result
    return result


def user_site(depth: int = 2) -> dict[str, Any] | None:
    """{file, line, function} of the innermost frame in user code, from the caller's caller outwards."""
    try:
        f = sys._getframe(depth)
    except ValueError:
        return None
    while f is not None:
        code = f.f_code
        if is_user_file(code.co_filename):
            return {"file": code.co_filename, "line": f.f_lineno, "function": code.co_name}
        f = f.f_back
    return None


def is_probe_file(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_PROBE_DIR + os.sep) if filename else False


def _without_probe_frames(stack: traceback.StackSummary) -> None:
    """Drop ddpdoctor's frames (the bootstrap, the CUDA emulation's __torch_function__, recorders' wrappers) and
    the runpy frames that start the script, in place: what is left is the traceback `python train.py` prints."""
    kept = [f for f in stack if not is_probe_file(f.filename)]
    while kept and (kept[0].filename == "<frozen runpy>" or os.path.basename(kept[0].filename) == "runpy.py"):
        kept.pop(0)
    stack[:] = kept


def clean_traceback(exc: BaseException) -> traceback.TracebackException:
    """The exception as the script alone would have raised it: chained causes and contexts included, without the
    probe's frames. The user's frames — where it was raised — are untouched."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
    seen: set[int] = set()
    todo = [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        _without_probe_frames(t.stack)
        todo.extend(x for x in (t.__cause__, t.__context__) if x is not None)
    return te


def install_clean_excepthook() -> None:
    """An uncaught exception is printed (the rank's stderr, shown in DD902's evidence) without the probe's frames,
    also through hooks that chain to this one (torch.distributed's rank prefix); a script's own sys.excepthook is
    left to do what it does."""
    default = sys.__excepthook__

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if exc is None:
            return default(exc_type, exc, tb)
        try:
            sys.stderr.write("".join(clean_traceback(exc).format()))
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - never lose the traceback: print Python's own
            default(exc_type, exc, tb)

    if sys.excepthook is default:
        sys.excepthook = excepthook


def user_callers(depth: int = 2, limit: int = 4) -> list[dict[str, Any]]:
    """{file, line, function} of up to `limit` frames in user code, innermost first (the call chain through the
    script's own helpers: `save_on_master(...)` in train.py, then `torch.save(...)` in utils.py)."""
    out: list[dict[str, Any]] = []
    try:
        f = sys._getframe(depth)
    except ValueError:
        return out
    while f is not None and len(out) < limit:
        code = f.f_code
        if is_user_file(code.co_filename):
            out.append({"file": code.co_filename, "line": f.f_lineno, "function": code.co_name})
        f = f.f_back
    return out


def user_frame_of(tb_frames: list[traceback.FrameSummary]) -> dict[str, Any] | None:
    for fr in reversed(tb_frames):
        if is_user_file(fr.filename):
            return {"file": fr.filename, "line": fr.lineno, "function": fr.name}
    return None


# --------------------------------------------------------------------------------------------- writer


class EventWriter:
    """Append-only JSON-lines log of one process, plus its binary side file and its stack-dump file.

    Files are opened on the first event, so processes that never record anything leave nothing behind; a
    forked child reopens its own files (os.register_at_fork). Each event is one os.write on an O_APPEND file
    descriptor: on disk as soon as it is written, even if the process is killed right after.
    """

    def __init__(self, probe: "Probe", directory: Path) -> None:
        self.probe = probe
        self.directory = directory
        self.host = default_host()
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.pid = os.getpid()
        self.seq = 0
        self._fd: int | None = None
        self._blob_fd: int | None = None
        self._blob_offset = 0
        self._stack_fh = None
        self.name = file_name_for(self.host, self.pid)

    def after_fork(self) -> None:
        for fd in (self._fd, self._blob_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._lock = threading.Lock()
        self._reset()

    @property
    def path(self) -> Path:
        return self.directory / f"{self.name}.jsonl"

    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        stack_file = self.directory / f"{self.name}.stack"
        try:
            self._stack_fh = open(stack_file, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
        except OSError:
            self._stack_fh = None
        stacks_at = self.probe.stacks.attach(self._stack_fh) if self._stack_fh is not None else None
        main = threading.main_thread().ident or 0
        self._write_locked(
            "process_start",
            {
                "role": self.probe.role,
                "ppid": os.getppid(),
                "host": self.host,
                "argv": list(sys.argv),
                "cwd": os.getcwd(),
                "env": {k: os.environ[k] for k in _LAUNCH_ENV if k in os.environ},
                "python": sys.version.split()[0],
                "schema": SCHEMA,
                "main_thread": f"0x{main:016x}",
                "stack_file": stack_file.name if self._stack_fh is not None else None,
                "stacks_at": stacks_at,
                "mode": self.probe.settings.mode.value,
            },
        )

    def _write_locked(self, kind: str, fields: dict[str, Any]) -> None:
        self.seq += 1
        record = {"kind": kind, "t": time.time(), "pid": self.pid, "seq": self.seq, "rank": self.probe.rank}
        record.update(fields)
        line = json.dumps(record, separators=(",", ":"), default=_jsonable) + "\n"
        assert self._fd is not None
        os.write(self._fd, line.encode("utf-8"))

    def write(self, kind: str, fields: dict[str, Any]) -> None:
        if os.getpid() != self.pid:
            self.after_fork()
        with self._lock:
            if self._fd is None:
                self._open()
            self._write_locked(kind, fields)

    def blob(self, data: bytes, *, dtype: str, count: int, compress: bool = True) -> dict[str, Any]:
        """Append binary data to the side file; returns the blob reference to put in an event."""
        if os.getpid() != self.pid:
            self.after_fork()
        payload = zlib.compress(data, 1) if compress else data
        with self._lock:
            if self._fd is None:
                self._open()
            if self._blob_fd is None:
                self._blob_fd = os.open(
                    self.directory / f"{self.name}.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
                )
                self._blob_offset = os.lseek(self._blob_fd, 0, os.SEEK_END)
            offset = self._blob_offset
            view = memoryview(payload)
            while view:
                n = os.write(self._blob_fd, view)
                view = view[n:]
            self._blob_offset += len(payload)
        return {
            "file": f"{self.name}.bin",
            "offset": offset,
            "nbytes": len(payload),
            "codec": "zlib" if compress else "raw",
            "dtype": dtype,
            "count": count,
        }


# --------------------------------------------------------------------------------------------- stack dumps

_DUMP_LATER = faulthandler.dump_traceback_later
_CANCEL_LATER = faulthandler.cancel_dump_traceback_later


class StackTimer:
    """Dumps the Python stack of every thread into the process's stack file at a set moment: a moment before the
    probe's timeout (launcher modes), or when no optimizer step happened for --stall-timeout (attach mode).

    No signal is involved — a signal could be one the script owns (a cluster's SIGUSR2 "save and requeue"
    handler). faulthandler's timer runs in its own C thread, so a main thread stuck in C code that holds the GIL
    still gets dumped. Two hazards of that timer are handled here: re-arming it in a forked child deadlocks in
    CPython (the child inherits the parent's lock state without the timer thread), so it is cancelled around
    every fork and re-armed in the parent; and it has one slot per process, so when the script arms or cancels
    its own, the script keeps the slot and the dump falls back to a Python thread (which needs the GIL).
    """

    def __init__(self, probe: "Probe") -> None:
        self.probe = probe
        self._reset()

    def _reset(self) -> None:
        self.fh: Any = None
        self.at: float | None = None
        self.armed = False  # faulthandler's timer holds our dump
        self.user_owns_timer = False
        self._rearm_after_fork = False
        self._fallback: threading.Thread | None = None
        self._fired_for: float | None = None
        self._wake = threading.Event()

    def attach(self, fh: Any) -> float | None:
        """The process's stack file is open: arm the launcher's moment, if there is one. Returns it."""
        self.fh = fh
        s = self.probe.settings
        if s.stacks_at > 0 and s.stall_timeout <= 0:
            self.set(s.stacks_at)
        return self.at

    def set(self, at: float | None) -> None:
        self.at = at
        if self.fh is None or at is None:
            return
        if self.user_owns_timer:
            self._start_fallback()
            self._wake.set()
            return
        delay = at - time.time()
        if delay > 0:
            _DUMP_LATER(delay, repeat=False, file=self.fh, exit=False)
            self.armed = True

    def cancel(self) -> None:
        self.at = None
        if self.armed:
            _CANCEL_LATER()
            self.armed = False
        self._wake.set()

    # -- fork safety
    def before_fork(self) -> None:
        self._rearm_after_fork = self.armed
        if self.armed:
            _CANCEL_LATER()
            self.armed = False

    def after_fork_in_parent(self) -> None:
        if self._rearm_after_fork:
            self._rearm_after_fork = False
            self.set(self.at)

    def after_fork_in_child(self) -> None:
        self._reset()  # the child arms its own timer when it opens its own stack file

    # -- the script's own use of faulthandler's timer
    def script_takes_timer(self) -> None:
        self.user_owns_timer = True
        self.armed = False
        if self.at is not None:
            self._start_fallback()

    def _start_fallback(self) -> None:
        if self._fallback is not None and self._fallback.is_alive():
            return
        self._fallback = threading.Thread(target=self._fallback_loop, name="ddpdoctor-stacks", daemon=True)
        self._fallback.start()

    def _fallback_loop(self) -> None:
        while True:
            at = self.at
            if at is None:
                self._wake.wait()
                self._wake.clear()
                continue
            delay = at - time.time()
            if delay > 0:
                self._wake.wait(delay)
                self._wake.clear()
                continue
            if self._fired_for != at and self.fh is not None:
                self._fired_for = at
                try:
                    faulthandler.dump_traceback(file=self.fh, all_threads=True)
                except (OSError, ValueError, RuntimeError):
                    return
            self._wake.wait()
            self._wake.clear()


def _guard_faulthandler(probe: "Probe") -> None:
    """The script arming or cancelling faulthandler's timer takes the slot from us (see StackTimer)."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            probe.stacks.script_takes_timer()
            return orig(*args, **kwargs)

        return call

    for name in ("dump_traceback_later", "cancel_dump_traceback_later"):
        probe.patcher.wrap(faulthandler, name, make)


# --------------------------------------------------------------------------------------------- probe


class Probe:
    """State of the probe in one process. See the module docstring."""

    def __init__(self, settings: ProbeSettings, role: str) -> None:
        self.settings = settings
        self.role = role
        self.rank: int | None = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None
        self.world_size: int | None = (
            int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None
        )
        if settings.mode is LaunchMode.SINGLE and self.rank is None:
            self.rank, self.world_size = 0, 1  # the one process that trains (DataParallel drives every GPU)
        # the rendezvous the launcher gave this process, before the script could change it (process_group)
        self.launcher_rendezvous = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
        self.patcher = Patcher()
        self.registry = TrackedObjects()
        self.signatures: dict[str, Any] = {}  # taken before other layers wrap the functions
        self.stacks = StackTimer(self)
        self.writer = EventWriter(self, Path(settings.run_dir) / EVENTS_DIR)
        self.step_hooks: list[Callable[[Any], None]] = []
        self.end_hooks: list[Callable[[], None]] = []
        self.peer_waiter: Callable[[], None] | None = None
        self.recorders: list[str] = []
        self.ending = False
        # accounting shared by the recorders
        self.steps = 0
        self.epoch = 0
        self.ddp_forward_depth = 0
        self.quiet_steps = 0  # > 0 while a library takes optimizer steps of its own (not the script's training)
        self._own = threading.local()  # per thread: depth of ddpdoctor's own work (recorder code, own forwards)
        self.counters = {"ddp_forwards": 0, "bypass_forwards": 0, "train_batches": 0}
        self.backward_calls = 0  # backward passes of the whole process (optim_health counts them)
        self.training_site_epochs: dict[tuple[str, int], int] = {}
        self.epochs_observed = 0
        self.open_training_iterations = 0
        self.launch_decided: LaunchMode | None = None  # SPAWN | TORCHRUN once the main process showed which it needs
        # > 0 while ddpdoctor runs its own forwards (in-process checks on copies of the user's layers): the
        # recorders of the user's run ignore them
        self.quiet = 0
        self.user_seeded = False  # the script seeded a generator itself (recorders/rng.py; arms.seed_for_rank)
        self._errors: dict[str, int] = {}
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(
                before=self.stacks.before_fork,
                after_in_parent=self.stacks.after_fork_in_parent,
                after_in_child=self._after_fork,
            )
        _guard_faulthandler(self)

    # -- events
    def emit(self, kind: str, **fields: Any) -> None:
        try:
            self.writer.write(kind, fields)
        except Exception as exc:  # a full disk must not kill the user's run
            self._errors["writer"] = self._errors.get("writer", 0) + 1
            if self._errors["writer"] == 1:
                print(f"ddpdoctor probe: cannot write events: {exc}", file=sys.stderr)

    def blob(self, data: bytes, *, dtype: str, count: int, compress: bool = True) -> dict[str, Any] | None:
        try:
            return self.writer.blob(data, dtype=dtype, count=count, compress=compress)
        except Exception as exc:
            self.internal_error("blob", exc)
            return None

    def internal_error(self, where: str, exc: BaseException) -> None:
        n = self._errors.get(where, 0) + 1
        self._errors[where] = n
        if n <= 3:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
            self.emit("internal_error", where=where, error=f"{type(exc).__name__}: {exc}", traceback=tb)

    # -- ddpdoctor's own work is never the script's
    @property
    def recording(self) -> int:
        """> 0 while ddpdoctor's own code runs in this thread (recorder code under `safely`, the probe's own
        forwards under `own_work`): whatever it reads, writes or calls then is ddpdoctor's, not the script's."""
        return getattr(self._own, "depth", 0)

    def _enter_own(self) -> None:
        self._own.depth = getattr(self._own, "depth", 0) + 1

    def _leave_own(self) -> None:
        self._own.depth = getattr(self._own, "depth", 1) - 1

    def observe(self, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run an interceptor's recorder code for a call the *script* made: skipped (None) when the call came from
        ddpdoctor's own work in this thread — the legacy --local_rank override reading LOCAL_RANK inside the
        argparse wrapper, a recorder calling os.environ or torch on the user's behalf, the probe's own checks — so
        that nothing ddpdoctor does is ever attributed to a line of the user's code. Interceptors that record what
        the script did call this instead of `safely`."""
        if self.recording:
            return None
        return self.safely(where, fn, *args, **kwargs)

    def safely(self, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run recorder code; its failure becomes an internal_error event instead of the user's problem. While it
        runs, the probe's interceptors see ddpdoctor's own work (`observe`)."""
        self._enter_own()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.internal_error(where, exc)
            return None
        finally:
            self._leave_own()

    def site(self) -> dict[str, Any] | None:
        """Where in user code the current call came from (the probe's own frames are never user code)."""
        return user_site(2)

    def record_exception(self, exc: BaseException, where: str) -> None:
        frames = traceback.extract_tb(exc.__traceback__)
        clean = clean_traceback(exc)
        fields: dict[str, Any] = {
            "type": type(exc).__name__,
            "message": str(exc)[:4000],
            "traceback": "".join(clean.format())[-20000:],
            "frames": [[f.filename, f.lineno, f.name] for f in clean.stack][-60:],
            "user_frame": user_frame_of(frames),
            "where": where,
        }
        if isinstance(exc, SystemExit):
            fields["exit_code"] = exc.code if isinstance(exc.code, int) or exc.code is None else 1
        self.emit("exception", **fields)

    # -- steps and the end of the run
    def after_step(self, optimizer: Any) -> None:
        for hook in self.step_hooks:
            self.safely(f"step hook {getattr(hook, '__qualname__', hook)}", hook, optimizer)
        s = self.settings
        if s.limited and not self.ending:
            sites = max(1, len(self.training_site_epochs))
            if self.steps >= s.epochs * s.steps * sites and self.open_training_iterations == 0:
                # no loader delimits epochs (synthetic batches, itertools.cycle): stop after E x S steps
                self.end_run("steps observed")
        self.arm_stall_watchdog()

    def arm_stall_watchdog(self) -> None:
        """Attach mode: dump the stacks if the next optimizer step does not come within --stall-timeout."""
        if self.settings.stall_timeout > 0:
            self.safely("stall watchdog", self._arm_stall_watchdog)

    def _arm_stall_watchdog(self) -> None:
        if self.stacks.fh is not None:
            self.stacks.set(time.time() + self.settings.stall_timeout)

    def end_run(self, reason: str, code: int = 0, *, run_atexit: bool = False, site: dict | None = None) -> None:
        """Finish this process's part of the run: close what is open, record `done`, wait for the peers (so a
        peer stuck in a collective shows as a hang, as it would with NCCL, not as a closed connection), flush,
        and leave with os._exit — the interpreter's teardown of gloo aborts in a few percent of runs."""
        if self.ending:
            return
        self.ending = True
        if self.settings.stall_timeout > 0:
            self.stacks.cancel()
        for hook in list(self.end_hooks):
            self.safely(f"end hook {getattr(hook, '__qualname__', hook)}", hook)
        waited, cut = self._let_writes_finish()
        self.emit("done", reason=reason, steps=self.steps, epochs=self.epochs_observed, backwards=self.backward_calls,
                  writes_waited=waited, writes_cut=cut, **({"site": site} if site else {}))
        if self.peer_waiter is not None:
            self.safely("peers wait", self.peer_waiter)
        if run_atexit:
            self.safely("atexit", _run_atexit)
        else:
            self.safely("children", kill_children)
        self.leave(code)

    def _let_writes_finish(self) -> tuple[float, list[str]]:
        """Ending mid-script (os._exit) must not cut off a write in progress — a checkpoint a background thread
        is saving, a log another thread is writing: wait for the writes the redirection sees in flight (until a
        moment before the probe's timeout), and give the script's other non-daemon threads a short grace to start
        theirs (the interpreter would have waited for them at exit). Returns (seconds waited, writes still open)."""
        from ddpdoctor.probe import fsview

        t0 = time.time()
        timeout_at = self.settings.stacks_at or (t0 + max(self.settings.timeout, 1.0))
        end = max(t0, timeout_at - WRITE_WAIT_MARGIN)
        grace = t0 + THREAD_GRACE
        me = threading.current_thread()
        while time.time() < end:
            writing = fsview.in_flight(ending=me)
            threads = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
            if not writing and (not threads or time.time() > grace):
                break
            time.sleep(0.02)
        fsview.flush_open_writes()
        return round(time.time() - t0, 3), fsview.in_flight(ending=me)[:8]

    def leave(self, code: int) -> None:
        self.emit("exit", code=code)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)

    def _after_fork(self) -> None:
        self.stacks.after_fork_in_child()
        self.writer.after_fork()
        self.role = "forked"
        self.ending = False
        self._errors = {}


def _run_atexit() -> None:
    import atexit

    atexit._run_exitfuncs()


def kill_children() -> None:
    """The run ends mid-script: DataLoader workers and other children of this process go with it."""
    import multiprocessing

    for child in multiprocessing.active_children():
        try:
            child.kill()
        except Exception:
            pass


_PROBE: Probe | None = None


def current() -> Probe | None:
    return _PROBE


def start(settings: ProbeSettings, role: str) -> Probe:
    """Create this process's probe (once)."""
    global _PROBE
    if _PROBE is None:
        _PROBE = Probe(settings, role)
    return _PROBE
