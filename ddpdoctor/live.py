"""What the ddpdoctor processes running right now write into the user's folders, so that a probe's before/after
fingerprint of those folders (ddpdoctor.probe.usertree) does not blame the script for another ddpdoctor's files.

Two `ddpdoctor check` runs in one folder (`ddpdoctor check a.py > a.txt & ddpdoctor check b.py -o b.json`): each
one's stdout file grows and its report appears while the other one's probe runs. Each ddpdoctor process keeps
one small entry in a per-user folder of the temporary directory, TMP/ddpdoctor-live-<uid>/<pid>.json: the
(device, inode) of its stdout and stderr when they are files, and the `--output` file it will write (with the
temporary file beside it that write_output renames over it). The entry goes when the process exits (atexit; an
entry whose process is gone, after a SIGKILL, is removed by the next reader), and the folder with the last one.

A probe reads the entries before its first fingerprint, while its ranks run and before its second fingerprint
(`Neighbours.look`), and keeps everything it saw: another run's entry lives from its start to its end, longer
than the few seconds between two looks, and it writes its report before it ends.

Announced by `run_probe` (this process's stdout and stderr) and by `check_output` (the --output file, checked
before anything runs). Stdlib only.
"""

from __future__ import annotations

import atexit
import json
import os
import stat
import tempfile
from typing import Any

_STATE: dict[str, Any] = {"files": [], "paths": [], "folder": None}


def _folder() -> str:
    """The folder of the entries (the one this process announced into, once it has)."""
    if _STATE["folder"]:
        return str(_STATE["folder"])
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"ddpdoctor-live-{uid}")


def _entry_path() -> str:
    return os.path.join(_folder(), f"{os.getpid()}.json")


def own_output_files() -> list[tuple[int, int]]:
    """(device, inode) of this process's stdout and stderr when they are regular files."""
    out = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((st.st_dev, st.st_ino))
    return out


def announce(output: str | os.PathLike[str] | None = None) -> None:
    """Record this process's output files (its stdout/stderr; `output`: the report file it will write)."""
    if output is not None:
        path = os.path.abspath(os.fspath(output))
        if path not in _STATE["paths"]:
            _STATE["paths"].append(path)
    _STATE["files"] = own_output_files()
    if not _STATE["files"] and not _STATE["paths"]:
        return
    folder = _folder()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if os.stat(folder).st_uid != (os.getuid() if hasattr(os, "getuid") else 0):
            return  # not ours: another user made it first
        tmp = _entry_path() + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"pid": os.getpid(), "files": _STATE["files"], "paths": _STATE["paths"]}, fh)
        os.replace(tmp, _entry_path())
    except OSError:
        return  # a read-only temporary directory: the other runs may blame a script for our files, nothing worse
    if not _STATE["folder"]:
        _STATE["folder"] = folder
        atexit.register(withdraw)


def withdraw() -> None:
    """Remove this process's entry (and the folder when it was the last one)."""
    for path in (_entry_path(), _entry_path() + ".tmp"):
        try:
            os.unlink(path)
        except OSError:
            pass
    try:
        os.rmdir(_folder())
    except OSError:
        pass  # another run's entry is there (or none of ours ever was)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class Neighbours:
    """The output files of the other ddpdoctor processes seen so far (see the module docstring)."""

    def __init__(self) -> None:
        self.files: set[tuple[int, int]] = set()
        self.paths: set[str] = set()

    def look(self) -> None:
        folder = _folder()
        try:
            names = os.listdir(folder)
        except OSError:
            return
        me = os.getpid()
        stale = False
        for name in names:
            stem = name[: -len(".json")] if name.endswith(".json") else ""
            if not stem.isdigit() or int(stem) == me:
                continue
            path = os.path.join(folder, name)
            if not _alive(int(stem)):
                try:
                    os.unlink(path)  # left by a run killed with SIGKILL
                    stale = True
                except OSError:
                    pass
                continue
            try:
                with open(path, encoding="utf-8") as fh:
                    data = json.load(fh)
            except (OSError, ValueError):
                continue
            self.files.update((int(d), int(i)) for d, i in data.get("files") or ())
            self.paths.update(str(p) for p in data.get("paths") or ())
        if stale and folder != _STATE["folder"]:
            try:
                os.rmdir(folder)  # that was the last entry
            except OSError:
                pass

    def wrote(self, path: str, st: os.stat_result | None) -> bool:
        """`path` (with its stat, None when it is gone) is another ddpdoctor's output: its stdout or stderr file,
        its --output report, or the temporary file that report is written to first."""
        if st is not None and (st.st_dev, st.st_ino) in self.files:
            return True
        if path in self.paths:
            return True
        folder, name = os.path.split(path)
        return any(
            os.path.dirname(p) == folder and name.startswith(f".{os.path.basename(p)}.") and name.endswith(".tmp")
            for p in self.paths
        )
