"""Copies of the user's source files in the run directory, so that a recorded run is a complete input.

Analyses read user source (DD206 parses the file around a stuck frame); a run directory replayed in CI, or on a
machine where the recording checkout does not exist, must not depend on the recorded absolute paths. The launcher
copies the script before the run and, after it, every user file the run names (sites, tracebacks, stack dumps);
attach mode copies the script (no process there sees the whole run at its end). The copies live under `source/`
at their path relative to the user's working directory, and meta.json `sources` maps recorded paths to them.

Bounded: at most MAX_FILES files of at most MAX_FILE_BYTES each and MAX_TOTAL_BYTES together, the script first,
then the files the run names most often. No torch here: the launcher process runs this.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

from ddpdoctor.events import EVENTS_DIR, LOGS_DIR, SOURCE_DIR
from ddpdoctor.rundata import parse_stack_dump

MAX_FILES = 64
MAX_FILE_BYTES = 1 << 20
MAX_TOTAL_BYTES = 8 << 20
OUTSIDE = "_outside"  # files outside the user's working directory

_TRACEBACK_FILE = re.compile(r'File "(?P<file>[^"<>]+)", line \d+')
_LOG_TAIL_BYTES = 256 << 10


def snapshot_name(path: str, cwd: str) -> str:
    """Where a file's copy goes, relative to `source/`: its path relative to the working directory when inside
    it, else `_outside/<file name>`."""
    absolute = os.path.normpath(os.path.join(cwd, path))
    rel = os.path.relpath(absolute, cwd)
    if rel.startswith(".." + os.sep) or rel == ".." or os.path.isabs(rel):
        return f"{OUTSIDE}/{os.path.basename(absolute)}"
    return rel.replace(os.sep, "/")


def snapshot(run_dir: Path, files: Iterable[str], *, cwd: str, taken: dict[str, str] | None = None) -> dict[str, str]:
    """Copy `files` (recorded paths, relative ones resolved against `cwd`) into `run_dir/source/`. Returns
    {recorded path: "source/<name>"} for every copy, those in `taken` included; a file that cannot be read, is
    not a regular file, or would exceed the bounds is left out."""
    out = dict(taken or {})
    run_dir = Path(run_dir)
    by_target: dict[str, str] = {}  # the absolute file already copied -> its name
    used: set[str] = set(out.values())
    total = 0
    for recorded, rel in out.items():
        by_target[os.path.realpath(os.path.join(cwd, recorded))] = rel
        try:
            total += (run_dir / rel).stat().st_size
        except OSError:
            pass
    for recorded in files:
        if not recorded or recorded in out:
            continue
        absolute = os.path.join(cwd, recorded)
        real = os.path.realpath(absolute)
        if real in by_target:  # the same file under another spelling (a symlink, a relative path)
            out[recorded] = by_target[real]
            continue
        if len(by_target) >= MAX_FILES:
            break
        try:
            if not os.path.isfile(real):
                continue
            size = os.path.getsize(real)
            if size > MAX_FILE_BYTES or total + size > MAX_TOTAL_BYTES:
                continue
            data = Path(real).read_bytes()
        except OSError:
            continue
        name = _unique(f"{SOURCE_DIR}/{snapshot_name(absolute, cwd)}", used)
        if not _write(run_dir / name, data):
            continue
        used.add(name)
        by_target[real] = name
        out[recorded] = name
        total += len(data)
    return out


def _unique(name: str, used: set[str]) -> str:
    if name not in used:
        return name
    stem, dot, suffix = name.rpartition(".")
    if not dot or "/" in suffix:
        stem, suffix = name, ""
    n = 2
    while True:
        candidate = f"{stem}-{n}.{suffix}" if suffix else f"{stem}-{n}"
        if candidate not in used:
            return candidate
        n += 1


def _write(path: Path, data: bytes) -> bool:
    """Atomic: several processes may copy the same file at once (attach mode), a killed one leaves no half file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------- files a run names


def referenced_files(run_dir: Path) -> list[str]:
    """The source files a recorded run names — event sites and user frames, exception tracebacks, faulthandler
    stack dumps, tracebacks in the ranks' stderr — most often named first, as recorded (not filtered)."""
    counts: Counter[str] = Counter()
    events_dir = Path(run_dir) / EVENTS_DIR
    for log in sorted(events_dir.glob("*.jsonl")):
        try:
            with log.open("r", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if '"file"' not in line and '"frames"' not in line and '"script_start"' not in line:
                        continue
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    counts.update(_files_in(event))
        except OSError:
            continue
    for stack in sorted(events_dir.glob("*.stack")):
        counts.update(_files_in_stacks(_read_tail(stack)))
    for log in sorted((Path(run_dir) / LOGS_DIR).glob("*.stderr")):
        text = _read_tail(log)
        counts.update(_files_in_stacks(text))
        counts.update(m.group("file") for m in _TRACEBACK_FILE.finditer(text))
    return [f for f, _ in counts.most_common()]


def _files_in(event: dict[str, Any]) -> Iterator[str]:
    if event.get("kind") == "script_start" and isinstance(event.get("script"), str):
        yield event["script"]
    if event.get("kind") == "exception":
        for frame in event.get("frames") or ():
            if isinstance(frame, (list, tuple)) and frame and isinstance(frame[0], str):
                yield frame[0]
    yield from _sites(event, 0)


def _sites(value: Any, depth: int) -> Iterator[str]:
    """`file` of every {file, line, ...} dict in an event (blob references have no `line`)."""
    if depth > 6:
        return
    if isinstance(value, dict):
        file = value.get("file")
        if isinstance(file, str) and "line" in value:
            yield file
        for v in value.values():
            if isinstance(v, (dict, list)):
                yield from _sites(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, (dict, list)):
                yield from _sites(v, depth + 1)


def _files_in_stacks(text: str) -> Iterator[str]:
    for dump in parse_stack_dump(text):
        for thread in dump:
            for frame in thread["frames"]:
                yield frame["file"]


def _read_tail(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _LOG_TAIL_BYTES))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def snapshot_run(run_dir: Path, *, cwd: str, script: str, taken: dict[str, str] | None = None) -> dict[str, str]:
    """After a run: copy the script (if not yet) and every user file the run names (ddpdoctor's own code, the
    standard library and installed packages are not user code). Returns meta.json `sources`."""
    from ddpdoctor.probe.session import is_user_file

    names = [f for f in referenced_files(run_dir) if not f.startswith("<") and is_user_file(os.path.join(cwd, f))]
    return snapshot(run_dir, [script, *names], cwd=cwd, taken=taken)
