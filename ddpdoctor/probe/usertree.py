"""The safety net under the write redirection: fingerprint the user's files before the run and after it, and say
which ones changed anyway.

ddpdoctor.probe.fsview redirects what the script writes through Python's file functions. Native code with its own
file calls (HDF5, a C++ logger) and programs the script runs that are not Python write where they like. This
module cannot stop them; it makes sure such a write is never silent: the folders the script most likely touches
— its working directory and the script's own folder — are fingerprinted (path → type and permission bits, size,
modification time, inode)
before the launch and compared after it. Bounded: at most MAX_ENTRIES entries, MAX_DEPTH levels and MAX_SECONDS
per fingerprint, shallow levels first (a checkpoint beside the script is seen before the depths of a dataset); the run
directory and the run's temporary folder are skipped, and so are trees that tools, not the user, keep: virtual
environments (a folder with `pyvenv.cfg` or `conda-meta`), version-control stores and caches (TOOL_DIRS). A
project's `.venv` alone held 37,000 entries: the walk took 0.6 s before and 0.7 s after every launch and still ran
out of entries before reaching the user's own folders. A bounded fingerprint says so.
"""

from __future__ import annotations

import os
import stat
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ddpdoctor.events import RUN_MARKER
from ddpdoctor.live import Neighbours

MAX_ENTRIES = 20_000
MAX_DEPTH = 8
MAX_SECONDS = 2.0
SHOWN = 20  # paths listed per kind of change
# folders that tools fill and empty on their own: a change there is not a change to the user's files
TOOL_DIRS = frozenset({
    ".git", ".hg", ".svn", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox", ".nox",
    "node_modules", ".ipynb_checkpoints",
})
ENV_MARKERS = ("pyvenv.cfg", "conda-meta")  # a folder holding one of these is a Python environment


@dataclass
class Fingerprint:
    roots: list[str]
    entries: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)  # path → (mode, size, mtime, ino)
    complete: bool = True
    tool_dirs: list[str] = field(default_factory=list)  # left out: environments, VCS stores, caches
    own_files: frozenset[tuple[int, int]] = frozenset()  # (device, inode) of ddpdoctor's own output files


def own_output_files() -> frozenset[tuple[int, int]]:
    """ddpdoctor's stdout and stderr when they are files (`ddpdoctor check train.py > report.txt 2> log.txt` in the
    project folder): they grow during the run by ddpdoctor's own hand, not the script's."""
    out = set()
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.add((st.st_dev, st.st_ino))
    return frozenset(out)


def fingerprint(roots: list[str], skip: list[str], own: frozenset[tuple[int, int]] | None = None) -> Fingerprint:
    """What is in `roots` now (symlinks are not followed; `skip` subtrees, tool folders, environments and
    ddpdoctor's own output files and other ddpdoctor runs' directories are left out), breadth first."""
    skipped = {os.path.realpath(s) for s in skip if s}
    fp = Fingerprint(roots=[], own_files=own_output_files() if own is None else own)
    end = time.monotonic() + MAX_SECONDS
    seen: set[str] = set()
    for root in roots:
        real = os.path.realpath(root)
        if real in seen or not os.path.isdir(real):
            continue
        seen.add(real)
        fp.roots.append(real)
        # every path below is real too: the walk never enters a symlink (stat without following)
        queue = deque([(real, 0)])
        while queue:
            d, depth = queue.popleft()
            try:
                with os.scandir(d) as it:
                    entries = list(it)
            except OSError:
                continue
            if d != real and any(e.name in ENV_MARKERS for e in entries):
                fp.tool_dirs.append(d)
                continue
            for e in entries:
                if len(fp.entries) >= MAX_ENTRIES or time.monotonic() > end:
                    fp.complete = False
                    return fp
                path = e.path
                if path in skipped:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if fp.own_files and (st.st_dev, st.st_ino) in fp.own_files:
                    continue
                if stat.S_ISDIR(st.st_mode) and os.path.isfile(os.path.join(path, RUN_MARKER)):
                    continue  # another ddpdoctor's run directory (`--keep-run` in the same folder): its files
                fp.entries[path] = _entry(st)  # a folder left out still counts as there or not
                if stat.S_ISDIR(st.st_mode):
                    if e.name in TOOL_DIRS:
                        if e.name != "__pycache__":  # one beside every package: not worth a line
                            fp.tool_dirs.append(path)
                    elif depth + 1 < MAX_DEPTH:
                        queue.append((path, depth + 1))
                    else:
                        fp.complete = False
    return fp


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _entry(st: os.stat_result) -> tuple[int, int, int, int]:
    """(type and permission bits, size, modification time, inode): a `chmod 000` changes no byte and no time but
    is a change to the user's file all the same."""
    if stat.S_ISDIR(st.st_mode):
        return (st.st_mode, 0, 0, st.st_ino)  # a folder's size and time change with its entries: those are compared
    return (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)


def changes(before: Fingerprint, skip: list[str], others: Neighbours | None = None) -> dict[str, Any]:
    """What changed since `before`, as JSON for launcher.json `user_tree`. Every path of `before` is looked at
    again (modified, deleted: exact); new paths come from a second walk, listed only when both walks were
    complete (a bounded walk cannot tell a new file from one it did not reach the first time). `others`: the
    output files of other ddpdoctor processes running beside this one (ddpdoctor.live), not the script's."""
    others = others or Neighbours()
    others.look()
    modified, deleted = [], []
    for path, old in before.entries.items():
        try:
            st = os.lstat(path)
        except OSError:
            if not others.wrote(path, None):
                deleted.append(path)
            continue
        if _entry(st) != old and not others.wrote(path, st):  # a folder: its permissions (or it was replaced)
            modified.append(path)
    after = fingerprint(before.roots, skip, own=before.own_files)
    complete = before.complete and after.complete
    # a bytecode cache appearing is the interpreter's doing for whatever module was imported (ddpdoctor's own,
    # when it is installed from the project's folder, on a first run): never a change to the user's files
    created = sorted(p for p in after.entries if p not in before.entries and os.path.basename(p) != "__pycache__"
                     and not others.wrote(p, _lstat(p))) if complete else []
    modified.sort()
    deleted.sort()
    return {
        "roots": before.roots,
        "entries": len(before.entries),
        "complete": complete,
        "left_out": before.tool_dirs[:SHOWN],
        "modified": modified[:SHOWN],
        "deleted": deleted[:SHOWN],
        "created": created[:SHOWN],
        "counts": {"modified": len(modified), "deleted": len(deleted), "created": len(created)},
    }
