"""Static analysis: find DDP/SyncBN accuracy bugs in a training script from its source alone.

Never imports torch and never runs the script. `analyze_file` reads and parses the script, builds one semantic
model of it (`ScriptModel`: what the script does to models, data and process groups, in execution order) and runs
the static hook of every rule that has one (`ddpdoctor.rules.hooks("static")`) over that model.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ddpdoctor.errors import InternalError, UsageError
from ddpdoctor.sourcefile import read_source
from ddpdoctor.findings import Finding, rank_findings
from ddpdoctor.rules import hooks
from ddpdoctor.static.model import ScriptModel

__all__ = ["analyze_file", "analyze_source", "build_model", "ScriptModel"]


def analyze_file(path: Path) -> list[Finding]:
    """Findings for one script file; `Finding.file` is `str(path)` exactly as given. The file is read the way
    Python reads a source file, and refused in one line when it is not one (ddpdoctor.sourcefile)."""
    return analyze_source(read_source(Path(path)), str(path))


def build_model(source: str, filename: str, assume: dict | None = None) -> ScriptModel:
    """Parse `source` and build its semantic model; a syntax error becomes a one-line UsageError. `assume`: facts
    the source cannot tell (the launch plan's command-line values, see `apis.TorchInterpreter`)."""
    if source.startswith("\ufeff"):
        source = source[1:]
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise UsageError(f"{filename}:{exc.lineno or 0}: syntax error: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes, absurd nesting
        raise UsageError(f"{filename}: cannot parse: {exc}") from None
    return ScriptModel.build(tree, source, filename, assume)


def analyze_source(source: str, filename: str) -> list[Finding]:
    """Findings for a script given as text; `filename` is what findings report as their file."""
    model = build_model(source, filename)
    findings: list[Finding] = []
    for rule in hooks("static"):
        try:
            findings.extend(rule.check(model))
        except Exception as exc:  # a bug in one rule: say which, in one line, instead of a traceback
            raise InternalError(f"static rule {rule.CODE} failed on {filename}: {type(exc).__name__}: {exc}") from exc
    return rank_findings(_one_per_line(findings))


def _one_per_line(findings: list[Finding]) -> list[Finding]:
    """A helper called from two places walks twice and may report one line twice: keep the strongest."""
    best: dict[tuple[str, int | None], Finding] = {}
    for f in findings:
        key = (f.rule, f.line)
        kept = best.get(key)
        if kept is None or (f.severity, f.confidence) > (kept.severity, kept.confidence):
            best[key] = f
    return list(best.values())
