"""Analyses: pure functions from a recorded probe run (ddpdoctor.events) to findings. No torch here.

Each rule's probe half is the `probe.py` of its package (`ddpdoctor/rules/ddNNN_name/probe.py`) with
`analyze(ctx: RunContext) -> list[Finding]`; `analyses()` runs them in code order, those that say how the run
ended (`RUN_FIRST = True`: a hang, a failed rank) first, so their notes lead the report. Analyses are replay-tested
from run directories recorded by the probe (fixtures/runs/<name>/). What several analyses share lives here:
`context.py` (the run, settings, places, building findings), `bn_common.py`, `orders.py`, `outcome.py`, and
`summary.py` (the notes and tables that are no rule's).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

from ddpdoctor.analyses import summary
from ddpdoctor.analyses.consequence import keep_consistent
from ddpdoctor.analyses.context import RunContext, Settings
from ddpdoctor.errors import UsageError
from ddpdoctor.events import STATIC_FILE
from ddpdoctor.findings import Clearance, Finding, Measurement, resolve_measurements
from ddpdoctor.records import StaticRecord
from ddpdoctor.rules import hooks
from ddpdoctor.rundata import find_run_dirs, read_runs, read_text_bounded


def analyses() -> list[ModuleType]:
    """The probe hooks in the order they run: `RUN_FIRST` ones, then the others, each in code order."""
    return sorted(hooks("probe"), key=lambda m: not getattr(m, "RUN_FIRST", False))


@dataclass(frozen=True, kw_only=True)
class AnalysisResult:
    findings: tuple[Finding, ...] = ()
    # conditions the probe measured and found absent: they drop static findings of the rule (findings.Clearance)
    clearances: tuple[Clearance, ...] = ()
    # conditions the probe could not measure in this run, and why: the static findings there stay, with a note
    unmeasured: tuple[Measurement, ...] = ()
    environment: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    tables: dict[str, Any] = field(default_factory=dict)
    script: str = ""
    args: tuple[str, ...] = ()
    base_dir: Path = Path(".")
    # file as findings show it -> the copy of it kept in the run directory (read inline suppressions there when
    # the user's tree is not where the run was recorded)
    sources: dict[str, Path] = field(default_factory=dict)


def _dirs(run_dir: Path | Sequence[Path]) -> list[Path]:
    return [Path(run_dir)] if isinstance(run_dir, (str, Path)) else [Path(d) for d in run_dir]


def build_context(run_dir: Path | Sequence[Path], overrides: Mapping[str, Any] | None = None) -> RunContext:
    """The context every analysis reads: the run, its settings (recorded, then `overrides`), names of places.
    `run_dir`: one run directory, or several (one per node) or their parent: analysed as one run."""
    try:
        run = read_runs(_dirs(run_dir))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    meta = run.meta
    if not meta and not run.processes:
        raise UsageError(f"{run.path}: the run directory holds no events")
    start = next((p.first("script_start") for p in run.processes if p.first("script_start")), None) or {}
    script_abs = meta.script_abs or start.get("script") or ""
    script = meta.script or (os.path.basename(script_abs) if script_abs else "")
    base_dir = Path(meta.cwd or (run.processes[0].start.get("cwd") if run.processes else "") or ".")
    return RunContext(
        run=run,
        settings=Settings.of_run(meta, overrides),
        script=script,
        script_abs=script_abs,
        args=list(meta.args),
        base_dir=base_dir,
    )


def analyze_run(run_dir: Path | Sequence[Path], *, overrides: Mapping[str, Any] | None = None) -> AnalysisResult:
    """Findings, environment, notes and tables for a recorded run (one directory, or one per node), its recorded
    settings replaced by `overrides` (`Settings` field names: base_lr, base_batch, lr_scaling, small_bn_batch...).
    A bad or non-run directory → UsageError."""
    return analyze_context(build_context(run_dir, overrides))


def analyze_context(ctx: RunContext) -> AnalysisResult:
    """`analyze_run` on a context already built: `ddpdoctor triage` reads each arm's run once and compares the
    arms on the same context (its loaded events and memoised BN tables) that the analyses filled."""
    findings: list[Finding] = []
    for module in analyses():
        try:
            findings.extend(keep_consistent(module, list(module.analyze(ctx)), ctx.notes))
        except Exception as exc:  # one broken analysis must not hide the others' findings
            ctx.notes.append(f"analysis {module.CODE} failed: {type(exc).__name__}: {exc}")
    summary.add_notes_and_tables(ctx, findings)
    measured_absent, unmeasured = resolve_measurements(findings, ctx.measurements)
    return AnalysisResult(
        findings=tuple(findings),
        clearances=(*ctx.clearances, *measured_absent),
        unmeasured=tuple(unmeasured),
        environment=summary.environment(ctx),
        notes=tuple(ctx.notes),
        tables=ctx.tables,
        script=ctx.script,
        args=tuple(ctx.args),
        base_dir=ctx.base_dir,
        sources=ctx.shown_sources(),
    )


def load_static(run_dir: Path | Sequence[Path]) -> StaticRecord:
    """The static analysis recorded with the run (static.json; of a run recorded per node, the one directory
    that has it: rank 0's): its findings and notes, none when there is no static.json."""
    try:
        dirs = find_run_dirs(_dirs(run_dir))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    path = next((d / STATIC_FILE for d in dirs if (d / STATIC_FILE).is_file()), None)
    if path is None:
        return StaticRecord()
    try:
        return StaticRecord.from_json(json.loads(read_text_bounded(path, "strict")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"{path}: unreadable static findings: {exc}") from None


def load_static_findings(run_dir: Path | Sequence[Path]) -> list[Finding]:
    """The static findings recorded with the run, [] when there are none (`load_static`)."""
    return list(load_static(run_dir).findings)
