"""`check`'s conversion check: the deterministic SyncBN conversion checks of `ddpdoctor triage`, run by `check` itself
whenever its probe saw SyncBatchNorm layers (converted or built directly).

What a conversion does to the user's own code shows only against a run without it: code that picks norm layers by
exact class (a weight-decay exemption, a BN-momentum schedule, freezing, a precise-BN helper) treats the converted
layers differently. So `check` runs two short arms through triage's arm machinery (ddpdoctor.probe.arms; launched
here as ddpdoctor.triage.run launches its arms, which imports `check`):
A, the script as written, and P, the conversion undone, each with the same seed and SHORT_STEPS optimizer steps per
epoch, and folds triage's deterministic checks (ddpdoctor.triage.checks: conversion_causes, attribute_causes,
class_test_site) into its findings, with the measured evidence and the file:line of the class test. A script without
SyncBN layers costs nothing more: no arm runs.

Where the class test set no attribute the recorder sees (an optimizer-group builder, a precise-BN helper), its line
is found among the exact-class tests (the static DD209 detector) of the user files the run executed, anchored to the
measured difference: the functions called on the line that built the optimizer, or the unique test there is.
"""

from __future__ import annotations

import ast
import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ddpdoctor.findings import Finding

SHORT_STEPS = 2  # optimizer steps per epoch in each arm: attributes are compared at every step
SEED = 0
CONVERSION_FILE = "conversion.json"  # in a kept check run: what the conversion check found, for `ddpdoctor report`
MEASURED_BY = "conversion check: short paired runs with and without the conversion (arms A and P)"


@dataclass
class ConversionCheck:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    measured: bool = False  # both arms took optimizer steps: attribute differences were compared
    layers: int = 0  # BatchNorm layers compared
    steps: int = 0  # optimizer steps compared (the fewer of the two arms')

    def to_json(self) -> dict[str, Any]:
        return {"findings": [f.to_json() for f in self.findings], "notes": list(self.notes),
                "measured": self.measured, "layers": self.layers, "steps": self.steps}

    @classmethod
    def from_json(cls, data: Any) -> ConversionCheck:
        if not isinstance(data, dict):
            return cls()
        return cls(findings=[Finding.from_json(f) for f in data.get("findings") or ()],
                   notes=[str(n) for n in data.get("notes") or ()], measured=bool(data.get("measured")),
                   layers=int(data.get("layers") or 0), steps=int(data.get("steps") or 0))


def syncbn_seen(run_dir: Path) -> int:
    """SyncBN-like layers the check's run used (counted as triage counts them: torch's, apex's, emulated, or the
    layers a conversion made), when every rank took an optimizer step (0: no conversion check — a run that failed
    or never stepped has its own finding, and the arms would stop where it did)."""
    from ddpdoctor.rundata import read_run

    try:
        procs = read_run(run_dir).rank_processes
    except (OSError, ValueError):
        return 0
    if not procs or not all(p.of("optimizer_step") for p in procs.values()):
        return 0
    proc = procs[min(procs)]
    sync = sum(1 for e in proc.of("bn_layer")
               if e.get("bn_kind") in ("sync", "emulated_sync") or "sync" in str(e.get("cls", "")).lower())
    if not sync:
        sync = max((int(e.get("syncbn_layers") or 0) for e in proc.of("sync_bn_convert")), default=0)
        sync = max(sync, len(proc.of("bn_conversion")))
    return sync


def run_conversion_check(cfg: Any, run_dir: Path) -> ConversionCheck | None:
    """After `check`'s probe run in `run_dir`: None when it saw no SyncBN layer; else the two short arms, run in a
    private temporary directory (removed), and what they found. The result is kept beside the run (CONVERSION_FILE)
    so `ddpdoctor report` shows the same findings."""
    sync = syncbn_seen(run_dir)
    if not sync:
        return None
    from ddpdoctor.probe.supervisor import Supervisor

    if not cfg.quiet:
        import sys

        sys.stderr.write(f"ddpdoctor: {sync} SyncBatchNorm layer{'s' if sync != 1 else ''} seen: conversion check "
                         f"(the script with and without the conversion, {SHORT_STEPS} steps per epoch)\n")
        sys.stderr.flush()
    short = replace(cfg, steps=SHORT_STEPS, keep_run=None)
    base, guard = Supervisor.guarded_tempdir("ddpdoctor-conv-")
    try:
        from ddpdoctor.probe.armlaunch import run_arms

        a_dir, p_dir = run_arms(short, [(base / "arm-A", {"arm": "A", "seed": SEED}),
                                        (base / "arm-P", {"arm": "P", "bn_mode": "plain", "seed": SEED})],
                                what="conversion check")
        result = decide(a_dir, p_dir)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        guard.stop()
    try:
        (Path(run_dir) / CONVERSION_FILE).write_text(json.dumps(result.to_json(), default=str), encoding="utf-8")
    except OSError:
        pass
    return result


def load_conversion_check(run_dirs: list[Path]) -> ConversionCheck | None:
    """What the conversion check of a recorded check run found (CONVERSION_FILE), None when it did not run."""
    from ddpdoctor.rundata import read_text_bounded

    for d in run_dirs:
        path = Path(d) / CONVERSION_FILE
        if path.is_file():
            try:
                return ConversionCheck.from_json(json.loads(read_text_bounded(path, "strict")))
            except (OSError, ValueError, KeyError, TypeError):
                return None
    return None


def decide(a_dir: Path, p_dir: Path) -> ConversionCheck:
    """Triage's deterministic conversion checks on arms A (as written) and P (conversion undone)."""
    from ddpdoctor.analyses import analyze_context, build_context
    from ddpdoctor.triage.checks import attribute_causes, conversion_causes
    from ddpdoctor.triage.model import Arm

    arms = []
    for name, d in (("A", a_dir), ("P", p_dir)):
        ctx = build_context(d, None)
        arms.append(Arm(name=name, what=name, ctx=ctx, findings=list(analyze_context(ctx).findings),
                        as_written=name == "A"))
    a, p = arms
    if a.steps == 0 or p.steps == 0:
        which = " and ".join(x.name for x in arms if x.steps == 0)
        return ConversionCheck(notes=[
            f"Conversion check not measured: arm {which} took no optimizer step, so whether code that selects norm "
            "layers by exact class treats the SyncBatchNorm layers differently was not compared "
            "(`ddpdoctor triage` runs the full comparison)."])
    conv = conversion_causes(a)
    causes = attribute_causes(a, p, conv)
    findings: list[Finding] = []
    script = a.ctx.script
    ranks = sorted(a.ctx.ranks)
    for c in [*conv, *causes]:
        if c.verdict != "confirmed":
            continue
        locate_class_test(a, p, c)
        f = c.finding(script, ranks)
        if f is None:
            continue
        f = replace(f, evidence={**f.evidence, "measured_by": MEASURED_BY, "steps": [a.steps, p.steps]})
        findings.append(f)
    low = a.ctx.ranks[min(a.ctx.ranks)]
    compared = {name for e in low.of("bn_attrs") for name in (e.get("layers") or {})}
    return ConversionCheck(findings=findings, measured=True, layers=len(compared), steps=min(a.steps, p.steps))


# ------------------------------------------------------------------------------------------------ class test sites


def _user_files(ctx: Any) -> dict[str, Path]:
    """Recorded path → readable copy of each user source file the run executed (the script and its own modules)."""
    out = {}
    for recorded in ctx.snapshots:
        path = ctx.source_file(recorded)
        if path is not None:
            out[recorded] = path
    return out


def exact_class_sites(ctx: Any) -> list[dict[str, Any]]:
    """Every BatchNorm test by exact class (the static DD209 detector, converters excluded) in the user files the
    run executed: {"file", "line", "function", "how", "span"} each."""
    from ddpdoctor.rules import hook
    from ddpdoctor.static.engine.support import SourceIndex

    out = []
    for recorded, path in sorted(_user_files(ctx).items()):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (OSError, SyntaxError, ValueError):
            continue
        index = SourceIndex(tree)
        seen = set()
        for line, how in hook("DD209", "static").exact_class_tests(tree, index):
            if line in seen:
                continue
            seen.add(line)
            fn = _innermost(index, line)
            out.append({"file": recorded, "line": line, "how": how, "function": fn.name if fn else None,
                        "span": (fn.lineno, fn.end_lineno or fn.lineno) if fn else None})
    return out


def _innermost(index: Any, line: int) -> Any:
    best = None
    for fn in index.functions:
        if fn.lineno <= line <= (fn.end_lineno or fn.lineno) and (best is None or fn.lineno > best.lineno):
            best = fn
    return best


def _optimizer_lines(ctx: Any) -> list[tuple[str, int]]:
    """(file, line) where the run built its optimizers, from the recorded optimizer sites."""
    out = []
    for proc in ctx.ranks.values():
        for e in proc.of("optimizer_init"):
            site = e.get("site") or {}
            if site.get("file") and site.get("line"):
                out.append((site["file"], int(site["line"])))
        break
    return list(dict.fromkeys(out))


def _called_names(ctx: Any, file: str, line: int) -> set[str]:
    text = ctx.source_text(file)
    if not text:
        return set()
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node, "lineno", 0) <= line <= (getattr(node, "end_lineno", 0) or 0):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None))
    names.discard(None)
    return names


def _setter_functions(a: Any, p: Any) -> set[tuple[str, str]]:
    """(file, function) of the user code that set a BatchNorm attribute (momentum, eps, mode, requires_grad) in arm
    P and never in arm A: code that ran for plain BatchNorm only (a recalibration helper resetting momentum)."""
    def sites(ctx: Any) -> set[tuple[str, int, str]]:
        out = set()
        for proc in ctx.ranks.values():
            for e in proc.of("bn_attr_set"):
                site = e.get("site") or {}
                if site.get("file"):
                    out.add((site["file"], int(site.get("line") or 0), str(site.get("function") or "")))
        return out

    return {(file, fn) for file, _, fn in sites(p.ctx) - sites(a.ctx)}


def locate_class_test(a: Any, p: Any, cause: Any) -> None:
    """Give a confirmed DD209 that no recorded setter placed the file:line of its class test (`class_test_for`), in
    its location, measured evidence and message. `check`'s conversion check and `ddpdoctor triage` both call it, so
    a DD209 of an optimizer-group builder or a precise-BN helper names the same line in either (issue 20)."""
    if cause.rule != "DD209" or cause.verdict != "confirmed" or cause.file is not None:
        return
    site = class_test_for(a, p, cause)
    if site is None:
        return
    file, line = a.ctx.where(site)
    cause.file, cause.line = file, line
    cause.measured = {**cause.measured, "class_test": site}
    cause.message += (f" — the class test at {file}:{line} (an exact-class test of the code the run executed, "
                      f"{site['why']})")


def class_test_for(a: Any, p: Any, cause: Any) -> dict[str, Any] | None:
    """The exact-class test behind a confirmed DD209 that no recorded setter placed (optimizer groups, precise-BN
    recalibration), among the exact-class tests of the user code the run executed: for optimizer groups, one in a
    function called where the optimizer was built; else one in a function that changed BatchNorm layers in the run
    without the conversion only; else the only one there is. None when none of these places one."""
    sites = exact_class_sites(p.ctx) or exact_class_sites(a.ctx)
    if not sites:
        return None
    keys = {str(item.get("key")) for item in cause.measured.get("layers") or () if isinstance(item, dict)}
    if any(k.endswith(("_weight_decay", "_lr", "_in_optimizer")) for k in keys):
        called: set[str] = set()
        for file, line in _optimizer_lines(p.ctx) or _optimizer_lines(a.ctx):
            called |= _called_names(p.ctx, file, line)
        anchored = [s for s in sites if s["function"] in called]
        if anchored:
            return {**anchored[0], "why": "in the function that built the optimizer's parameter groups"}
    changed = _setter_functions(a, p)
    anchored = [s for s in sites if (s["file"], s["function"]) in changed]
    if anchored:
        return {**anchored[0], "why": "in the function that changed the BatchNorm layers without the conversion only"}
    if len(sites) == 1:
        return {**sites[0], "why": "the only one there is"}
    return None


def fold_into(conv: ConversionCheck | None, probe: list[Finding], clearances: tuple, unmeasured: tuple
              ) -> tuple[list[Finding], tuple, tuple, list[str]]:
    """`check`'s probe findings, clearances, unmeasured static suspicions and notes with the conversion check's
    results folded in: its confirmed causes become probe findings (merged with a static DD209 at the same place);
    once measured, a static exact-class suspicion is no longer "not measured": one the arms did not confirm is
    cleared with the numbers."""
    if conv is None:
        return probe, clearances, unmeasured, []
    from ddpdoctor.findings import Clearance

    have = {(f.rule, f.file, f.line) for f in probe}
    added = [f for f in conv.findings if (f.rule, f.file, f.line) not in have]
    if not conv.measured:
        return [*probe, *added], clearances, unmeasured, list(conv.notes)
    unmeasured = tuple(m for m in unmeasured if getattr(m, "rule", None) != "DD209")
    if not any(f.rule == "DD209" for f in [*probe, *added]):
        clearances = (*clearances, Clearance(
            rule="DD209",
            reason=(f"the conversion check ran the script with and without the conversion and compared its "
                    f"{conv.layers} BatchNorm layer{'s' if conv.layers != 1 else ''} at each of {conv.steps} "
                    "optimizer steps (momentum, eps, mode, requires_grad, optimizer group, no-grad recalibration "
                    "forwards): no layer was treated differently once converted"),
            evidence={"measured_by": MEASURED_BY, "layers": conv.layers, "steps": conv.steps}))
    return [*probe, *added], clearances, unmeasured, list(conv.notes)
