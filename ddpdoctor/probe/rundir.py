"""Claiming a run directory for writing: ddpdoctor's own marker, a lock, and nothing of the user's touched.

A run directory is recognised by its marker file, `.ddpdoctor-run`, which only ddpdoctor writes — never by the
presence of a `meta.json` or an `events/` folder, which a user's project may have for its own reasons. So:

- `ddpdoctor check --keep-run DIR`: DIR must be new, empty, or hold the marker. A marked directory that holds an
  earlier run has that run's files replaced (only the names ddpdoctor writes: `RUN_FILES`); anything else is
  refused with one line, and nothing in it is touched.
- While a run writes into DIR it holds an exclusive lock (flock) on the marker: a second `check` with the same
  `--keep-run` is refused instead of deleting the first's events mid-run. The lock ends with the process, so a
  killed run never leaves DIR locked.
- Attach mode (`python -m ddpdoctor.probe --out DIR`, one process per rank, maybe on several hosts): the first
  process of a job writes the marker with the job's identity (the launcher's rendezvous variables); the others of
  the same job join, any other job is refused with one line and exit 2 before the script runs. On each host the
  first process also records which launcher started it there (elastic's per-agent directory, else the parent pid),
  so a second job reusing the same rendezvous variables on that host is refused too. Attached processes hold a
  shared lock for their lifetime, which `check --keep-run` on the same DIR cannot take.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ddpdoctor.errors import UsageError
from ddpdoctor.events import (
    EVENTS_DIR,
    LAUNCHER_FILE,
    LOGS_DIR,
    META_FILE,
    RUN_MARKER,
    SCHEMA,
    SOURCE_DIR,
    STATIC_FILE,
)

MARKER = RUN_MARKER
HOSTS_DIR = ".ddpdoctor-hosts"  # attach mode: one file per host, naming the launcher of this job there
WRITES_DIR = "writes"  # the script's redirected writes (ddpdoctor.probe.fsview)
# the deletions and the symlinks of the run's view (ddpdoctor.probe.fsview; stdlib-only there, so named again here)
VIEW_FILES = ("deleted", "links.made")
# every name a run writes into its directory: what replacing an earlier run removes (and nothing else)
RUN_FILES = (EVENTS_DIR, LOGS_DIR, SOURCE_DIR, WRITES_DIR, *VIEW_FILES, META_FILE, STATIC_FILE, LAUNCHER_FILE,
             "agent.json", "agent.json.tmp", "meta.json.tmp", "launcher.json.tmp", "static.json.tmp", HOSTS_DIR)

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking, the marker still protects the user's files
    fcntl = None  # type: ignore[assignment]


def has_marker(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def _marker_data(**extra: Any) -> dict[str, Any]:
    return {"tool": "ddpdoctor", "schema": SCHEMA, "created": time.time(), **extra}


def _read_marker(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / MARKER).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class RunDirClaim:
    """A run directory this process may write into, locked until `release()` (or the process's end)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunDirClaim:  # noqa: PYI034 - 3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock(path: Path, exclusive: bool, what: str) -> int | None:
    fd = os.open(path / MARKER, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    if fcntl is None:
        return fd
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise UsageError(f"{path}: in use by another ddpdoctor run ({what})") from None
    return fd


def _usable_dir(path: Path, option: str) -> Path:
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot create it: {exc.strerror or exc}") from None
    return path


def mark_folder(path: Path, option: str) -> Path:
    """Create `path` if needed and put ddpdoctor's marker in it (a folder that holds runs, e.g. a triage's arms)."""
    path = _usable_dir(Path(path), option)
    if not has_marker(path):
        _write_marker(path, _marker_data())
    return path


def claim_folder(path: Path, option: str, what: str) -> RunDirClaim:
    """Mark `path` (mark_folder) and lock it exclusively for this process: a folder holding several runs (a
    triage's arms) that a second command must not clear meanwhile."""
    path = mark_folder(path, option)
    return RunDirClaim(path, _lock(path, True, what))


def ensure_finished(path: Path) -> None:
    """Refuse (UsageError) a marked directory that a live run still writes into: `report` on it would analyse a
    run cut at an arbitrary moment as if it were whole. A killed run holds no lock."""
    path = Path(path)
    if not has_marker(path):
        return
    try:
        fd = _lock(path, True, "")
    except UsageError:
        raise UsageError(
            f"{path}: a ddpdoctor run is still writing into it; report it once that run has ended"
        ) from None
    except OSError:
        return
    if fd is not None:
        os.close(fd)


def claim_for_check(run_dir: Path) -> RunDirClaim:
    """`check --keep-run DIR` (or a fresh temporary directory): mark, lock, and clear an earlier run's files."""
    run_dir = _usable_dir(Path(run_dir), "--keep-run")
    if not has_marker(run_dir):
        if any(run_dir.iterdir()):
            raise UsageError(
                f"--keep-run {run_dir}: not empty and not a ddpdoctor run directory; use a new or empty folder "
                "(ddpdoctor never deletes files it did not write)"
            )
        _write_marker(run_dir, _marker_data())
    fd = _lock(run_dir, True, "a check writing into it")
    for name in RUN_FILES:  # a device, FIFO or socket under one of the run's names is nothing ddpdoctor wrote
        p = run_dir / name
        if p.exists() and not p.is_symlink() and not p.is_file() and not p.is_dir():
            os.close(fd)
            raise UsageError(f"--keep-run {run_dir}: {name} is not a file or folder a run writes (a device, FIFO or "
                             "socket); ddpdoctor never replaces one")
    for name in RUN_FILES:
        p = run_dir / name
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    (run_dir / EVENTS_DIR).mkdir()
    (run_dir / LOGS_DIR).mkdir()
    return RunDirClaim(run_dir, fd)


def _write_marker(run_dir: Path, data: dict[str, Any]) -> bool:
    """Create the marker exclusively; False when another process created it first."""
    try:
        fd = os.open(run_dir / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    return True


_JOB_ENV = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID",
            "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_JOBID")


def attach_identity(host: str) -> tuple[dict[str, str], str]:
    """(what every process of one job shares, what identifies this job's launcher on this host)."""
    from ddpdoctor.world import place_from_env

    job = {k: os.environ[k] for k in _JOB_ENV if os.environ.get(k)}
    if not job or not place_from_env(os.environ).world_size:
        job = {"process": f"{host}:{os.getpid()}"}  # no launcher: a job of one process
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if error_file:  # elastic: <log dir>/<run id>_<random>/attempt_<n>/<local rank>/error.json, per agent
        launcher = str(Path(error_file).parents[2])
    else:
        launcher = f"ppid {os.getppid()}"
    return job, launcher


def claim_for_attach(out: Path, host: str) -> RunDirClaim:
    """Attach mode: join this job's run directory, or refuse one that another job writes or wrote."""
    out = _usable_dir(Path(out), "--out")
    job, launcher = attach_identity(host)
    if not has_marker(out):
        if any(p.name != MARKER for p in out.iterdir()) and not has_marker(out):
            raise UsageError(f"--out {out}: not empty and not a ddpdoctor run directory; use a new or empty folder")
        _write_marker(out, _marker_data(job=job))
    recorded = _read_marker(out)
    if recorded.get("job") != job:
        for _ in range(20):  # the first process may still be writing it
            if recorded.get("job") is not None:
                break
            time.sleep(0.05)
            recorded = _read_marker(out)
        if recorded.get("job") != job:
            raise UsageError(f"--out {out}: holds the run of another job; use one --out per job")
    hosts = out / HOSTS_DIR
    hosts.mkdir(exist_ok=True)
    mine = hosts / (host or "host")
    try:
        fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(launcher)
    except FileExistsError:
        if mine.read_text(encoding="utf-8") != launcher:
            raise UsageError(f"--out {out}: holds the run of another job on this host; use one --out per job") from None
    (out / EVENTS_DIR).mkdir(exist_ok=True)
    return RunDirClaim(out, _lock(out, False, "a check writing into it"))
