"""`--format concise`: one line per finding, `file:line: DDNNN [severity] message`, as ruff and compilers print them
(editors and `grep` jump to the place). Folded consequences get their own line; `--statistics` counts per rule."""

from __future__ import annotations

from typing import Any

from ddpdoctor.causes import flatten
from ddpdoctor.findings import Finding
from ddpdoctor.report import Report
from ddpdoctor.rules import get_rule


def concise_line(f: Finding, script: str) -> str:
    """One finding on one line; a finding about the whole run points at the script."""
    where = f.location if f.file is not None else (script or "-")
    message = " ".join(f.message.split())
    return f"{where}: {f.rule} [{f.severity.label}] {message}"


def render_concise(report: Report) -> str:
    script = report.script.split(" ")[0] if report.script else ""
    lines = [concise_line(f, script) for f in flatten(report.ranked())]
    return "\n".join(lines) + ("\n" if lines else "")


def statistics(report: Report) -> list[dict[str, Any]]:
    """Per-rule counts of every finding the report holds (folded consequences included), most frequent first,
    then in code order; `severity` is the highest among the rule's findings."""
    counts: dict[str, int] = {}
    worst: dict[str, Finding] = {}
    for f in flatten(report.ranked()):
        counts[f.rule] = counts.get(f.rule, 0) + 1
        if f.rule not in worst or f.severity > worst[f.rule].severity:
            worst[f.rule] = f
    out = []
    for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        out.append({"rule": code, "name": get_rule(code).name, "severity": worst[code].severity.label, "count": n})
    return out


def render_statistics(report: Report, fmt: str) -> str:
    """`--statistics`: `count  code  [severity]  name` per rule (ruff's layout), or the same as a JSON list."""
    rows = statistics(report)
    if fmt == "json":
        from ddpdoctor.report.jsonfmt import dumps

        return dumps(rows)
    if not rows:
        return "no findings\n"
    width = max(len(str(r["count"])) for r in rows)
    sev = max(len(r["severity"]) for r in rows) + 2
    return "".join(f"{r['count']:>{width}}  {r['rule']}  {'[' + r['severity'] + ']':<{sev}}  {r['name']}\n"
                   for r in rows)
