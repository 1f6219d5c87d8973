"""Writing the report to `--output FILE` without ever destroying what the user is analysing.

`--output` is refused (one line, exit 2, before anything runs) when it resolves — through `..`, an absolute path
or a symlink — to the script being analysed, to another file the run names (a project module a finding points at,
a file given as a script argument, the pyproject.toml the options come from, the model's module of `compare-bn`,
a source file a recorded run names), or to anything inside a run directory (`--keep-run DIR`, or the directory
`report` reads).

How it is written depends on what the target is:

- `-`, `/dev/stdout`, `/dev/stderr`, `/dev/fd/N`, `/proc/self/fd/N`: the process's own descriptor N, written as
  the shell handed it over (a pipe, a terminal, a file opened with `>` or `>>`), never reopened or replaced;
- anything else that exists and is not a regular file (a character or block device, a FIFO, a socket): opened
  and written in place, as `> TARGET` in a shell would (a FIFO waits for its reader); the node itself stays;
- a regular file, or a new name: written to a temporary file next to the target and moved over it in one step,
  so an interrupted write never leaves a half-written file, and a symlinked target stays a symlink to the
  rewritten file.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from ddpdoctor.errors import UsageError
from ddpdoctor.plain import FrozenRecord

# names of an already open descriptor of this process: written through it, never reopened (compiled by `re` on
# the first `--output FILE`, not when the module is imported: `check --static` writes to stdout)
_OWN_FD = (r"^(?:/dev/(?:fd/(?P<fd>\d+)|(?P<std>stdout|stderr))|/proc/(?:self|thread-self|\d+)/fd/"
           r"(?P<pfd>\d+))$")


class Target(FrozenRecord):
    """Where a report goes: `fd` (an open descriptor of this process), `node` (a non-regular file written in
    place), else `path` (a regular file, replaced atomically)."""

    __match_args__ = ("path", "fd", "node")
    path: Path
    fd: int | None
    node: bool

    def __init__(self, path: Path, fd: int | None = None, node: bool = False) -> None:
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "fd", fd)
        object.__setattr__(self, "node", node)


def is_stdout(output: Path | str | None) -> bool:
    """`--output -`: the report on standard output, as without `--output`."""
    return output is not None and str(output) == "-"


def _own_fd(output: Path) -> int | None:
    text = str(output)
    m = re.match(_OWN_FD, text)
    if m is None:
        return None
    if m.group("std"):
        return 1 if m.group("std") == "stdout" else 2
    if m.group("pfd") is not None and not text.startswith(("/proc/self/", "/proc/thread-self/")):
        pid = text.split("/")[2]
        if int(pid) != os.getpid():
            return None  # another process's descriptor: a path like any other
    return int(m.group("fd") or m.group("pfd"))


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _is_within(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


def _node(path: Path) -> bool:
    """True when `path` exists (symlinks followed) and is neither a regular file nor a directory."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def check_output(output: Path, *, protected: Iterable[tuple[Path, str]] = (), run_dirs: Iterable[Path] = ()) -> Target:
    """Where `--output` will write; UsageError when that would destroy something. Opens nothing (a FIFO would
    wait for its reader). `protected`: (path, what it is) pairs; `run_dirs`: directories nothing may be written
    into."""
    if is_stdout(output):
        return Target(Path("-"), fd=1)
    fd = _own_fd(output)
    if fd is not None:
        try:
            os.fstat(fd)
        except OSError:
            raise UsageError(f"--output {output}: descriptor {fd} is not open") from None
        return Target(Path(output), fd=fd)
    target = _resolved(output)
    if target.is_dir():
        raise UsageError(f"--output {output}: is a directory")
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
    node = _node(output)
    if not node and not target.parent.is_dir():
        raise UsageError(f"--output {output}: no such directory {target.parent}")
    return Target(target, node=node)


def write_output(text: str, output: Path, target: Target | None = None) -> None:
    """Write `text` where `target` (check_output) says: through an open descriptor, in place into a device, FIFO
    or socket, else atomically over a regular file (temporary file in the same folder, then one rename)."""
    target = target or check_output(output)
    data = (text if text.endswith("\n") else text + "\n").encode("utf-8")
    if target.fd is not None:
        _write_fd(data, output, target.fd)
    elif target.node:
        _write_in_place(data, output)
    else:
        _write_atomic(data, output, target.path)


def _write_fd(data: bytes, output: Path, fd: int) -> None:
    import sys

    for stream in (sys.stdout, sys.stderr):  # what was printed before comes first
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    try:
        _write_all(fd, data)
    except BrokenPipeError:
        return  # the reader went away (`| head`): nothing more can reach it
    except OSError as exc:
        raise UsageError(f"--output {output}: {exc.strerror or exc}") from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_in_place(data: bytes, output: Path) -> None:
    """A device, FIFO or socket: written into, never unlinked or renamed over."""
    try:
        mode = os.stat(output).st_mode
        if stat.S_ISSOCK(mode):
            _send_to_socket(data, output)
            return
        fd = os.open(output, os.O_WRONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"--output {output}: {exc.strerror or exc}") from None
    try:
        _write_all(fd, data)
    except BrokenPipeError:
        pass
    except OSError as exc:
        raise UsageError(f"--output {output}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _send_to_socket(data: bytes, output: Path) -> None:
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(output))
            sock.sendall(data)
    except OSError as exc:
        if exc.errno != errno.EPROTOTYPE:
            raise
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:  # a datagram socket: one message
            sock.connect(str(output))
            sock.send(data)


def _write_atomic(data: bytes, output: Path, target: Path) -> None:
    import tempfile  # here: every command imports this module to print to stdout; tempfile brings `random` in

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
        if _node(target):  # became a device, FIFO or socket since it was checked: never replace one
            os.unlink(tmp)
            _write_in_place(data, output)
            return
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
