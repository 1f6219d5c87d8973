"""`ddpdoctor check`: static analysis, then the probe, then analyses, then one ranked report.

The CLI builds a `CheckConfig` and calls `run_check`; this module owns the pipeline and the filtering
(select/ignore, inline suppressions) that every report goes through.
"""

from __future__ import annotations

import re
from os import PathLike
from pathlib import Path
from typing import Any, Sequence

from ddpdoctor.callmodule import callable_module
from ddpdoctor.causes import fold_consequences
from ddpdoctor.config import CheckConfig
from ddpdoctor.errors import UsageError, require_analysis_packages, require_torch
from ddpdoctor.findings import Clearance, Finding, Measurement, apply_clearances, merge_findings
from ddpdoctor.plain import LazyPattern
from ddpdoctor.report import Report
from ddpdoctor.rules import select_codes
from ddpdoctor.sourcefile import check_source_path

_SUPPRESS = LazyPattern(r"#\s*ddpdoctor:\s*ignore\[([A-Za-z0-9_,\s]+)\]", re.I)


def inline_suppressions(source: str) -> dict[int, set[str]]:
    """Line number → code prefixes suppressed by `# ddpdoctor: ignore[DD301]` comments on that line."""
    out: dict[int, set[str]] = {}
    if "ddpdoctor" not in source.lower():  # no line can hold one: no search line by line (a file per finding)
        return out
    for lineno, text in enumerate(source.splitlines(), start=1):
        m = _SUPPRESS.search(text)
        if m:
            out[lineno] = {c.strip().upper() for c in m.group(1).split(",") if c.strip()}
    return out


def filter_findings(
    findings: list[Finding],
    *,
    select: tuple[str, ...] = (),
    ignore: tuple[str, ...] = (),
    base_dir: Path | None = None,
    sources: dict[str, Path] | None = None,
) -> list[Finding]:
    """Apply --select/--ignore (prefix match) and inline suppressions in the files findings point at.

    `sources` maps a finding's file to the copy a recorded run kept (`RUN/source/`), so a report replayed away
    from the user's tree honours the same `# ddpdoctor: ignore[...]` comments."""
    try:
        selected = select_codes(select) if select else None
        ignored = select_codes(ignore) if ignore else set()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    cache: dict[str, dict[int, set[str]]] = {}

    def suppressed(f: Finding) -> bool:
        if not f.file or not f.line:
            return False
        if f.file not in cache:
            path = Path(f.file)
            if sources and f.file in sources and Path(sources[f.file]).is_file():
                path = Path(sources[f.file])
            elif not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            try:
                cache[f.file] = inline_suppressions(path.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                cache[f.file] = {}
        codes = cache[f.file].get(f.line, set())
        return any(f.rule.startswith(c) for c in codes)

    return [
        f
        for f in findings
        if (selected is None or f.rule in selected) and f.rule not in ignored and not suppressed(f)
    ]


def merge_static_and_probe(
    static: list[Finding],
    probe: list[Finding],
    clearances: tuple[Clearance, ...] | list[Clearance],
    *,
    unmeasured: tuple[Measurement, ...] | list[Measurement] = (),
    select: tuple[str, ...] = (),
    ignore: tuple[str, ...] = (),
) -> tuple[list[Finding], list[str]]:
    """Static findings the probe's measurements contradict are dropped (findings.Clearance), then static and probe
    findings of the same cause are merged. Returns (findings, one note per cleared static finding and per static
    finding the probe could not measure); notes only for the rules the report shows."""
    try:
        selected = select_codes(select) if select else None
        ignored = select_codes(ignore) if ignore else set()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    def shown(items: list) -> list:
        return [c for c in items if (selected is None or c.rule in selected) and c.rule not in ignored]

    kept, notes = apply_clearances(static, shown(clearances), shown(unmeasured))
    return merge_findings(kept + probe), notes


def output_guards(cfg: CheckConfig, pyproject: Path | None = None) -> tuple[list[tuple[Path, str]], list[Path]]:
    """What `--output` must never overwrite in a check: the script, files given to it as arguments, the pyproject
    its options come from; and the run directory (ddpdoctor.output)."""
    protect: list[tuple[Path, str]] = [(Path(cfg.script), "the script being analysed")]
    protect += [(Path(p), "a file being analysed") for p in getattr(cfg, "paths", ()) if Path(p).is_file()]
    for arg in cfg.script_args:
        for value in (arg, arg.split("=", 1)[-1]):
            if value and Path(value).is_file():
                protect.append((Path(value), "a file given to the script"))
    if pyproject is not None:
        protect.append((Path(pyproject), "the pyproject.toml the options come from"))
    return protect, [Path(cfg.keep_run)] if cfg.keep_run is not None else []


def findings_files(report: Report) -> list[tuple[Path, str]]:
    """The user files a report's findings point at."""
    base = Path(report.base_dir or ".")
    return [(base / f.file, "a file the findings point at") for f in report.findings if f.file]


def run_dir_files(run_dir: Path) -> list[tuple[Path, str]]:
    """The user's files a recorded run names (its script, the sources it copied): `report --output` spares them."""
    import json

    from ddpdoctor.events import META_FILE
    from ddpdoctor.rundata import read_text_bounded

    try:
        meta = json.loads(read_text_bounded(Path(run_dir) / META_FILE, "strict"))
    except (OSError, ValueError):
        return []
    if not isinstance(meta, dict):
        return []
    named = [meta.get("script_abs"), *(meta.get("sources") or {})]
    return [(Path(p), "a file the run names") for p in named if isinstance(p, str) and p]


def validate_script(script: Path) -> Path:
    """A script ddpdoctor can read (a regular file of bounded size, not a notebook): else one-line UsageError."""
    check_source_path(script)
    return script


def run_check(cfg: CheckConfig) -> Report:
    from ddpdoctor.static import analyze_paths, analyze_script

    notes: list[str] = []
    if cfg.static_only:
        base = cfg.exclude_base or Path.cwd()
        for named in (cfg.script, *cfg.paths):  # a file named on the command line must be a script ddpdoctor reads
            if not Path(named).is_dir():
                validate_script(Path(named))
        analysis = analyze_paths([cfg.script, *cfg.paths], exclude=cfg.exclude, base=base)
    else:
        analysis = analyze_script(validate_script(cfg.script))
    static: list[Finding] = list(analysis.findings)
    notes.extend(analysis.notes)
    probe: list[Finding] = []
    clearances: tuple[Clearance, ...] = ()
    unmeasured: tuple[Measurement, ...] = ()
    environment: dict = {"nproc": cfg.nproc}
    tables: dict = {}
    if not cfg.static_only:
        import shutil

        require_torch("the probe")
        require_analysis_packages("the probe")
        from ddpdoctor.analyses import analyze_run
        from ddpdoctor.conversion import fold_into, run_conversion_check
        from ddpdoctor.probe.launcher import run_probe
        from ddpdoctor.probe.progress import showing
        from ddpdoctor.probe.rundir import claim_for_check
        from ddpdoctor.probe.supervisor import Supervisor

        guard = None
        if cfg.keep_run is None:
            run_dir, guard = Supervisor.guarded_tempdir("ddpdoctor-run-")  # removed even if this process is killed
        else:
            run_dir = cfg.keep_run
        try:
            # locked from the launch to the end of the analysis: a second run cannot clear it meanwhile
            with claim_for_check(run_dir) as claim:
                progress = None if cfg.quiet else progress_display(cfg, run_dir)
                with showing(progress):
                    run_probe(cfg, run_dir, static_findings=static, claim=claim, progress=progress)
                analysis = analyze_run(run_dir)
                # SyncBN layers seen: the deterministic conversion checks of triage, on two short arms
                conversion = run_conversion_check(cfg, run_dir)
        finally:
            if guard is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
                guard.stop()
        probe, clearances, unmeasured, conversion_notes = fold_into(
            conversion, list(analysis.findings), analysis.clearances, analysis.unmeasured)
        environment = analysis.environment
        notes.extend(analysis.notes)
        notes.extend(conversion_notes)
        tables.update(analysis.tables)
    else:
        environment = {"nproc": cfg.nproc, "static_only": True}
    merged, cleared = merge_static_and_probe(static, probe, clearances, unmeasured=unmeasured, select=cfg.select,
                                             ignore=cfg.ignore)
    notes.extend(cleared)
    kept = fold_consequences(filter_findings(merged, select=cfg.select, ignore=cfg.ignore, base_dir=Path.cwd()))
    return Report(
        script=" ".join(str(p) for p in (cfg.script, *cfg.paths)),
        args=cfg.script_args,
        environment=environment,
        findings=tuple(kept),
        notes=tuple(notes),
        tables=tables,
        base_dir=Path.cwd(),
    )


def progress_display(cfg: CheckConfig, run_dir: Path):  # noqa: ANN201 - ddpdoctor.probe.progress.ProgressDisplay
    """The live progress of the probe on stderr (ddpdoctor.probe.progress); `--quiet` goes without."""
    from ddpdoctor.probe.progress import ProgressDisplay

    return ProgressDisplay(run_dir, script=str(cfg.script), nproc=cfg.nproc, epochs=cfg.epochs, steps=cfg.steps,
                           timeout=cfg.timeout)


def run_project(run_dir: Path | list[Path] | tuple[Path, ...]) -> Path:
    """Where `report` looks for the project's `[tool.ddpdoctor]`: beside the recorded script when it is on this
    machine, else from the current directory. Several directories (one per node): the first that names it."""
    import json

    from ddpdoctor.events import META_FILE
    from ddpdoctor.rundata import find_run_dirs, read_text_bounded

    try:
        dirs = find_run_dirs([Path(run_dir)] if isinstance(run_dir, (str, Path)) else list(run_dir))
    except ValueError:
        return Path.cwd()
    for d in dirs:
        try:
            meta = json.loads(read_text_bounded(Path(d) / META_FILE, "strict"))
            script = Path(meta["script_abs"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if script.is_file():
            return script
    return Path.cwd()


def report_run(
    run_dir: Path | list[Path] | tuple[Path, ...],
    *,
    select: tuple[str, ...] = (),
    ignore: tuple[str, ...] = (),
    base_lr: float | None = None,
    base_batch: int | None = None,
    lr_scaling: str | None = None,
    small_bn_batch: int | None = None,
) -> Report:
    """`ddpdoctor report DIR...`: redo analysis and reporting of a recorded run without running anything.

    The run directory holds the static findings of the check that recorded it, so the merged report is the same
    as the one `check` printed; options given here override those recorded with the run. A run recorded per node
    (attach mode, one `--out` per node) is given as its directories, or their parent, and analysed as one run.
    """
    require_analysis_packages("`ddpdoctor report`")
    from ddpdoctor.analyses import analyze_run, load_static

    dirs = [Path(run_dir)] if isinstance(run_dir, (str, Path)) else [Path(d) for d in run_dir]
    if not dirs:
        raise UsageError("no run directory given")
    for d in dirs:
        if not d.exists():
            raise UsageError(f"{d}: no such directory")
        if not d.is_dir():
            raise UsageError(f"{d}: not a directory")
    overrides = {
        k: v
        for k, v in (
            ("base_lr", base_lr), ("base_batch", base_batch), ("lr_scaling", lr_scaling),
            ("small_bn_batch", small_bn_batch),
        )
        if v is not None
    }
    analysis = analyze_run(dirs, overrides=overrides)
    static = load_static(dirs)
    from ddpdoctor.conversion import fold_into, load_conversion_check

    probe, clearances, unmeasured, conversion_notes = fold_into(
        load_conversion_check(dirs), list(analysis.findings), analysis.clearances, analysis.unmeasured)
    merged, cleared = merge_static_and_probe(
        list(static.findings), probe, clearances, unmeasured=unmeasured, select=select, ignore=ignore,
    )
    kept = fold_consequences(
        filter_findings(merged, select=select, ignore=ignore, base_dir=analysis.base_dir, sources=analysis.sources)
    )
    return Report(
        script=analysis.script,
        args=tuple(analysis.args),
        environment=analysis.environment,
        findings=tuple(kept),
        notes=(*static.notes, *analysis.notes, *conversion_notes, *cleared),
        tables=analysis.tables,
        base_dir=analysis.base_dir,
    )




def check(script: str | PathLike, args: Sequence[str] = (), *, nproc: int | None = None, static: bool = False,
          **options: Any) -> Report:
    """`ddpdoctor check SCRIPT -- ARGS` as a function (`ddpdoctor.check(...)`): static analysis and (unless
    `static`) the multi-rank probe, returning the Report. `options`: epochs, steps, timeout, device, base_lr,
    base_batch, lr_scaling, select, ignore, keep_run, paths (more files or directories with `static`), quiet
    (default True: no progress display). `report.exit_code(fail_on)` is what the command would exit with; bad
    input raises UsageError."""
    from ddpdoctor.config import check_config

    options.setdefault("quiet", True)
    cfg, _ = check_config(script, args, nproc=nproc, static=static, **options)
    return run_check(cfg)


# `ddpdoctor.check(script, ...)` is the function above although this module has its name (ddpdoctor.callmodule)
callable_module(__name__, check)
