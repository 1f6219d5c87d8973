"""The script's file writes go under the run directory; the user's files stay exactly as they were.

Installed in every process of a `ddpdoctor check` run (ranks, the main process of a self-spawning script, the
processes they start that run Python), before the script runs; stdlib only. Not installed in attach mode: there
the user runs their own job under their own launcher, and its files go where it writes them.

Mapping (the decision, in one place):

    a write to P           → RUN/writes/<P>      P absolute and normalised (os.path.abspath: relative to the
                                                 script's current directory; symlinks not resolved), its
                                                 leading separator dropped: /home/u/proj/ckpt/last.pt is stored
                                                 as RUN/writes/home/u/proj/ckpt/last.pt
    a deletion of P        → RUN/deleted/<dir of P>/.wh.<name of P>   an empty "whiteout" file (overlay file
                                                 systems' convention): P, and everything below it, no longer
                                                 exists for the run; the user's P is untouched
    a directory re-created → RUN/deleted/<P>/.wh..opq   "opaque": the user's entries below P stay hidden
    after its deletion

Reads see the run's view: a redirected P reads RUN/writes/<P>; a whited-out P does not exist; otherwise the user's
P. Directory listings merge both (os.listdir/scandir, so glob, os.walk and pathlib too), and os.stat (so
os.path.exists/isfile/isdir/getsize, Path.exists) answers for the run's view. Modifying a file the user had
(append, r+, chmod, utime, truncate, rename, os.replace onto it) copies it into RUN/writes first
(copy-on-write). A script that saves a checkpoint and reloads it, checks `os.path.exists(ckpt)` to resume, lists
`glob("ckpt/*.pt")` for the latest epoch, or rotates old checkpoints with os.remove keeps working, and a second
probe of it starts from the user's files again, not from the first probe's.

Not redirected: paths inside the run directory, the run's own temporary directory (TMPDIR, removed with the run:
multiprocessing's sockets live there and must be real paths), /dev, /proc and /sys, and file descriptors.

Links the script makes: a symlink is kept as made (RUN/writes/<its path> → its target, verbatim) and resolved in
the run's view (View.virtual): a path through it is the path it points to, a relative target taken from the link's
folder in the user's tree — as the operating system resolves it for the script alone — so a write through a link
to a folder outside the project is redirected like a write there, never followed out of RUN/writes onto the
user's file. A hard link to a user's file links to the run's copy of it (made first): the user's inode is never
shared, and RUN/writes is one file system.

What it covers: builtins.open / io.open, os.open, os.stat/lstat/access/listdir/scandir, os.mkdir (so
os.makedirs), os.remove/unlink/rmdir/rename/replace (so shutil.move, shutil.rmtree, Path's methods), os.chmod,
os.fchmod/fchown and chmod/utime of a descriptor (the user's file it is open on), os.utime, os.truncate,
os.link/symlink, the xattr calls shutil.copy2 makes, and shutil's copies through them; sqlite3.connect (its C
side opens the database itself); torch.save/torch.load paths (their C++ side opens files itself) through
`map_write`/`map_read`, used by the checkpoint recorder. What escapes it: writes by native code with its own
file calls (HDF5, a C++ logger), and by programs the script runs that are not Python — the launcher fingerprints
the user's tree before and after the run (permission bits included) and reports any file changed anyway
(ddpdoctor.probe.usertree).

Each redirected operation is recorded once per path and process (`file_write` event: the path as the script
gave it, where it went, whether the user had a file there).

Size: one module (~1000 lines) because the view is one state (the run's folders, the library folders passed
through, what was recorded) and every patched call goes through the same three questions — is this path the
run's to redirect, where does a read of it go, where does a write go — that a split would scatter.
"""

from __future__ import annotations

import _io
import builtins
import errno
import io
import os
import shutil
import stat as stat_mod
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

WRITES_DIR = "writes"
DELETED_DIR = "deleted"
WHITEOUT = ".wh."
OPAQUE = ".wh..opq"
LINKS_MARKER = "links.made"  # a process of the run made a symlink: paths are resolved through the run's links
_PASS_PREFIXES = ("/dev", "/proc", "/sys")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

_ORIG: dict[str, Callable[..., Any]] = {}
_local = threading.local()


def _o(name: str) -> Callable[..., Any]:
    return _ORIG.get(name) or getattr(os, name)


class View:
    """The run's view of the file system (see the module docstring)."""

    def __init__(self, run_dir: str, scratch: str | None, record: Callable[[dict[str, Any]], None] | None) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.writes = os.path.join(self.run_dir, WRITES_DIR)
        self.deleted = os.path.join(self.run_dir, DELETED_DIR)
        self.links_marker = os.path.join(self.run_dir, LINKS_MARKER)
        self._writes_below = self.writes + os.sep
        roots = [p for p in (self.run_dir, scratch and os.path.abspath(scratch)) if p] + list(_PASS_PREFIXES)
        self.passthrough = tuple(roots)
        self._passthrough_below = tuple(p.rstrip(os.sep) + os.sep for p in roots)
        # reads of the interpreter's and the installed packages' files (thousands while torch imports) are not
        # looked up in the run's view; a write there is still redirected
        self._library_below = _library_dirs()
        # the folders above them (/, /home, the project holding a .venv...): os.path.realpath lstat()s each one
        # for every file it resolves; their own metadata is never the run's to change (listing them still merges)
        self._library_above = frozenset(
            a for d in self._library_below for a in _ancestors(d.rstrip(os.sep))
        )
        self.record = record
        self._recorded: set[tuple[str, str]] = set()
        self._has: dict[str, bool] = {}

    # -- paths
    def virtual(self, path: Any, dir_fd: int | None = None, *, reading: bool = False,
                metadata: bool = False, follow: bool = True) -> str | None:
        """The absolute path the run's view applies to, or None for what is passed through unchanged. `reading`:
        library files are read as they are; `metadata` (stat, lstat): so are the folders above them. Symlinks
        the run made are resolved here, in the run's view (`follow`: the last component too, as open and stat
        do; not as lstat, readlink, unlink, rename do)."""
        if isinstance(path, str):
            raw = path
        elif isinstance(path, int) or path is None:
            return None
        else:
            try:
                raw = os.fsdecode(os.fspath(path))
            except TypeError:
                return None
        if dir_fd is not None and not os.path.isabs(raw):
            try:
                raw = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), raw)
            except OSError:
                return None
        p = os.path.abspath(raw)
        if p.startswith(self._writes_below):
            # the script's current directory (or a dir_fd) is one of the run's own folders: a chdir into a folder
            # the script created, which exists only in RUN/writes. RUN/writes/<P> is P in the run's view, so that
            # "../data.txt" from there still reads the user's data.txt and a write to it is redirected as usual
            p = os.sep + p[len(self._writes_below):]
        if self._passed(p, reading, metadata):
            return None
        if self._links_made():  # after the checks above: the thousands of library reads pay nothing for it
            p = self._through_links(p, follow)
            if self._passed(p, reading, metadata):
                return None
        return p

    def _passed(self, p: str, reading: bool, metadata: bool) -> bool:
        if p in self.passthrough or p.startswith(self._passthrough_below):
            return True
        return reading and (p.startswith(self._library_below) or (metadata and p in self._library_above))

    def _links_made(self) -> bool:
        """A process of the run made a symlink (RUN/links.made exists; remembered once it does)."""
        return self._tree(self.links_marker)

    def note_link(self) -> None:
        if not self._tree(self.links_marker):
            _touch(self.links_marker)
            self._has[self.links_marker] = True

    def _through_links(self, p: str, follow: bool) -> str:
        """P with every symlink the run made on its way replaced by what it points to, resolved in the run's
        view: a link is kept as the script made it (RUN/writes/<its path> → its target, as written), and a
        relative target is taken relative to the link's own folder in the user's tree, never RUN/writes. A write
        through a link the run made to /elsewhere is then a write to /elsewhere, redirected like any other, not
        a write the operating system follows out of RUN/writes onto the user's file. The user's own symlinks
        are left to the operating system (a read through them reads what they point to; a write lands in
        RUN/writes under the path the script gave)."""
        for _hop in range(40):  # the kernel's limit on links in one lookup (ELOOP): a loop stays unresolved
            parts = p.lstrip(os.sep).split(os.sep)
            for i in range(1, len(parts) + 1):
                if i == len(parts) and not follow:
                    return p
                head = os.sep + os.sep.join(parts[:i])
                s = self.stored(head)
                try:
                    st = _o("lstat")(s)
                except OSError:
                    return p  # nothing of the run's below here: no link the run made either
                if stat_mod.S_ISLNK(st.st_mode):
                    target = os.fsdecode(_o("readlink")(s))
                    folder = os.path.dirname(head)
                    if not os.path.isabs(target):
                        with _Inside():  # ".." from a folder reached through the user's own symlink: the kernel's
                            folder = os.path.realpath(folder)  # answer, from the folder it really is
                    p = os.path.normpath(os.path.join(folder, target, *parts[i:]))
                    break
                if not stat_mod.S_ISDIR(st.st_mode):
                    return p
            else:
                return p
        return p

    def _tree(self, root: str) -> bool:
        """RUN/writes or RUN/deleted exists (once it does, it stays: remembered)."""
        if self._has.get(root):
            return True
        found = self._lexists(root)
        if found:
            self._has[root] = True
        return found

    def stored(self, p: str) -> str:
        return os.path.join(self.writes, p.lstrip(os.sep))

    def _whiteout(self, p: str) -> str:
        d, name = os.path.split(p)
        return os.path.join(self.deleted, d.lstrip(os.sep), WHITEOUT + name)

    def _opaque(self, d: str) -> str:
        return os.path.join(self.deleted, d.lstrip(os.sep), OPAQUE)

    def _lexists(self, p: str) -> bool:
        try:
            _o("lstat")(p)
            return True
        except OSError:
            return False

    def hidden(self, p: str) -> bool:
        """The user's P is not part of the run's view: deleted (itself or an ancestor), or below a directory the
        run deleted and re-created."""
        if not self._tree(self.deleted):
            return False
        parts = p.lstrip(os.sep).split(os.sep)
        for i in range(1, len(parts) + 1):
            head = os.sep + os.sep.join(parts[:i])
            if self._lexists(self._whiteout(head)):
                return True
            if i < len(parts) and self._lexists(self._opaque(head)):
                return True
        return False

    def user_visible(self, p: str) -> bool:
        """The user's own P exists and is part of the run's view."""
        return self._lexists(p) and not self.hidden(p)

    def read_path(self, p: str) -> str:
        """Where a read of P goes. A path that exists in neither place is returned as the user's, so the error
        the call raises names the path the script asked for."""
        if not self._tree(self.writes):
            return self.stored(p) if self.hidden(p) else p
        s = self.stored(p)
        if self._lexists(s):
            return s
        if self.hidden(p):
            return s  # does not exist: the call raises FileNotFoundError
        return p

    def exists(self, p: str) -> bool:
        return self._lexists(self.stored(p)) or self.user_visible(p)

    def is_dir(self, p: str, *, follow: bool = True) -> bool:
        """P is a folder in the run's view (`follow`: or a symlink to one)."""
        s = self.stored(p)
        if self._lexists(s):
            return os.path.isdir(s) if follow else stat_mod.S_ISDIR(_o("lstat")(s).st_mode)
        return self.user_visible(p) and stat_mod.S_ISDIR(_o("stat" if follow else "lstat")(p).st_mode)

    # -- writes
    def _parent_exists(self, p: str) -> bool:
        parent = os.path.dirname(p)
        return parent == p or self.is_dir(parent)

    def write_path(self, p: str, *, keep: bool, op: str, asked: Any, create: bool = True) -> str:
        """Where a write of P goes; `keep`: copy the user's file there first (the write modifies it)."""
        s = self.stored(p)
        if create and not self._parent_exists(p):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(asked))
        existed = self.user_visible(p)
        if not self._lexists(s):
            self._mirror_dirs(os.path.dirname(p))
            if keep and existed:
                if os.path.isdir(p):
                    _o("mkdir")(s)
                else:
                    _copy_file(p, s)
        self._undelete(p)
        self._note(op, p, asked, existed)
        return s

    def own_copy(self, p: str) -> str:
        """RUN/writes/<P>, made a copy of the user's P first when the run has none (not recorded as a write: the
        script did not change P; a hard link to it must not share the user's inode)."""
        s = self.stored(p)
        if not self._lexists(s) and self.user_visible(p):
            self._mirror_dirs(os.path.dirname(p))
            if os.path.isdir(p):
                raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), p)
            _copy_file(p, s)
        return s

    def _mirror_dirs(self, d: str) -> None:
        """Create RUN/writes/<d> (and its parents) so a redirected file has a folder."""
        _makedirs(self.stored(d))

    def _undelete(self, p: str) -> None:
        marker = self._whiteout(p)
        if self._lexists(marker):
            _o("unlink")(marker)
            if self._lexists(p) and os.path.isdir(p):  # re-created: the user's entries below stay deleted
                _makedirs(os.path.dirname(self._opaque(p)))
                _touch(self._opaque(p))

    def whiteout(self, p: str) -> None:
        marker = self._whiteout(p)
        _makedirs(os.path.dirname(marker))
        _touch(marker)

    def _note(self, op: str, p: str, asked: Any, existed: bool) -> None:
        if self.record is None or (op, p) in self._recorded:
            return
        self._recorded.add((op, p))
        try:
            given = os.fsdecode(os.fspath(asked))
        except TypeError:
            given = p
        self.record(
            {"op": op, "path": given, "abspath": p, "stored": os.path.relpath(self.stored(p), self.run_dir),
             "existed": existed}
        )

    # -- listing
    def names(self, p: str) -> list[str] | None:
        """Entries of directory P in the run's view, or None when it is not a directory there."""
        s = self.stored(p)
        out: dict[str, None] = {}
        found = False
        if self.user_visible(p) and os.path.isdir(p):
            found = True
            for name in _o("listdir")(p):
                if not self.hidden(os.path.join(p, name)):
                    out[name] = None
        if self._lexists(s) and os.path.isdir(s):
            found = True
            for name in _o("listdir")(s):
                out[name] = None
        return list(out) if found else None


def _library_dirs() -> tuple[str, ...]:
    """Folders of the standard library, the installed packages and ddpdoctor, each ending in a separator (not
    sys.prefix: a system Python's /usr would cover projects in /usr/src)."""
    import site
    import sysconfig

    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sysconfig.get_paths()
    dirs = {ours, *site.getsitepackages(), site.getusersitepackages(),
            *(paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    out = set()
    for d in dirs:
        if d:
            out.add(os.path.abspath(d).rstrip(os.sep) + os.sep)
            out.add(os.path.realpath(d).rstrip(os.sep) + os.sep)
    return tuple(sorted(out))


def _ancestors(d: str) -> list[str]:
    out = []
    while True:
        out.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            return out
        d = parent


def _makedirs(d: str) -> None:
    try:
        os.makedirs(d, exist_ok=True)
    except FileExistsError:
        pass


def _touch(path: str) -> None:
    _o("close")(_o("open")(path, os.O_WRONLY | os.O_CREAT, 0o644))


def _copy_file(src: str, dst: str) -> None:
    with _ORIG_OPEN(src, "rb") as fin, _ORIG_OPEN(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    try:
        shutil.copymode(src, dst)
    except OSError:
        pass


_ORIG_OPEN = builtins.open
_ORIG_FILEIO = io.FileIO
_VIEW: View | None = None
# writes in progress: files opened for writing and not yet closed, and native writes (torch.save) under way; the
# probe waits for them before it ends a process mid-script (Probe.end_run), so a checkpoint written by a
# background thread is complete in the run's copy
_OPEN_WRITES: weakref.WeakKeyDictionary[Any, threading.Thread] = weakref.WeakKeyDictionary()  # file → opener
_BUSY: dict[int, str] = {}
_BUSY_LOCK = threading.Lock()


def _opened(fh: Any) -> None:
    try:
        _OPEN_WRITES[fh] = threading.current_thread()
    except TypeError:  # an object without weak references: not followed
        pass


def in_flight(ending: threading.Thread | None = None) -> list[str]:
    """Paths being written right now by this process (through Python file objects or `writing`). With `ending`
    (the thread that ends the process): only files another thread still alive has open — a checkpoint a background
    thread is saving. A file the ending thread (or a finished one) left open, like a log file a logging handler
    keeps for the whole run, is not a write under way: waiting for it to close would wait for ever (hydra's main.log
    held every minGPT rank until the probe's timeout)."""
    names = []
    for fh, opener in list(_OPEN_WRITES.items()):
        try:
            if fh.closed:
                continue
        except ValueError:
            continue
        if ending is not None and (opener is ending or not opener.is_alive()):
            continue
        names.append(str(getattr(fh, "name", "?")))
    with _BUSY_LOCK:
        names.extend(_BUSY.values())
    return names


def flush_open_writes() -> None:
    """Flush what Python still buffers for files left open (the process ends with os._exit, which does not)."""
    for fh in list(_OPEN_WRITES.keys()):
        try:
            if not fh.closed:
                fh.flush()
        except Exception:  # a file another thread is closing, a broken pipe: nothing more can be done for it
            continue


class writing:  # used as a context manager, like open()
    """A native write under way (torch.save's C++ writer), so that `in_flight` sees it."""

    def __init__(self, path: Any) -> None:
        self.path = str(path)

    def __enter__(self) -> None:
        with _BUSY_LOCK:
            _BUSY[id(self)] = self.path

    def __exit__(self, *exc: object) -> None:
        with _BUSY_LOCK:
            _BUSY.pop(id(self), None)


def view() -> View | None:
    return _VIEW


class _Inside:
    """Our own file operations (copies, markers, the event writer) bypass the view."""

    def __enter__(self) -> None:
        _local.inside = getattr(_local, "inside", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.inside -= 1


def _active() -> View | None:
    if _VIEW is None or getattr(_local, "inside", 0):
        return None
    return _VIEW


# ------------------------------------------------------------------------------------------- the patches


def _is_write_mode(mode: str) -> bool:
    return any(c in mode for c in "wax+")


def _open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    v = _active()
    p = v.virtual(file, reading=not _is_write_mode(mode), follow="x" not in mode) if v is not None else None
    if p is None:
        return _ORIG_OPEN(file, mode, *args, **kwargs)
    with _Inside():
        if not _is_write_mode(mode):
            target = v.read_path(p)
        elif "x" in mode:
            if v.exists(p):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(os.fspath(file)))
            target = v.write_path(p, keep=False, op="create", asked=file)
        else:
            keep = "w" not in mode
            target = v.write_path(p, keep=keep, op="write" if "w" in mode else "modify", asked=file)
    fh = _ORIG_OPEN(target, mode, *args, **kwargs)
    if _is_write_mode(mode):
        _opened(fh)
    return fh


class _FileIOType(type):
    """isinstance(f, io.FileIO) stays true of every file object, also those made before the view was installed."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _ORIG_FILEIO)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _ORIG_FILEIO)


class _FileIO(_ORIG_FILEIO, metaclass=_FileIOType):
    """io.FileIO(path, mode) opens the file in C, past builtins.open: the same mapping as open()."""

    def __init__(self, file: Any, mode: str = "r", closefd: bool = True, opener: Any = None) -> None:
        v = _active()
        p = v.virtual(file, reading=not _is_write_mode(mode), follow="x" not in mode) if v is not None else None
        if p is not None:
            with _Inside():
                if not _is_write_mode(mode):
                    file = v.read_path(p)
                elif "x" in mode:
                    if v.exists(p):
                        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(os.fspath(file)))
                    file = v.write_path(p, keep=False, op="create", asked=file)
                else:
                    keep = "w" not in mode
                    file = v.write_path(p, keep=keep, op="write" if "w" in mode else "modify", asked=file)
        super().__init__(file, mode, closefd, opener)
        if _is_write_mode(mode):
            _opened(self)


_FileIO.__name__ = _FileIO.__qualname__ = "FileIO"
_FileIO.__module__ = "io"


def _os_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
    v = _active()
    exclusive = flags & os.O_CREAT and flags & os.O_EXCL
    follow = not (exclusive or flags & getattr(os, "O_NOFOLLOW", 0))
    p = v.virtual(path, dir_fd, reading=not flags & _WRITE_FLAGS, follow=follow) if v is not None else None
    if p is None:
        return _ORIG["open"](path, flags, mode, dir_fd=dir_fd)
    with _Inside():
        if not flags & _WRITE_FLAGS:
            target = v.read_path(p)
        elif flags & os.O_CREAT and flags & os.O_EXCL:
            if v.exists(p):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(os.fspath(path)))
            target = v.write_path(p, keep=False, op="create", asked=path)
        elif not flags & os.O_CREAT and not v.exists(p):
            target = p  # the call raises FileNotFoundError, as it would have
        else:
            keep = not flags & os.O_TRUNC
            target = v.write_path(p, keep=keep, op="modify" if keep else "write", asked=path)
            # the file exists in the run's view: a truncating open of it without O_CREAT makes the run's copy
            flags |= os.O_CREAT
    return _ORIG["open"](target, flags, mode)


def _reader(name: str) -> Callable[..., Any]:
    orig = _ORIG[name]

    metadata = name in ("stat", "lstat", "access", "readlink")
    never_follows = name in ("lstat", "readlink")

    def call(path: Any = ".", *args: Any, dir_fd: int | None = None, **kwargs: Any) -> Any:
        v = _active()
        follow = not never_follows and kwargs.get("follow_symlinks", True)
        p = v.virtual(path, dir_fd, reading=True, metadata=metadata, follow=follow) if v is not None else None
        if p is None:
            return orig(path, *args, dir_fd=dir_fd, **kwargs) if dir_fd is not None else orig(path, *args, **kwargs)
        with _Inside():
            target = v.read_path(p)
        return orig(target, *args, **kwargs)

    call.__name__ = name
    return call


def _modifier(name: str, op: str) -> Callable[..., Any]:
    """chmod, utime, truncate, setxattr...: a change to the user's file is a change to the run's copy."""
    orig = _ORIG[name]
    never_follows = name == "lchown"

    def call(path: Any, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> Any:
        v = _active()
        if v is not None and isinstance(path, int):  # os.chmod(fd, ...), os.utime(fd, ...): the file it is open on
            target = _fd_write_path(v, path, op)
            return orig(path if target is None else target, *args, **kwargs)
        follow = not never_follows and kwargs.get("follow_symlinks", True)
        p = v.virtual(path, dir_fd, follow=follow) if v is not None else None
        if p is None:
            return orig(path, *args, dir_fd=dir_fd, **kwargs) if dir_fd is not None else orig(path, *args, **kwargs)
        with _Inside():
            if not v.exists(p):
                target = p  # raises as it would have
            else:
                target = v.write_path(p, keep=True, op=op, asked=path, create=False)
        return orig(target, *args, **kwargs)

    call.__name__ = name
    return call


def _fd_write_path(v: View, fd: int, op: str) -> str | None:
    """A change made through a file descriptor (fchmod, fchown, futimes) to the file it is open on: the run's copy
    of that file when it is the user's (a descriptor opened for reading still points at the user's file), else
    None (the run's own file, or one passed through: the call goes to the descriptor)."""
    try:
        real = _o("readlink")(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if not os.path.isabs(real):  # a pipe, a socket, an anonymous file
        return None
    p = v.virtual(real, follow=False)
    if p is None:
        return None
    with _Inside():
        if not v.exists(p):
            return None  # deleted meanwhile: the descriptor's own file, which is not the user's to change
        return v.write_path(p, keep=True, op=op, asked=p, create=False)


def _fd_modifier(name: str, op: str) -> Callable[..., Any]:
    """os.fchmod / os.fchown: a change to the user's file through a descriptor is a change to the run's copy."""
    orig = _ORIG[name]

    def call(fd: int, *args: Any, **kwargs: Any) -> Any:
        v = _active()
        target = _fd_write_path(v, fd, op) if v is not None and isinstance(fd, int) else None
        if target is None:
            return orig(fd, *args, **kwargs)
        return _ORIG[name[1:]](target, *args, **kwargs)

    call.__name__ = name
    return call


def _listdir(path: Any = ".") -> list[Any]:
    v = _active()
    p = v.virtual(path, reading=True) if v is not None else None
    if p is None:
        return _ORIG["listdir"](path)
    with _Inside():
        names = v.names(p)
    if names is None:
        return _ORIG["listdir"](v.read_path(p))  # raises the right error
    return [os.fsencode(n) for n in names] if isinstance(path, bytes) else names


class _Entry:
    """A DirEntry under the name the script listed (the real one may live under RUN/writes)."""

    def __init__(self, entry: Any, parent: str) -> None:
        self._entry = entry
        self.name = entry.name
        self.path = os.path.join(parent, entry.name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._entry, name)

    # a symlink the run made lives in RUN/writes: what it points to is answered in the run's view (os.stat through
    # the view), not by the operating system from RUN/writes, where a relative target points elsewhere
    def stat(self, *, follow_symlinks: bool = True) -> Any:
        if follow_symlinks and self._entry.is_symlink():
            return os.stat(self.path)
        return self._entry.stat(follow_symlinks=follow_symlinks)

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        if follow_symlinks and self._entry.is_symlink():
            return self._followed(stat_mod.S_ISDIR)
        return self._entry.is_dir(follow_symlinks=follow_symlinks)

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        if follow_symlinks and self._entry.is_symlink():
            return self._followed(stat_mod.S_ISREG)
        return self._entry.is_file(follow_symlinks=follow_symlinks)

    def _followed(self, kind: Callable[[int], bool]) -> bool:
        try:
            return kind(os.stat(self.path).st_mode)
        except OSError:
            return False

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"<DirEntry {self.name!r}>"


class _Scandir:
    def __init__(self, entries: list[Any]) -> None:
        self._it: Iterator[Any] = iter(entries)

    def __iter__(self) -> _Scandir:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def close(self) -> None:
        self._it = iter(())

    def __enter__(self) -> _Scandir:  # noqa: PYI034 - 3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scandir(path: Any = ".") -> Any:
    v = _active()
    p = v.virtual(path, reading=True) if v is not None else None
    if p is None:
        return _ORIG["scandir"](path)
    with _Inside():
        stored = v.stored(p)
        has_user = v.user_visible(p) and os.path.isdir(p)
        has_stored = v._lexists(stored) and os.path.isdir(stored)
        if not has_user and not has_stored:
            return _ORIG["scandir"](v.read_path(p))  # raises the right error
        entries: dict[str, Any] = {}
        shown = os.fsdecode(os.fspath(path))
        if has_user:
            with _ORIG["scandir"](p) as it:
                for e in it:
                    if not v.hidden(os.path.join(p, e.name)):
                        entries[e.name] = _Entry(e, shown)
        if has_stored:
            with _ORIG["scandir"](stored) as it:
                for e in it:
                    entries[e.name] = _Entry(e, shown)
    return _Scandir(list(entries.values()))


def _mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
    v = _active()
    p = v.virtual(path, dir_fd, follow=False) if v is not None else None
    if p is None:
        return _ORIG["mkdir"](path, mode, dir_fd=dir_fd)
    with _Inside():
        if v.exists(p):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(os.fspath(path)))
        s = v.write_path(p, keep=False, op="mkdir", asked=path)
        _ORIG["mkdir"](s, mode)


def _remove(name: str) -> Callable[..., Any]:
    def call(path: Any, *, dir_fd: int | None = None) -> None:
        v = _active()
        p = v.virtual(path, dir_fd, follow=False) if v is not None else None
        if p is None:
            return _ORIG[name](path, dir_fd=dir_fd)
        with _Inside():
            _delete(v, p, path, directory=False)

    call.__name__ = name
    return call


def _rmdir(path: Any, *, dir_fd: int | None = None) -> None:
    v = _active()
    p = v.virtual(path, dir_fd, follow=False) if v is not None else None
    if p is None:
        return _ORIG["rmdir"](path, dir_fd=dir_fd)
    with _Inside():
        _delete(v, p, path, directory=True)


def _delete(v: View, p: str, asked: Any, *, directory: bool) -> None:
    given = os.fsdecode(os.fspath(asked))
    if not v.exists(p):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), given)
    is_dir = v.is_dir(p, follow=False)
    if directory and not is_dir:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), given)
    if not directory and is_dir:
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), given)
    if directory and v.names(p):
        raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), given)
    existed = v.user_visible(p)
    s = v.stored(p)
    if v._lexists(s):
        (_ORIG["rmdir"] if directory else _ORIG["unlink"])(s)
    if existed:
        v.whiteout(p)
    v._note("delete", p, asked, existed)


def _rename(name: str) -> Callable[..., Any]:
    def call(src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        v = _active()
        ps = v.virtual(src, src_dir_fd, follow=False) if v is not None else None
        pd = v.virtual(dst, dst_dir_fd, follow=False) if v is not None else None
        if v is None or (ps is None and pd is None):
            return _ORIG[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        with _Inside():
            source = ps if ps is not None else os.path.abspath(os.fsdecode(os.fspath(src)))
            if ps is not None and not v.exists(ps):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(os.fspath(src)))
            if pd is None:  # into the run directory or the run's temporary folder: a real move of the run's copy
                target = os.path.abspath(os.fsdecode(os.fspath(dst)))
            else:
                target = v.write_path(pd, keep=False, op="rename", asked=dst)
            if ps is None:
                _ORIG[name](source, target)
                return
            was_users = v.user_visible(ps)
            stored = v.stored(ps)
            if v.is_dir(ps):  # the folder as the run sees it: the user's entries and the run's, merged
                _copy_tree(v, ps, target)
                if v._lexists(stored):
                    shutil.rmtree(stored)
            elif v._lexists(stored):
                _ORIG["replace"](stored, target)
            else:
                if os.path.isdir(target):
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fsdecode(os.fspath(dst)))
                _copy_file(source, target)
            if was_users:
                v.whiteout(ps)
                v._note("delete", ps, src, True)

    call.__name__ = name
    return call


def _copy_tree(v: View, src: str, dst: str) -> None:
    """Copy directory `src` as the run sees it into `dst` (a rename of a directory the user had)."""
    os.makedirs(dst, exist_ok=True)
    for name in v.names(src) or ():
        child = os.path.join(src, name)
        target = os.path.join(dst, name)
        if v.is_dir(child):
            _copy_tree(v, child, target)
        else:
            _copy_file(v.read_path(child), target)


def _link(name: str) -> Callable[..., Any]:
    """os.link / os.symlink: the new name is a write.

    A symlink is made as the script wrote it (RUN/writes/<new name> → the target, verbatim, so os.readlink gives
    it back) and is resolved in the run's view by View.virtual: a write through it is redirected like a write to
    what it points to. A hard link shares the file: the user's file is first copied into RUN/writes (the run's
    copy, on the run directory's file system) and the new name links to that copy, so a write through either name
    changes the run's copy, both names see it, and the user's file (its inode) is never shared."""

    def call(src: Any, dst: Any, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> None:
        v = _active()
        pd = v.virtual(dst, dir_fd, follow=False) if v is not None else None
        if pd is None:
            return _ORIG[name](src, dst, *args, dir_fd=dir_fd, **kwargs) if dir_fd is not None else _ORIG[name](
                src, dst, *args, **kwargs)
        with _Inside():
            if v.exists(pd):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(os.fspath(dst)))
            if name == "symlink":
                target = v.write_path(pd, keep=False, op="create", asked=dst)
                v.note_link()
                return _ORIG[name](src, target, *args, **kwargs)
            kwargs.pop("src_dir_fd", None)
            follow = kwargs.pop("follow_symlinks", True)
            ps = v.virtual(src, follow=follow)
            if ps is None:
                source = os.fsdecode(os.fspath(src))
            else:
                if not v.exists(ps):
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(os.fspath(src)))
                source = v.own_copy(ps)
            target = v.write_path(pd, keep=False, op="create", asked=dst)
            try:
                _ORIG[name](source, target, follow_symlinks=False)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                _copy_file(source, target)  # the run's temporary folder on another file system: a copy

    call.__name__ = name
    return call


_READERS = ("stat", "lstat", "access", "readlink", "listxattr", "getxattr", "chdir", "statvfs", "pathconf")
_MODIFIERS = {"chmod": "modify", "chown": "modify", "lchown": "modify", "utime": "modify", "truncate": "modify",
              "setxattr": "modify", "removexattr": "modify"}
_FD_MODIFIERS = {"fchmod": "modify", "fchown": "modify"}


def _patches() -> dict[tuple[Any, str], Callable[..., Any]]:
    out: dict[tuple[Any, str], Callable[..., Any]] = {
        (builtins, "open"): _open,
        (io, "open"): _open,
        (_io, "open"): _open,
        (io, "FileIO"): _FileIO,
        (_io, "FileIO"): _FileIO,
        (os, "open"): _os_open,
        (os, "listdir"): _listdir,
        (os, "scandir"): _scandir,
        (os, "mkdir"): _mkdir,
        (os, "rmdir"): _rmdir,
    }
    for name in ("remove", "unlink"):
        out[(os, name)] = _remove(name)
    for name in ("rename", "replace"):
        out[(os, name)] = _rename(name)
    for name in ("link", "symlink"):
        if hasattr(os, name):
            out[(os, name)] = _link(name)
    for name in _READERS:
        if hasattr(os, name):
            out[(os, name)] = _reader(name)
    for name, op in _MODIFIERS.items():
        if hasattr(os, name):
            out[(os, name)] = _modifier(name, op)
    for name, op in _FD_MODIFIERS.items():
        if hasattr(os, name):
            out[(os, name)] = _fd_modifier(name, op)
    return out


def install(run_dir: str, scratch: str | None, record: Callable[[dict[str, Any]], None] | None) -> View:
    """Install the run's view in this process (once; inherited by forked children)."""
    global _VIEW
    if _VIEW is not None:
        return _VIEW
    for name in ("open", "listdir", "scandir", "mkdir", "rmdir", "remove", "unlink", "rename", "replace", "close",
                 "link", "symlink", *_READERS, *_MODIFIERS, *_FD_MODIFIERS):
        if hasattr(os, name):
            _ORIG[name] = getattr(os, name)

    def recording(event: dict[str, Any]) -> None:
        if record is not None:
            with _Inside():
                record(event)

    _VIEW = View(run_dir, scratch, recording)
    for (owner, name), fn in _patches().items():
        orig = getattr(owner, name, None)
        if orig is not None:
            _PATCHED[id(orig)] = (orig, fn)
        setattr(owner, name, fn)
    _keep_bytecode_out_of_the_users_tree()
    from ddpdoctor.probe.importhook import when_imported

    when_imported("sqlite3", _patch_sqlite)
    # shutil.rmtree's fd-based walk (os.open + scandir(fd) + unlink(dir_fd=...)) would bypass paths: use the path
    # walk, which goes through the patched functions
    if hasattr(shutil, "_use_fd_functions"):
        shutil._use_fd_functions = False
    return _VIEW


_PATCHED: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, its patch), for `rebind`


def rebind(module_names: Iterable[str]) -> int:
    """Modules imported before the view was installed (ddpdoctor.probe.zygote's preloaded torch) that bound a
    patched function to a name of their own (`from builtins import open as bltn_open`, tarfile; bz2) get the patch
    there too, as they would have had they been imported after `install`. Returns how many names were re-bound."""
    n = 0
    for name in module_names:
        if name.partition(".")[0] == "ddpdoctor":
            continue  # the probe's own modules keep the originals they hold on purpose (fsview._ORIG_OPEN)
        module = sys.modules.get(name)
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            found = _PATCHED.get(id(value))
            if found is not None and found[0] is value and not attr.startswith("__"):
                namespace[attr] = found[1]
                n += 1
    return n


def _keep_bytecode_out_of_the_users_tree() -> None:
    """The interpreter caches the bytecode of every module it imports next to the source (__pycache__/): for the
    user's own modules that is a write into their tree the redirection does not see (the import system's own file
    calls). Skip those; the bytecode of installed packages and of ddpdoctor is cached as usual."""
    import importlib.machinery

    library = _library_dirs()
    loader = importlib.machinery.SourceFileLoader
    orig = loader.set_data

    def set_data(self: Any, path: str, data: bytes, *, _mode: int = 0o666) -> None:
        if not os.path.realpath(path).startswith(library):
            return
        orig(self, path, data, _mode=_mode)

    loader.set_data = set_data


_SQLITE_SIDE_FILES = ("-journal", "-wal", "-shm")


def _patch_sqlite() -> None:
    """sqlite3.connect opens the database in C (past Python's open): the same mapping, the database being
    modified (copied into RUN/writes first, with its journal and write-ahead log), or created there."""
    import sqlite3
    import sqlite3.dbapi2 as dbapi2

    orig = dbapi2.connect
    if getattr(orig, "_ddpdoctor", False):
        return

    def connect(database: Any, *args: Any, **kwargs: Any) -> Any:
        v = _active()
        uri = kwargs.get("uri", args[6] if len(args) > 6 else False)
        mapped = _sqlite_path(v, database, bool(uri)) if v is not None else None
        return orig(database if mapped is None else mapped, *args, **kwargs)

    connect._ddpdoctor = True  # type: ignore[attr-defined]
    connect.__wrapped__ = orig  # type: ignore[attr-defined]
    connect.__name__ = orig.__name__
    connect.__doc__ = orig.__doc__
    sqlite3.connect = dbapi2.connect = connect


def _sqlite_path(v: View, database: Any, uri: bool) -> Any:
    """Where sqlite3.connect(database) must open the database in the run's view; None: as given."""
    if isinstance(database, bytes):
        database = os.fsdecode(database)
    elif not isinstance(database, str):
        try:
            database = os.fsdecode(os.fspath(database))
        except TypeError:
            return None
    query = ""
    if uri:
        if not database.startswith("file:"):
            return None
        database, _, query = database[len("file:"):].partition("?")
        if database.startswith("//"):  # file://host/path: only an empty host or localhost is valid
            host, _, rest = database[2:].partition("/")
            if host not in ("", "localhost"):
                return None
            database = "/" + rest
        if "mode=memory" in query:
            return None
    if database in ("", ":memory:"):
        return None
    p = v.virtual(database)
    if p is None:
        return None
    with _Inside():
        if "mode=ro" in query or "immutable=1" in query:
            target = v.read_path(p)
        elif v.exists(p):
            for side in _SQLITE_SIDE_FILES:
                if v.user_visible(p + side):
                    v.own_copy(p + side)
            target = v.write_path(p, keep=True, op="modify", asked=database, create=False)
        elif v._parent_exists(p):
            target = v.write_path(p, keep=False, op="create", asked=database)
        else:
            return None  # sqlite raises "unable to open database file", as it would have
    if uri:
        from urllib.parse import quote

        return "file:" + quote(target) + ("?" + query if query else "")
    return target


def map_write(path: Any, *, op: str = "write") -> Any:
    """Where a write to `path` by native code (torch.save's C++ writer) must go; `path` itself when passed through."""
    v = _active()
    p = v.virtual(path) if v is not None else None
    if p is None:
        return path
    with _Inside():
        return v.write_path(p, keep=False, op=op, asked=path)


def map_read(path: Any) -> Any:
    v = _active()
    p = v.virtual(path) if v is not None else None
    if p is None:
        return path
    with _Inside():
        return v.read_path(p)


def user_file(path: Any) -> str | None:
    """The user's own file (absolute) that a read of `path` sees, or None (the run's copy, or passed through)."""
    v = _active()
    p = v.virtual(path) if v is not None else None
    if p is None:
        return None
    with _Inside():
        return p if v.read_path(p) == p and v._lexists(p) else None
