"""The files of a user's project that static analysis may read, found the way Python's import system finds them.

An entry script imports `trainer`, `utils.dist`, `from .data import build`: `Project.resolve` maps each to a file
under the project's import roots — the script's directory, the root of the package it sits in, the installable
project it belongs to (`project_root`, and its src/: what `pip install -e .` makes importable), and directories the
script adds to `sys.path` with literal paths — and never to the standard library or an installed package (nothing
under site-packages, dist-packages or the interpreter's prefix; `torch` is never a project module). Each file is
read and parsed once (`Project.load`), within bounds (`Limits`): a file that does not parse, or one past the
budget, becomes a note and its import stays opaque, as a library's would.

Files are reported as the probe reports them (`display_path`): the entry script as the user gave it, another file
relative to the working directory when it lies inside it, else absolute.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from ddpdoctor.errors import UsageError
from ddpdoctor.plain import FrozenRecord, Record, ValueRecord
from ddpdoctor.sourcefile import decode_source, read_source_bytes
from ddpdoctor.static.engine.support import SourceFile

# never resolved to a project file: the library the models stand for
NEVER_PROJECT = frozenset({"torch"})
# directories a recursive walk over a tree skips (the usual virtualenvs, caches and build output)
SKIPPED_DIRS = frozenset(
    {
        ".bzr",
        ".direnv",
        ".eggs",
        ".git",
        ".hg",
        ".mypy_cache",
        ".nox",
        ".pytest_cache",
        ".ruff_cache",
        ".svn",
        ".tox",
        ".venv",
        "__pycache__",
        "__pypackages__",
        "_build",
        "build",
        "dist",
        "node_modules",
        "site-packages",
        "venv",
    }
)


class Limits(FrozenRecord):
    """Bounds on what one analysis reads: files, bytes of source, and how deep imports nest."""

    __match_args__ = ("max_files", "max_bytes", "max_depth")
    max_files: int
    max_bytes: int
    max_depth: int

    def __init__(self, max_files: int = 400, max_bytes: int = 8_000_000, max_depth: int = 16) -> None:
        object.__setattr__(self, "max_files", max_files)
        object.__setattr__(self, "max_bytes", max_bytes)
        object.__setattr__(self, "max_depth", max_depth)


class ModuleFile(Record):
    """A module of the project: its dotted name as imported, its file (absolute), and whether it is a package."""

    __match_args__ = ("name", "path", "is_package", "namespace")

    def __init__(self, name: str, path: Path, is_package: bool = False, namespace: bool = False) -> None:
        self.name = name
        self.path = path
        self.is_package = is_package
        self.namespace = namespace  # a directory without __init__.py (PEP 420): no code of its own

    @property
    def directory(self) -> Path:
        return self.path if self.namespace else self.path.parent


class LoadedFile(ValueRecord):
    """A file of the project as `Project.load` read it: parsed, or None with the note that says why not."""

    __match_args__ = ("source", "note")

    def __init__(self, source: SourceFile | None, note: str | None = None) -> None:
        self.source = source
        self.note = note


def _installed_prefixes() -> tuple[str, ...]:
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, getattr(sys, "base_exec_prefix", sys.exec_prefix)}
    return tuple(os.path.normcase(os.path.realpath(p)) + os.sep for p in prefixes if p)


_INSTALLED = _installed_prefixes()


def is_installed_path(path: Path) -> bool:
    """A file of the standard library or of an installed package: never part of the user's project."""
    text = os.path.normcase(os.path.realpath(path))
    parts = set(Path(text).parts)
    if "site-packages" in parts or "dist-packages" in parts:
        return True
    return any(text.startswith(p) for p in _INSTALLED)


def package_root(directory: Path) -> Path:
    """The directory a package's top-level name is importable from: the first ancestor without __init__.py."""
    d = directory
    while (d / "__init__.py").is_file() and d.parent != d:
        d = d.parent
    return d


# files that make a directory a project pip can install (`pip install -e .`), so that its packages import from anywhere
PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg")


def project_root(directory: Path, levels: int = 2) -> Path | None:
    """The project a script in `directory` belongs to, when it is installable: the nearest of its directory and
    `levels` ancestors holding pyproject.toml, setup.py or setup.cfg. Its packages (and those of its src/) are
    importable wherever the script runs once the project is installed in develop mode, as research code often
    is (`scripts/image_train.py` importing the package at the repository root)."""
    d = directory
    for _ in range(levels + 1):
        if is_installed_path(d):
            return None
        if any((d / m).is_file() for m in PROJECT_MARKERS):
            return d
        if d.parent == d:
            return None
        d = d.parent
    return None


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class Project:
    """Module resolution and parsed files for the analysis of one or more entry scripts (see the module docstring).

    `cache` may be shared between several Projects (a `check --static` over many files parses each file once).
    """

    def __init__(
        self,
        entry: Path,
        entry_shown: str | None = None,
        *,
        limits: Limits | None = None,
        cache: dict[Path, LoadedFile] | None = None,
        cwd: Path | None = None,
        shown: dict[Path, str] | None = None,
    ) -> None:
        self.entry = entry.resolve()
        self.entry_shown = entry_shown if entry_shown is not None else str(entry)
        self.cwd = (cwd or Path.cwd()).resolve()
        self.limits = limits or Limits()
        self.cache: dict[Path, LoadedFile] = cache if cache is not None else {}
        self.shown = shown or {}  # files the user named, as named
        directory = self.entry.parent
        self.roots: list[Path] = [directory]
        root = package_root(directory)
        if root != directory:
            self.roots.append(root)
        installed = project_root(directory)
        for extra in (installed, installed / "src") if installed is not None else ():
            if extra not in self.roots and extra.is_dir():
                self.roots.append(extra)
        self.notes: list[str] = []
        self.read: list[Path] = []  # files this analysis loaded, in order
        self._bytes = 0
        self._resolved: dict[tuple[Path, str], ModuleFile | None] = {}

    # ------------------------------------------------------------------ roots

    def add_root(self, directory: str, relative_to: Path | None = None) -> bool:
        """A directory the script puts on sys.path (`sys.path.insert(0, "..")`): relative paths are taken from
        the script's directory, as running `python train.py` from there makes them."""
        path = Path(directory)
        if not path.is_absolute():
            path = (relative_to or self.entry.parent) / path
        try:
            path = path.resolve()
        except OSError:
            return False
        if not path.is_dir() or is_installed_path(path) or path in self.roots:
            return False
        self.roots.append(path)
        return True

    # ------------------------------------------------------------------ resolution

    def module_of(self, path: Path) -> ModuleFile:
        """The ModuleFile of a project file (the entry script included)."""
        path = path.resolve()
        is_package = path.name == "__init__.py"
        root = package_root(path.parent)
        name = module_name(path, root) if path != self.entry else "__main__"
        return ModuleFile(name=name or path.stem, path=path, is_package=is_package)

    def resolve(self, dotted: str, level: int = 0, importer: ModuleFile | None = None) -> ModuleFile | None:
        """The project module `import dotted` (or `from .dotted import ...` at `level`) means in `importer`,
        or None when it is not a file of the project."""
        if level:
            if importer is None:
                return None
            base = importer.directory
            for _ in range(level - 1):
                base = base.parent
            return (
                self._find(base, dotted, prefix=self._package_name(importer, level)) if dotted else self._package(base)
            )
        top = dotted.split(".")[0]
        if not top or top in NEVER_PROJECT:
            return None
        for root in self.roots:
            found = self._find(root, dotted, prefix="")
            if found is not None:
                return found
        return None

    def submodule(self, package: ModuleFile, name: str) -> ModuleFile | None:
        """`package.name` when it is a module of its own (`from timm import utils`)."""
        if not (package.is_package or package.namespace):
            return None
        return self._find(package.directory, name, prefix=package.name)

    def _package_name(self, importer: ModuleFile, level: int) -> str:
        parts = importer.name.split(".")
        keep = len(parts) - level + (1 if importer.is_package else 0)
        return ".".join(parts[: max(0, keep)])

    def _package(self, directory: Path) -> ModuleFile | None:
        init = directory / "__init__.py"
        if init.is_file() and not is_installed_path(init):
            return ModuleFile(name=module_name(init, package_root(directory)), path=init, is_package=True)
        return None

    def _find(self, base: Path, dotted: str, prefix: str) -> ModuleFile | None:
        key = (base, dotted)
        if key in self._resolved:
            return self._resolved[key]
        found: ModuleFile | None = None
        directory = base
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            name = ".".join(p for p in (prefix, *parts[: i + 1]) if p)
            init = directory / part / "__init__.py"
            if init.is_file():
                found = ModuleFile(name=name, path=init, is_package=True)
                directory = directory / part
                continue
            module = directory / f"{part}.py"
            if last and module.is_file():
                found = ModuleFile(name=name, path=module)
                break
            if (directory / part).is_dir():
                found = ModuleFile(name=name, path=directory / part, namespace=True)
                directory = directory / part
                continue
            found = None
            break
        if found is not None and (
            is_installed_path(found.path) or (found.namespace and not any(found.path.glob("*.py")))
        ):
            found = None
        self._resolved[key] = found
        return found

    # ------------------------------------------------------------------ files

    def display_path(self, path: Path) -> str:
        """How findings name a file: the entry as given, a file under the working directory relative to it, any
        other file absolute (the probe names files the same way, so findings of both halves meet)."""
        path = path.resolve()
        if path == self.entry:
            return self.entry_shown
        if path in self.shown:
            return self.shown[path]
        try:
            return str(path.relative_to(self.cwd))
        except ValueError:
            return str(path)

    def load(self, module: ModuleFile, depth: int = 0) -> SourceFile | None:
        """The parsed file of a module (once per path); None, with a note, when it cannot or may not be read."""
        path = module.path
        cached = self.cache.get(path)
        if cached is None:
            cached = self._read(path)
            self.cache[path] = cached
        if cached.source is None:
            if cached.note and cached.note not in self.notes:
                self.notes.append(cached.note)
            return None
        if path not in self.read and path != self.entry:
            size = len(cached.source.source)
            if len(self.read) + 1 > self.limits.max_files or self._bytes + size > self.limits.max_bytes:
                self._note_once(
                    f"static analysis stopped following imports at {self.display_path(path)}: "
                    f"the project is larger than {self.limits.max_files} files or "
                    f"{self.limits.max_bytes // 1_000_000} MB of source"
                )
                return None
            if depth > self.limits.max_depth:
                self._note_once(
                    f"imports nest deeper than {self.limits.max_depth} levels at "
                    f"{self.display_path(path)}: not followed further"
                )
                return None
            self._bytes += size
            self.read.append(path)
        return cached.source

    def _note_once(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def _read(self, path: Path) -> LoadedFile:
        shown = self.display_path(path)
        try:
            text = decode_source(read_source_bytes(path), shown)  # as Python reads it, bounded (ddpdoctor.sourcefile)
        except UsageError as exc:
            return LoadedFile(None, f"{shown}: not read ({str(exc).removeprefix(shown + ': ')}); its imports were "
                              "not followed")
        try:
            tree = ast.parse(text, filename=shown)
        except SyntaxError as exc:
            return LoadedFile(None, f"{shown}:{exc.lineno or 0}: syntax error ({exc.msg}): the module was not analysed")
        except (ValueError, RecursionError, MemoryError) as exc:
            return LoadedFile(None, f"{shown}: cannot parse ({exc}): the module was not analysed")
        return LoadedFile(SourceFile(shown, text, tree))


# ---------------------------------------------------------------------- many files at once


class Selection(ValueRecord):
    """The Python files a `check --static PATH...` covers, after `exclude`."""

    __match_args__ = ("files", "excluded")

    def __init__(self, files: list[Path] | None = None, excluded: int = 0) -> None:
        self.files: list[Path] = [] if files is None else files
        self.excluded = excluded


def _excluded(path: Path, patterns: tuple[str, ...], base: Path) -> bool:
    if not patterns:
        return False
    try:
        rel = path.resolve().relative_to(base.resolve()).as_posix()
    except ValueError:
        rel = path.as_posix()
    parts = rel.split("/")
    candidates = [rel, *("/".join(parts[: i + 1]) for i in range(len(parts))), *parts]
    for pattern in patterns:
        p = pattern.strip().rstrip("/")
        if p and any(fnmatch.fnmatchcase(c, p) for c in candidates):
            return True
    return False


def select_files(paths: Iterable[Path], exclude: tuple[str, ...] = (), base: Path | None = None) -> Selection:
    """Files and directories (recursively, `.py` only, skipping SKIPPED_DIRS) minus the `exclude` patterns
    (globs against the path relative to `base` — the directory of the pyproject.toml that declares them — or
    against any of its components, as ruff's)."""
    base = base or Path.cwd()
    out = Selection()
    seen: set[Path] = set()
    for path in paths:
        for f in _walk(path):
            real = f.resolve()
            if real in seen:
                continue
            seen.add(real)
            if _excluded(f, exclude, base):
                out.excluded += 1
                continue
            out.files.append(f)
    return out


def _walk(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
        return
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name
