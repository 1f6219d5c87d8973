"""The run-directory reader: a recorded run (its meta.json, launcher.json, static.json and the per-process event
logs, `ddpdoctor.events` documents the layout and every event kind) read once into `RunData`.

The analyses read runs through `read_run` / `read_runs` (several directories of one attach-mode run); nothing
here writes. Files are read bounded and only when they are regular files (a run directory is input, possibly
damaged or hostile: a FIFO never ends, a 10 GB line is damage). Nothing here imports torch.
"""

from __future__ import annotations

import functools
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from ddpdoctor.events import (
    BASE_FIELDS,
    EVENTS_DIR,
    LAUNCHER_FILE,
    LOGS_DIR,
    META_FILE,
    RUN_MARKER,
    SCHEMA,
    SOURCE_DIR,
    STATIC_FILE,
    BlobRef,
)
from ddpdoctor.records import LaunchRecord, RunMeta, StaticRecord


@dataclass
class ProcessLog:
    """One process's event log, in order."""

    name: str  # file stem: <host>-p<pid>
    pid: int
    host: str
    events: list[dict[str, Any]]
    stack_text: str | None = None
    bad_lines: int = 0

    _index: dict[str, list[dict[str, Any]]] | None = field(default=None, repr=False, compare=False)

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        """Events of these kinds, in order (indexed once: analyses ask often)."""
        if self._index is None:
            index: dict[str, list[dict[str, Any]]] = {}
            for e in self.events:
                index.setdefault(str(e.get("kind")), []).append(e)
            self._index = index
        if len(kinds) == 1:
            return list(self._index.get(kinds[0], ()))
        return [e for e in self.events if e.get("kind") in kinds]

    def first(self, kind: str) -> dict[str, Any] | None:
        found = self.of(kind)
        return found[0] if found else None

    def last(self, kind: str | None = None) -> dict[str, Any] | None:
        if kind is None:
            return self.events[-1] if self.events else None
        found = self.of(kind)
        return found[-1] if found else None

    @property
    def start(self) -> dict[str, Any]:
        return self.first("process_start") or {}

    @property
    def role(self) -> str:
        return str(self.start.get("role") or "unknown")

    @property
    def rank(self) -> int | None:
        """The rank this process ended up with: init_process_group's answer first, else the launcher's RANK."""
        for e in self.of("pg_init"):
            if e.get("ok") and e.get("rank") is not None:
                return int(e["rank"])
        for e in self.events:
            if e.get("rank") is not None:
                return int(e["rank"])
        return None

    @property
    def done(self) -> dict[str, Any] | None:
        return self.first("done")

    @property
    def is_rank_process(self) -> bool:
        """A process that trains as a rank: launched as one, or joined a process group."""
        return self.role in ("rank", "attached") or bool(self.of("pg_init") or self.of("pg_init_begin"))


@dataclass
class RunData:
    """Everything in a run directory, read once."""

    path: Path
    meta: RunMeta
    launcher: LaunchRecord | None
    processes: list[ProcessLog]
    static: StaticRecord | None = None
    # a run recorded in several directories (attach mode, one per node): each directory and its own meta.json;
    # empty for a run in one directory (then `path` is the only part)
    parts: tuple[tuple[Path, RunMeta], ...] = ()
    # blob file name → the directory whose events/ holds it (several parts)
    blob_dirs: dict[str, Path] = field(default_factory=dict, repr=False)
    _blob_cache: dict[str, bytes] = field(default_factory=dict, repr=False)

    @property
    def directories(self) -> list[tuple[Path, RunMeta]]:
        """(directory, its meta.json) of every part of the run: one, or one per node."""
        return list(self.parts) or [(self.path, self.meta)]

    @functools.cached_property
    def rank_processes(self) -> dict[int, ProcessLog]:
        """rank → the process that trained as that rank. If two processes claim a rank (a hard-coded rank under a
        self-spawning script), the first to start keeps it."""
        out: dict[int, ProcessLog] = {}
        for p in sorted(self.processes, key=lambda p: p.events[0]["t"] if p.events else 0.0):
            if not p.is_rank_process:
                continue
            r = p.rank
            if r is not None and r not in out:
                out[r] = p
        return dict(sorted(out.items()))

    @property
    def main_process(self) -> ProcessLog | None:
        """The single process of a self-spawning script (mode 'spawn')."""
        return next((p for p in self.processes if p.role == "main"), None)

    def events(self, kind: str) -> Iterator[tuple[ProcessLog, dict[str, Any]]]:
        for p in self.processes:
            for e in p.events:
                if e.get("kind") == kind:
                    yield p, e

    def blob_bytes(self, ref: BlobRef | dict[str, Any]) -> bytes:
        if isinstance(ref, dict):
            ref = BlobRef.from_json(ref)
        name = Path(ref.file).name
        if name not in self._blob_cache:
            self._blob_cache[name] = read_bounded(self.blob_dirs.get(name, self.path) / EVENTS_DIR / name)
        raw = self._blob_cache[name][ref.offset : ref.offset + ref.nbytes]
        if len(raw) != ref.nbytes:
            raise ValueError(f"blob {name}@{ref.offset} is truncated")
        return zlib.decompress(raw) if ref.codec == "zlib" else raw

    def load_array(self, ref: BlobRef | dict[str, Any]):
        """A blob as a numpy array of its dtype."""
        import numpy as np

        if isinstance(ref, dict):
            ref = BlobRef.from_json(ref)
        arr = np.frombuffer(self.blob_bytes(ref), dtype=np.dtype(ref.dtype))
        return arr[: ref.count]

    def output_tail(self, rank: int | None, stream: str = "stderr", lines: int = 20) -> list[str]:
        """Last lines of a rank's stdout/stderr as captured by the launcher ([] when not captured)."""
        path = self.output_file(rank, stream)
        if path is None:
            return []
        try:
            text = read_text_bounded(path)
        except OSError:
            return []
        return text.splitlines()[-lines:]

    def output_file(self, rank: int | None, stream: str = "stderr") -> Path | None:
        logs = self.path / LOGS_DIR
        name = f"rank{rank}.{stream}" if rank is not None else f"main.{stream}"
        candidate = logs / name
        if candidate.is_file():
            return candidate
        if rank is not None and (logs / f"main.{stream}").is_file():
            return logs / f"main.{stream}"
        return None


MAX_EVENT_LINE = 64 << 20  # an event is a few KB (tensors go to side files): a longer line is damage, not parsed


class NotRegularFile(OSError):
    """A file of a run directory that is a device, FIFO, socket or directory: never read (it may never end)."""


def read_bounded(path: Path) -> bytes:
    """The bytes of a regular file as large as it was when opened: a FIFO, a device (/dev/zero behind a symlink)
    or a socket raises NotRegularFile instead of blocking or growing without end, and a file that reports no
    size but streams (/proc/kmsg) reads as empty. The one way ddpdoctor reads a recorded run's files."""
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path}: not a regular file")
        chunks: list[bytes] = []
        left = st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text_bounded(path: Path, errors: str = "replace") -> str:
    return read_bounded(path).decode("utf-8", errors=errors)


def check_regular_files(run_dir: Path) -> None:
    """Refuse (ValueError, one line) a run directory whose files `report` reads include something that is not a
    regular file once symlinks are followed: an event log that is a FIFO would wait for a writer forever, one
    that links to /dev/zero would fill the memory."""
    import stat

    run_dir = Path(run_dir)
    candidates = [run_dir / n for n in (META_FILE, LAUNCHER_FILE, STATIC_FILE)]
    for folder in (EVENTS_DIR, LOGS_DIR, SOURCE_DIR):
        base = run_dir / folder
        if base.is_symlink():  # a run writes real folders: a link could lead the walk anywhere (/proc, /dev)
            raise ValueError(f"{base}: a link to {os.path.realpath(base)}, not a folder a run writes: the run "
                             "directory is damaged or not a ddpdoctor run")
        if base.is_dir():
            for root, dirs, files in os.walk(base):
                candidates.extend(Path(root) / f for f in files)
                candidates.extend(Path(root) / d for d in dirs if (Path(root) / d).is_symlink())
    for path in candidates:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue  # absent, or a dangling link: the reader says what is missing
        if stat.S_ISREG(mode) or (stat.S_ISDIR(mode) and path.parent != run_dir and not path.is_symlink()):
            continue
        what = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode) else
                "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "a directory" if stat.S_ISDIR(mode) else "not a regular file")
        link = f" (a link to {os.path.realpath(path)})" if path.is_symlink() else ""
        raise ValueError(f"{path}: {what}{link}, not a file a run writes: the run directory is damaged or not a "
                         "ddpdoctor run")


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    events: list[dict[str, Any]] = []
    bad = 0
    for raw in read_bounded(path).split(b"\n"):
        if len(raw) > MAX_EVENT_LINE:
            bad += 1
            continue
        line = raw.decode("utf-8", errors="replace").strip()
        if line:
            try:
                ev = json.loads(line)
            except ValueError:
                bad += 1  # a line cut short by a kill
                continue
            if isinstance(ev, dict) and "kind" in ev:
                events.append(ev)
            else:
                bad += 1
    return events, bad


_LOG_NAME = re.compile(r"^(?P<host>.*)-p(?P<pid>\d+)$")


def is_run_dir(path: Path) -> bool:
    """A directory `report` can read: ddpdoctor's marker, a meta.json or an events/ folder (runs recorded before the
    marker existed have no marker). Only the marker lets ddpdoctor *write* into one (ddpdoctor.probe.rundir)."""
    return (path / RUN_MARKER).is_file() or (path / META_FILE).is_file() or (path / EVENTS_DIR).is_dir()


def read_run(path: Path) -> RunData:
    """Read a run directory. Raises ValueError (one line) when `path` is not one."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    if not is_run_dir(path):
        raise ValueError(f"{path}: not a ddpdoctor run directory (no {META_FILE} or {EVENTS_DIR}/)")
    check_regular_files(path)
    meta: dict[str, Any] = {}
    if (path / META_FILE).is_file():
        try:
            meta = json.loads(read_text_bounded(path / META_FILE, "strict"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path / META_FILE}: unreadable: {exc}") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{path / META_FILE}: not a JSON object")
    schema = meta.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise ValueError(f"{path}: run recorded with schema {schema!r}; this ddpdoctor reads {SCHEMA!r}")
    launcher = None
    if (path / LAUNCHER_FILE).is_file():
        try:
            launcher = json.loads(read_text_bounded(path / LAUNCHER_FILE, "strict"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path / LAUNCHER_FILE}: unreadable: {exc}") from None
    static = None
    if (path / STATIC_FILE).is_file():
        try:
            static = json.loads(read_text_bounded(path / STATIC_FILE, "strict"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path / STATIC_FILE}: unreadable: {exc}") from None
    processes: list[ProcessLog] = []
    events_dir = path / EVENTS_DIR
    logs = sorted(events_dir.glob("*.jsonl")) if events_dir.is_dir() else []
    unreadable = 0
    if events_dir.is_dir():
        for log in logs:
            m = _LOG_NAME.match(log.stem)
            try:
                events, bad = _read_jsonl(log)
            except OSError:
                events, bad = [], 1
            if not events:
                unreadable += 1 if bad or log.stat().st_size else 0
                continue
            pid = int(m.group("pid")) if m else int(events[0].get("pid", 0))
            host = m.group("host") if m else ""
            stack_file = log.with_suffix(".stack")
            stack_text = None
            if stack_file.is_file():
                try:
                    stack_text = read_text_bounded(stack_file) or None
                except OSError:
                    stack_text = None
            processes.append(ProcessLog(log.stem, pid, host, events, stack_text, bad))
    if logs and not processes and unreadable:
        raise ValueError(f"{events_dir}: {unreadable} event log(s) and not one readable event: the run directory is "
                         "damaged")
    processes.sort(key=lambda p: (p.events[0].get("t", 0.0), p.pid))
    _check_blobs(events_dir, processes)
    return RunData(
        path=path,
        meta=RunMeta.from_json(meta),
        launcher=LaunchRecord.from_json(launcher) if isinstance(launcher, dict) else None,
        processes=processes,
        static=StaticRecord.from_json(static) if isinstance(static, (list, dict)) else None,
    )


def _blob_refs(value: Any, depth: int = 0) -> Iterator[dict[str, Any]]:
    """Blob references in an event's values (a dict with file/offset/nbytes), a few levels down."""
    if isinstance(value, dict):
        if {"file", "offset", "nbytes"} <= value.keys():
            yield value
        elif depth < 3:
            for v in value.values():
                yield from _blob_refs(v, depth + 1)
    elif isinstance(value, list) and depth < 3:
        for v in value[:64]:
            yield from _blob_refs(v, depth + 1)


def _check_blobs(events_dir: Path, processes: list[ProcessLog]) -> None:
    """Every binary measurement an event refers to is there: a missing or truncated side file would silently drop
    the findings that need it, so the run directory is refused instead (one line)."""
    sizes: dict[str, int | None] = {}
    missing: dict[str, int] = {}
    for p in processes:
        for e in p.events:
            for ref in _blob_refs({k: v for k, v in e.items() if k not in BASE_FIELDS}):
                name = Path(str(ref.get("file"))).name
                if name not in sizes:
                    f = events_dir / name
                    sizes[name] = f.stat().st_size if f.is_file() else None
                try:
                    end = int(ref["offset"]) + int(ref["nbytes"])
                except (TypeError, ValueError):
                    end = -1
                if sizes[name] is None or end < 0 or end > (sizes[name] or 0):
                    missing[name] = missing.get(name, 0) + 1
    if missing:
        name, n = next(iter(sorted(missing.items())))
        what = "missing" if sizes.get(name) is None else "truncated"
        more = f" (and {len(missing) - 1} more side file(s))" if len(missing) > 1 else ""
        raise ValueError(
            f"{events_dir / name}: {what}, {n} recorded measurement(s) refer to it{more}: the run directory is "
            "damaged (findings that need those measurements would be missing)"
        )


def find_run_dirs(paths: Sequence[Path]) -> list[Path]:
    """The run directories `paths` name: each path is a run directory, or a directory whose immediate
    subdirectories are run directories (`run/` holding `run/node0`, `run/node1` from `--out run/node$NODE`).
    Raises ValueError (one line) when a path is neither."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise ValueError(f"{path}: not a directory")
        if is_run_dir(path):
            found.append(path)
            continue
        children = sorted(c for c in path.iterdir() if c.is_dir() and is_run_dir(c))
        if not children:
            raise ValueError(
                f"{path}: not a ddpdoctor run directory (no {META_FILE} or {EVENTS_DIR}/), nor a directory of them"
            )
        found.extend(children)
    unique: list[Path] = []
    for p in found:
        if all(p.resolve() != q.resolve() for q in unique):
            unique.append(p)
    return unique


def _job_of(p: ProcessLog) -> str | None:
    """The launcher's id of the job a process belonged to (torchrun's run id, SLURM's job.step), if it said."""
    from ddpdoctor.world import place_from_env

    env = p.start.get("env")
    return place_from_env(env).job if isinstance(env, dict) else None


def read_runs(paths: Sequence[Path]) -> RunData:
    """One run recorded in one directory or several (attach mode writes one per node when each node's launcher is
    given its own `--out`): the directories' processes analysed together, as one run. Raises ValueError (one
    line) when a path is not a run directory or the directories hold different runs."""
    dirs = find_run_dirs(paths)
    if len(dirs) == 1:
        return read_run(dirs[0])
    runs = [read_run(d) for d in dirs]
    jobs = {job for run in runs for p in run.processes if (job := _job_of(p)) not in (None, "", "none")}
    if len(jobs) > 1:
        raise ValueError(f"{', '.join(map(str, dirs))}: not one run: they were recorded by different jobs "
                         f"({', '.join(sorted(jobs))})")
    owners: dict[int, Path] = {}
    for run in runs:
        for rank in run.rank_processes:
            if rank in owners:
                raise ValueError(f"{owners[rank]} and {run.path}: not one run: both hold a process of rank {rank}")
            owners[rank] = run.path
    names: dict[str, Path] = {}
    for run in runs:
        for p in run.processes:
            if p.name in names:
                raise ValueError(f"{run.path} and {names[p.name]} both hold the log of process {p.name}: the same "
                                 "directory given twice, or copies of one")
            names[p.name] = run.path
    # the directory of rank 0 (its meta.json, static findings and launcher record) speaks for the run
    lead = next((run for run in runs if 0 in run.rank_processes), runs[0])
    meta = lead.meta.to_json()
    meta["nproc"] = max((int(r.meta.nproc or 0) for r in runs), default=0) or lead.meta.nproc
    starts = [r.meta.started for r in runs if isinstance(r.meta.started, (int, float))]
    if starts:
        meta["started"] = min(starts)
    meta["parts"] = [str(r.path) for r in runs]
    processes = [p for run in runs for p in run.processes]
    processes.sort(key=lambda p: (p.events[0].get("t", 0.0), p.pid))
    return RunData(
        path=lead.path,
        meta=RunMeta.from_json(meta),
        launcher=lead.launcher,
        processes=processes,
        static=next((r.static for r in [lead, *runs] if r.static is not None), None),
        parts=tuple((r.path, r.meta) for r in runs),
        blob_dirs={f.name: run.path for run in runs for f in (run.path / EVENTS_DIR).glob("*.bin")},
    )


# ---------------------------------------------------------------------------------------------------------
# faulthandler stack dumps

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.I)
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')


def parse_stack_dump(text: str) -> list[list[dict[str, Any]]]:
    """Every dump in a faulthandler stack file → list of dumps; each dump is a list of threads
    `{"thread": "0x..", "current": bool, "frames": [{"file","line","function"}, ...] innermost first}`."""
    dumps: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] | None = None
    thread: dict[str, Any] | None = None
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            if current is None or (thread is not None and any(t["thread"] == m.group(2) for t in current)):
                current = []
                dumps.append(current)
            thread = {"thread": m.group(2).lower(), "current": m.group(1).lower().startswith("current"), "frames": []}
            current.append(thread)
            continue
        f = _FRAME.match(line)
        if f and thread is not None:
            thread["frames"].append(
                {"file": f.group("file"), "line": int(f.group("line")), "function": f.group("func")}
            )
    return dumps


def rle_expand(pairs: list[list[int]] | None) -> list[int]:
    """[[size, repeat], ...] → [size, size, ...]."""
    out: list[int] = []
    for pair in pairs or ():
        size, n = int(pair[0]), int(pair[1])
        out.extend([size] * n)
    return out
