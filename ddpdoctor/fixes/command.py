"""What `check --diff` / `--fix` / `--fix --verify` do with a report (the CLI imports this lazily).

- `--diff`: prints a unified diff of every file with a mechanical fix (paths as the report shows them, so `patch
  -p0` applies it from the same directory) and changes nothing; exits 1 when there is a diff, 0 when none (ruff's
  convention); the findings left without a patch are listed on stderr.
- `--fix`: writes each patched file beside its original as `NAME.ddpdoctor-fixed.py` (a new file: never over the
  original nor over a file that exists, refused with exit 2), then prints the report of the original, each
  finding's fix line saying where it was fixed or why it has no automatic fix; exits as `check` does (the original
  still has its findings).
- `--fix --verify`: also re-runs the analysis (the probe unless --static) on the patched copy in a scratch folder
  (removed after) and says, per fixed finding, "fix verified: <measured quantity before -> after>" or "fix did not
  remove the symptom" (the finding is then demoted one severity and confidence level: the diagnosis is in doubt).
"""

from __future__ import annotations

import difflib
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from ddpdoctor.errors import UsageError
from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.fixes.engine import Plan, fix_module, plan

__all__ = ["FIXED_SUFFIX", "fixed_path", "plans", "check_fix_options", "refuse_existing", "run_diff", "run_fix"]

FIXED_SUFFIX = ".ddpdoctor-fixed"


def fixed_path(path: Path) -> Path:
    """Where `--fix` writes the patched copy of `path`: beside it, `train.py` -> `train.ddpdoctor-fixed.py`."""
    return path.with_name(f"{path.stem}{FIXED_SUFFIX}{path.suffix}")


def refuse_existing(script: Path) -> None:
    """`--fix` never writes over a file: refused (exit 2) before anything runs when the copy's name is taken."""
    target = fixed_path(script)
    if target.exists() or target.is_symlink():
        raise UsageError(f"{target}: exists; --fix never overwrites a file (remove or rename it first)")


def check_fix_options(cfg, *, diff: bool, fix: bool, verify: bool, unsafe: bool = False) -> None:  # noqa: ANN001 - CheckConfig
    """The option combinations that make sense, and `--fix`'s target free: else a one-line UsageError (exit 2)."""
    if diff and fix:
        raise UsageError("--diff and --fix exclude each other: --diff only prints, --fix writes a fixed copy")
    if unsafe and not (diff or fix):
        raise UsageError("--unsafe-fixes goes with --diff or --fix")
    if verify and not fix:
        raise UsageError("--verify needs --fix (it analyses the fixed copy again)")
    if fix:
        refuse_existing(Path(cfg.script))


@dataclass
class FilePlan:
    path: Path  # where the file is on disk
    shown: str  # the path as the report shows it
    plan: Plan


def plans(report, *, unsafe: bool = False) -> tuple[list[FilePlan], list[tuple[Finding, str]]]:  # noqa: ANN001 - ddpdoctor.report.Report
    """One plan per file the findings point at, and the findings with no place to fix."""
    base = Path(report.base_dir or ".")
    by_file: dict[str, list[Finding]] = {}
    placeless: list[tuple[Finding, str]] = []
    for f in report.findings:
        if not f.file or not f.line:
            reason = "no automatic fix for this rule" if fix_module(f.rule) is None else "no place in the code"
            placeless.append((f, reason))
        else:
            by_file.setdefault(f.file, []).append(f)
    out = []
    for shown, found in by_file.items():
        path = base / shown
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            placeless += [(f, f"{shown} could not be read ({exc})") for f in found]
            continue
        ordered = sorted(found, key=lambda f: (f.line or 0, f.rule))
        out.append(FilePlan(path, shown, plan(shown, text, ordered, unsafe=unsafe)))
    return out, placeless


def _describe(f: Finding) -> str:
    return f"{f.rule} at {f.location}"


def _unfixed_lines(file_plans: list[FilePlan], placeless: list[tuple[Finding, str]]) -> list[str]:
    return [f"  {_describe(f)}: no automatic fix ({why})"
            for f, why in [*placeless, *(u for fp in file_plans for u in fp.plan.unfixed)]]


def run_diff(report, *, unsafe: bool = False) -> int:  # noqa: ANN001
    """`check --diff`: the diff on stdout, what it fixes and what it leaves on stderr; 1 when there is a diff."""
    file_plans, placeless = plans(report, unsafe=unsafe)
    text = "".join(fp.plan.diff() for fp in file_plans if fp.plan.patches)
    sys.stdout.write(text)
    sys.stdout.flush()
    fixed = [f"  {_describe(f)}: {p.summary}" for fp in file_plans for f, p in fp.plan.fixed]
    lines = ([f"ddpdoctor: {len(fixed)} automatic fix(es):", *fixed] if fixed
             else ["ddpdoctor: no automatic fix applies"])
    lines += _unfixed_lines(file_plans, placeless)
    sys.stderr.write("\n".join(lines) + "\n")
    return 1 if text else 0


def _no_fix(why: str) -> str:
    return "no automatic fix" if why == "no automatic fix for this rule" else f"no automatic fix: {why}"


def _annotated(f: Finding, note: str) -> Finding:
    return replace(f, fix=f"{f.fix} ({note})")


def run_fix(report, cfg, *, verify: bool, unsafe: bool = False):  # noqa: ANN001, ANN201 - Report, CheckConfig -> Report
    """`check --fix [--verify]`: write the fixed copies, and the report of the original with each finding's fix
    line saying what happened to it."""
    file_plans, placeless = plans(report, unsafe=unsafe)
    notes: dict[Finding, str] = {f: _no_fix(why) for f, why in placeless}
    written: list[str] = []
    for fp in file_plans:
        for f, why in fp.plan.unfixed:
            notes[f] = _no_fix(why)
        if not fp.plan.patches:
            continue
        target = fixed_path(fp.path)
        try:
            with open(target, "x", encoding="utf-8", newline="") as out:  # never over an existing file
                out.write(fp.plan.new_text)
        except FileExistsError:
            raise UsageError(f"{target}: exists; --fix never overwrites a file (remove or rename it first)") from None
        except OSError as exc:
            raise UsageError(f"{target}: cannot write the fixed copy ({exc.strerror or exc})") from None
        shown_target = str(Path(fp.shown).with_name(target.name))
        written.append(shown_target)
        for f, p in fp.plan.fixed:
            notes[f] = f"automatic fix written to {shown_target}: {p.summary}"
    extra: list[str] = [f"fixed copy written: {w}" for w in written] or ["no automatic fix applies: nothing written"]
    findings = list(report.findings)
    if verify:
        script_plan = next((fp for fp in file_plans if fp.path.resolve() == Path(cfg.script).resolve()), None)
        if script_plan is None or not script_plan.plan.patches:
            extra.append("--verify: nothing to verify (no automatic fix in the script)")
        else:
            verdicts, more = _verify(cfg, script_plan, {f.rule for f in findings})
            extra += more
            new: list[Finding] = []
            for f in findings:
                verdict = verdicts.get(f)
                if verdict is None:
                    new.append(f)
                elif verdict[0]:
                    notes[f] = f"{notes[f]}; fix verified: {verdict[1]}"
                    new.append(f)
                else:
                    new.append(_demoted(_annotated(f, f"{notes.pop(f)}; fix did not remove the symptom: {verdict[1]}")))
            findings = new
    findings = [_annotated(f, notes[f]) if f in notes else f for f in findings]
    return replace(report, findings=tuple(findings), notes=(*report.notes, *extra))


def _demoted(f: Finding) -> Finding:
    """A finding whose fix left its symptom: one severity and confidence level down, and said so."""
    sev = Severity(max(int(f.severity) - 1, int(min(Severity))))
    conf = Confidence(max(int(f.confidence) - 1, int(min(Confidence))))
    return replace(f, severity=sev, confidence=conf,
                   message=f"{f.message} (diagnosis in doubt: the automatic fix left the symptom in place)")


def _line_map(old: str, new: str) -> dict[int, int]:
    """Old line -> new line for the lines the patch kept."""
    out: dict[int, int] = {}
    sm = difflib.SequenceMatcher(a=old.splitlines(), b=new.splitlines(), autojunk=False)
    for tag, i1, i2, j1, _j2 in sm.get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                out[i1 + k + 1] = j1 + k + 1
    return out


def _value(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _verify(cfg, fp: FilePlan, original: set[str]) -> tuple[dict[Finding, tuple[bool, str]], list[str]]:  # noqa: ANN001
    """Run the analysis again on the patched copy (in a scratch folder, removed after): per fixed finding of the
    script, (symptom gone, "quantity before -> after")."""
    from ddpdoctor.check import run_check

    new_text = fp.plan.new_text
    line_map = _line_map(fp.plan.text, new_text)
    script = Path(cfg.script)
    verdicts: dict[Finding, tuple[bool, str]] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-verify-") as tmp:
        copy = Path(tmp) / script.name
        copy.write_text(new_text, encoding="utf-8")
        run_dir = None if cfg.static_only else Path(tmp) / "run"
        after_cfg = replace(cfg, script=copy, paths=(), keep_run=run_dir, quiet=True)
        old_path = os.environ.get("PYTHONPATH")
        # the script's own modules stay importable from the copy
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(script.resolve().parent), old_path) if p)
        try:
            after = run_check(after_cfg)
            clearances = ()
            if run_dir is not None:
                from ddpdoctor.analyses import analyze_run

                clearances = analyze_run(run_dir).clearances
        finally:
            if old_path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old_path
        copy_name = str(copy)
        after_in_script = [g for g in after.findings if g.file and Path(after.base_dir or ".", g.file).resolve()
                           == copy.resolve() or g.file == copy_name]
    how = "the probe" if not cfg.static_only else "static analysis"
    for f, _patch in fp.plan.fixed:
        mapped = line_map.get(f.line or 0)
        still = [g for g in after_in_script if g.rule == f.rule
                 and (mapped is None or g.line is None or abs(g.line - mapped) <= 3)]
        key = getattr(fix_module(f.rule), "MEASURE", None)
        before = _value(f.evidence.get(key)) if key else "found"
        if still:
            after_value = _value(still[0].evidence.get(key)) if key else "still found"
            verdicts[f] = (False, f"{f.rule} {key or ''} {before} -> {after_value} ({how} on the fixed copy)")
            continue
        cleared = next((c for c in clearances if c.rule == f.rule), None)
        if cleared is not None and key and key in cleared.evidence:
            after_value = _value(cleared.evidence[key])
        elif cleared is not None:
            after_value = f"measured: {cleared.reason}".replace(copy_name, str(fixed_path(Path(fp.shown))))
        else:
            after_value = "not found"
        verdicts[f] = (True, f"{f.rule} {key + ' ' if key else ''}{before} -> {after_value} ({how} on the fixed "
                             "copy)")
    new_rules = sorted({g.rule for g in after_in_script} - original)
    if new_rules:
        notes.append(f"--verify: the fixed copy has findings the original did not: {', '.join(new_rules)}")
    return verdicts, notes
