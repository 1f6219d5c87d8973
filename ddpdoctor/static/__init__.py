"""Static analysis: find DDP/SyncBN accuracy bugs in a training project from its source alone.

Never imports torch and never runs the script. `analyze_file` reads and parses the script, builds one semantic
model of it and of the project modules it imports (`ScriptModel`: what the code does to models, data and process
groups, in execution order) and runs the static hook of every rule that has one (`ddpdoctor.rules.hooks("static")`)
over that model. `analyze_paths` does the same for files and directories given together (`check --static
PATH...`): each entry script is analysed with its imports, and a file the others import is analysed in their
context, not on its own.
"""

from __future__ import annotations

import ast
import functools
import gc
from collections.abc import Callable, Iterable
from pathlib import Path

from ddpdoctor.errors import InternalError, UsageError
from ddpdoctor.findings import Finding, rank_findings
from ddpdoctor.plain import ValueRecord
from ddpdoctor.rules import hooks
from ddpdoctor.sourcefile import decode_source, read_source_bytes
from ddpdoctor.static.engine import SourceFile
from ddpdoctor.static.engine.support import is_main_guard
from ddpdoctor.static.model import ScriptModel
from ddpdoctor.static.project import Limits, LoadedFile, Project, select_files

__all__ = [
    "ScriptModel",
    "StaticResult",
    "analyze_file",
    "analyze_paths",
    "analyze_source",
    "build_model",
    "build_project_model",
]


def without_gc(fn: Callable) -> Callable:
    """Run an analysis with the cyclic garbage collector paused. The interpreter allocates tens of thousands of
    small objects that all stay alive until the end; collecting generation after generation of them found nothing
    and cost a third of the time of a large script. The collector resumes (and may collect) afterwards."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return run


class StaticResult(ValueRecord):
    """Findings of a static analysis, the notes it has about what it could not read, and the files it read."""

    __match_args__ = ("findings", "notes", "files")

    def __init__(
        self, findings: list[Finding] | None = None, notes: list[str] | None = None, files: list[str] | None = None
    ) -> None:
        self.findings: list[Finding] = [] if findings is None else findings
        self.notes: list[str] = [] if notes is None else notes
        self.files: list[str] = [] if files is None else files


def read_source(path: Path, shown: str | None = None) -> SourceFile:
    """Read and parse a file the user named; anything that stops it is a one-line UsageError."""
    shown = str(path) if shown is None else shown
    # as Python reads a source file (PEP 263), and only a regular file of bounded size (ddpdoctor.sourcefile)
    source = decode_source(read_source_bytes(Path(path)), shown)
    return SourceFile(shown, source, parse(source, shown))


def parse(source: str, filename: str) -> ast.Module:
    try:
        return ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise UsageError(f"{filename}:{exc.lineno or 0}: syntax error: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes, absurd nesting
        raise UsageError(f"{filename}: cannot parse: {exc}") from None


def analyze_file(path: Path) -> list[Finding]:
    """Findings for one script file and the project modules it imports; the script's findings name it exactly
    as given (`Finding.file`), those in other files name them as `Project.display_path` does."""
    return analyze_script(path).findings


@without_gc
def analyze_script(
    path: Path,
    *,
    also: Iterable[Path] = (),
    shown: dict[Path, str] | None = None,
    cache: dict[Path, LoadedFile] | None = None,
    limits: Limits | None = None,
) -> StaticResult:
    """One entry script with its imports. `also`: files the user named that it imports (their functions nobody
    calls are walked too); `shown`: how to name the files the user named; `cache`: parsed files shared between
    several entries."""
    shown = shown or {}
    cache = cache if cache is not None else {}
    real = Path(path).resolve() if Path(path).exists() else Path(path)
    entry = cache.get(real)
    if entry is None or entry.source is None:
        entry = LoadedFile(read_source(Path(path), shown.get(real, str(path))))
        cache[real] = entry
    project = Project(Path(path), shown.get(real, str(path)), limits=limits, cache=cache, shown=shown)
    modules = tuple(project.module_of(p) for p in also if Path(p).resolve() != project.entry)
    model = ScriptModel.build_project(project, modules)
    notes = list(model.notes)
    return StaticResult(run_rules(model, notes), notes, list(model.sources))


@without_gc
def build_project_model(path: Path, assume: dict | None = None) -> ScriptModel:
    """The semantic model of a script file with the project modules it imports (the launch plan reads it)."""
    project = Project(Path(path), str(path), cache={Path(path).resolve(): LoadedFile(read_source(Path(path)))})
    return ScriptModel.build_project(project, assume=assume)


@without_gc
def build_model(source: str, filename: str, assume: dict | None = None) -> ScriptModel:
    """Parse `source` and build its semantic model (its imports stay opaque: there is no project around a text);
    a syntax error becomes a one-line UsageError. `assume`: facts the source cannot tell (the launch plan's
    command-line values, see `apis.TorchInterpreter`)."""
    if source.startswith("\ufeff"):
        source = source[1:]
    return ScriptModel.build(parse(source, filename), source, filename, assume)


@without_gc
def analyze_source(source: str, filename: str) -> list[Finding]:
    """Findings for a script given as text; `filename` is what findings report as their file."""
    return run_rules(build_model(source, filename))


def run_rules(model: ScriptModel, notes: list[str] | None = None) -> list[Finding]:
    """Every static rule over the model. A rule that fails is a note in `notes` (the rest of the report stands,
    as for a failing probe analysis), or, without `notes`, an InternalError naming the rule."""
    findings: list[Finding] = []
    for rule in hooks("static"):
        try:
            findings.extend(rule.check(model))
        except Exception as exc:  # a bug in one rule: say which, in one line, instead of a traceback
            message = f"static rule {rule.CODE} failed on {model.filename}: {type(exc).__name__}: {exc}"
            if notes is None:
                raise InternalError(message) from exc
            notes.append(message)
    return rank_findings(one_per_site(findings))


def one_per_site(findings: Iterable[Finding]) -> list[Finding]:
    """A helper called from two places (or analysed for two entry scripts) may report one line twice: keep the
    strongest."""
    best: dict[tuple[str, str | None, int | None], Finding] = {}
    for f in findings:
        key = (f.rule, f.file, f.line)
        kept = best.get(key)
        if kept is None or (f.severity, f.confidence) > (kept.severity, kept.confidence):
            best[key] = f
    return list(best.values())


# ---------------------------------------------------------------------- many files at once


@without_gc
def analyze_paths(
    paths: Iterable[Path], *, exclude: tuple[str, ...] = (), base: Path | None = None, limits: Limits | None = None
) -> StaticResult:
    """`check --static PATH...`: every `.py` file under the paths (minus `exclude`), each entry script with its
    imports. An entry is a file no other named file imports; a named file that others import is analysed in their
    context (each finding once, at its file and line); files that only import each other in a cycle get one entry
    (the one with a `__main__` block, else the first)."""
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.exists():
            raise UsageError(f"{p}: no such file or directory")
    selection = select_files(paths, exclude, base)
    shown = {f.resolve(): str(f) for f in selection.files}
    cache: dict[Path, LoadedFile] = {}
    sources = {real: read_source(real, name) for real, name in shown.items()}
    for real, source in sources.items():
        cache[real] = LoadedFile(source)
    imports = {real: _imported_files(real, cache, shown, limits) for real in sources}
    entries = _entries(list(sources), imports, {real: _has_main_block(s) for real, s in sources.items()})
    result = StaticResult()
    findings: list[Finding] = []
    walked: set[Path] = set()  # named files whose uncalled functions an earlier entry already walked
    for entry in entries:
        reach = _reachable(entry, imports) - walked
        walked |= reach
        one = analyze_script(entry, also=[p for p in sources if p in reach], shown=shown, cache=cache, limits=limits)
        findings.extend(one.findings)
        result.notes.extend(n for n in one.notes if n not in result.notes)
        result.files.extend(f for f in one.files if f not in result.files)
    result.findings = rank_findings(one_per_site(findings))
    if not selection.files:
        result.notes.append(
            "no Python files to analyse" + (f" ({selection.excluded} excluded)" if selection.excluded else "")
        )
    return result


def _imported_files(
    path: Path, cache: dict[Path, LoadedFile], shown: dict[Path, str], limits: Limits | None
) -> set[Path]:
    """The named files a file imports directly (resolved as the interpreter resolves them)."""
    project = Project(path, shown.get(path), cache=cache, shown=shown, limits=limits)
    importer = project.module_of(path)
    out: set[Path] = set()
    for module, level, names in cache[path].source.index.import_specs:  # type: ignore[union-attr]
        found = project.resolve(module, level, importer)
        if found is None:
            continue
        out.add(found.path.resolve())
        for name in names:
            sub = project.submodule(found, name)
            if sub is not None:
                out.add(sub.path.resolve())
    return {p for p in out if p in shown and p != path}


def _reachable(entry: Path, imports: dict[Path, set[Path]]) -> set[Path]:
    seen = {entry}
    stack = [entry]
    while stack:
        for nxt in imports.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _entries(files: list[Path], imports: dict[Path, set[Path]], has_main: dict[Path, bool]) -> list[Path]:
    imported = {p for targets in imports.values() for p in targets}
    entries = [f for f in files if f not in imported]
    covered: set[Path] = set()
    for e in entries:
        covered |= _reachable(e, imports)
    rest = [f for f in files if f not in covered]
    while rest:  # files that only import each other: one entry per cycle
        pick = next((f for f in rest if has_main[f]), rest[0])
        entries.append(pick)
        covered |= _reachable(pick, imports)
        rest = [f for f in rest if f not in covered]
    return entries


def _has_main_block(source: SourceFile) -> bool:
    return any(isinstance(st, ast.If) and is_main_guard(st.test) for st in source.tree.body)
