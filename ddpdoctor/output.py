"""Writing the report to `--output FILE` without ever destroying what the user is analysing.

`--output` is refused (one line, exit 2, before anything runs) when it resolves — through `..`, an absolute path
or a symlink — to the script being analysed, to another file the run names (a project module a finding points at,
a file given as a script argument, the pyproject.toml the options come from, a source file a recorded run names),
or to anything inside a run directory (`--keep-run DIR`, or the directory `report` reads). The report is written
to a temporary file next to the target and moved over it in one step, so an interrupted write never leaves a
half-written file, and a symlinked target stays a symlink to the rewritten file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ddpdoctor.errors import UsageError


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _is_within(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


def check_output(output: Path, *, protected: Iterable[tuple[Path, str]] = (), run_dirs: Iterable[Path] = ()) -> Path:
    """The file `--output` will write (symlinks resolved); UsageError when that would destroy something.
    `protected`: (path, what it is) pairs; `run_dirs`: directories nothing may be written into."""
    target = _resolved(output)
    if target.is_dir():
        raise UsageError(f"--output {output}: is a directory")
    if not target.parent.is_dir():
        raise UsageError(f"--output {output}: no such directory {target.parent}")
    for path, what in protected:
        try:
            same = target == _resolved(path) or (target.exists() and os.path.samefile(target, path))
        except OSError:
            same = False
        if same:
            raise UsageError(f"--output {output}: is {what} ({path}); ddpdoctor never overwrites it")
    for folder in run_dirs:
        if _is_within(target, _resolved(folder)):
            raise UsageError(f"--output {output}: inside the run directory {folder}; write the report elsewhere")
    return target


def write_output(text: str, output: Path, target: Path | None = None) -> None:
    """Write `text` to `output` atomically (temporary file in the same folder, then one rename)."""
    target = target or _resolved(output)
    data = (text if text.endswith("\n") else text + "\n").encode("utf-8")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise UsageError(f"--output {output}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        try:
            os.chmod(tmp, target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask())
        except OSError:
            pass
        os.replace(tmp, target)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise UsageError(f"--output {output}: {exc.strerror or exc}") from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
