"""`--format github`: GitHub Actions workflow commands, one annotation per finding.

A workflow step that runs `ddpdoctor check --static --format github train.py` gets each finding shown on the
pull request's diff at its file and line (`::error file=train.py,line=41,title=DD301 ...::message`). Severity maps
as SARIF's levels do (critical/high → error, medium → warning, low/info → notice). A probe finding without a
source line is about the script as a whole, so it is annotated on the script without a line. Report notes become
plain lines (the runner prints them in the log, they annotate nothing); the last line is the summary.

Paths are written relative to the directory the findings are relative to (the current directory for `check`),
which is the repository root when the step runs there, as GitHub expects. Reference for the command syntax and
its escaping: "Workflow commands for GitHub Actions" (docs.github.com), `@actions/core`'s `issueCommand`.
"""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.findings import Finding, Severity, summarize
from ddpdoctor.report import Report
from ddpdoctor.rules import get_rule

LEVELS = {
    Severity.CRITICAL: "error",
    Severity.HIGH: "error",
    Severity.MEDIUM: "warning",
    Severity.LOW: "notice",
    Severity.INFO: "notice",
}


def escape_data(text: str) -> str:
    """The message part of a workflow command (after `::`)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A property value (file, title): also `:` and `,`, which separate properties."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def _path(path: str, root: Path | None) -> str:
    p = Path(path)
    if root is None or not p.is_absolute():
        return p.as_posix()
    try:
        return p.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return p.as_posix()


def annotation(f: Finding, report: Report, root: Path | None = None) -> str:
    """One workflow command for one finding."""
    rule = get_rule(f.rule)
    props: list[str] = []
    path = f.file if f.file is not None else report.script
    if path:
        props.append(f"file={escape_property(_path(path, root))}")
        if f.file is not None and f.line and f.line >= 1:
            props.append(f"line={int(f.line)}")
    title = f"{rule.code} {rule.name} ({f.severity.label}, {f.confidence.label}, {f.source})"
    props.append(f"title={escape_property(title)}")
    message = f.message.rstrip()
    if message and message[-1] not in ".!?":
        message += "."
    body = f"{message}\nFix: {f.fix}"
    return f"::{LEVELS[f.severity]} {','.join(props)}::{escape_data(body)}"


def render_github(report: Report, *, base_dir: Path | None = None) -> str:
    findings = report.ranked()
    lines = [annotation(f, report, base_dir) for f in findings]
    lines.extend(f"ddpdoctor: note: {note}" for note in report.notes)
    counts = summarize(findings)
    summary = ", ".join(f"{counts[s.label]} {s.label}" for s in sorted(Severity, reverse=True))
    lines.append(f"ddpdoctor: {summary} ({len(findings)} finding{'s' if len(findings) != 1 else ''})")
    return "\n".join(lines) + "\n"
