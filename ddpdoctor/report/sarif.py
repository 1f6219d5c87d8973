"""SARIF 2.1.0 output, for code-scanning UIs (GitHub, GitLab, VS Code's SARIF viewer).

Shape, following bandit's formatter: one run; `tool.driver.rules` holds every rule that has a result, exactly
once, with its documentation from the catalog (`help.text`/`help.markdown`); results point at their rule by id and
index, carry a `level` mapped from our severity, and keep our own fields (confidence, severity, sources, ranks,
evidence, fix) in `properties`. Report notes become tool execution notifications of the invocation.

SARIF's `fixes[]` require concrete file edits, which we do not have, so the rule's fix text travels in the
result message and in `properties.fix`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from ddpdoctor import __version__
from ddpdoctor.causes import flatten
from ddpdoctor.findings import Finding, Severity
from ddpdoctor.report import Report
from ddpdoctor.report.jsonfmt import dumps, json_safe
from ddpdoctor.rules import Rule, get_rule, help_uri

SARIF_VERSION = "2.1.0"
SARIF_SCHEMA_URI = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
INFORMATION_URI = "https://github.com/ddpdoctor/ddpdoctor"
SRCROOT = "SRCROOT"

LEVELS = {
    Severity.CRITICAL: "error",
    Severity.HIGH: "error",
    Severity.MEDIUM: "warning",
    Severity.LOW: "note",
    Severity.INFO: "note",
}


def sarif_level(severity: Severity) -> str:
    return LEVELS[severity]


def render_sarif(report: Report, *, base_dir: Path | None = None) -> str:
    return dumps(sarif_log(report, base_dir=base_dir))


def sarif_log(report: Report, *, base_dir: Path | None = None) -> dict[str, Any]:
    """The SARIF log as a dict. Relative file paths are relative to `base_dir` (default: the current
    directory, which is what `check` resolves the findings' files against); it becomes `SRCROOT`."""
    root = (base_dir or Path.cwd()).resolve()
    findings = report.ranked()
    rules = sorted({get_rule(f.rule) for f in findings}, key=lambda r: r.code)
    index = {r.code: i for i, r in enumerate(rules)}
    run: dict[str, Any] = {
        "tool": {
            "driver": {
                "name": "ddpdoctor",
                "version": __version__,
                "semanticVersion": __version__,
                "informationUri": INFORMATION_URI,
                "rules": [rule_descriptor(r) for r in rules],
            }
        },
        "invocations": [_invocation(report)],
        "originalUriBaseIds": {SRCROOT: {"uri": _dir_uri(root)}},
        "results": [_result(f, index[get_rule(f.rule).code], report, root) for f in findings],
        "properties": json_safe(
            {
                "target": {"script": report.script, "args": list(report.args)},
                "environment": report.environment,
            }
        ),
    }
    return {"$schema": SARIF_SCHEMA_URI, "version": SARIF_VERSION, "runs": [run]}


def rule_descriptor(rule: Rule) -> dict[str, Any]:
    """`reportingDescriptor` for one catalog rule."""
    return {
        "id": rule.code,
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": rule.what},
        "help": {"text": rule.documentation(), "markdown": rule.markdown()},
        "helpUri": help_uri(rule.code),
        "defaultConfiguration": {"level": sarif_level(rule.severity)},
        "properties": {
            "severity": rule.severity.label,
            "category": rule.category,
            "static": rule.static,
            "probe": rule.probe,
            "tags": ["ddp", rule.category],
        },
    }


def _invocation(report: Report) -> dict[str, Any]:
    invocation: dict[str, Any] = {"executionSuccessful": True}
    if report.notes:
        invocation["toolExecutionNotifications"] = [
            {"message": {"text": note}, "level": "note"} for note in report.notes
        ]
    return invocation


def _message(f: Finding) -> str:
    text = f.message.rstrip()
    if text and text[-1] not in ".!?":
        text += "."
    return f"{text} Fix: {f.fix}"


def _result(f: Finding, rule_index: int, report: Report, root: Path) -> dict[str, Any]:
    rule = get_rule(f.rule)
    result: dict[str, Any] = {
        "ruleId": rule.code,
        "ruleIndex": rule_index,
        "level": sarif_level(f.severity),
        "message": {"text": _message(f)},
    }
    # Code-scanning UIs only show results that have a location; a probe finding without a source line is
    # about the script as a whole, so it points at the script, without a region.
    path = f.file if f.file is not None else report.script
    if path:
        physical: dict[str, Any] = {"artifactLocation": artifact_location(path, root)}
        if f.file is not None and f.line and f.line >= 1:
            physical["region"] = {"startLine": int(f.line)}
        result["locations"] = [{"physicalLocation": physical}]
    related = _related(f, report, root)
    if related:
        result["relatedLocations"] = related
    result["properties"] = json_safe(
        {
            "name": rule.name,
            "severity": f.severity.label,
            "confidence": f.confidence.label,
            "source": f.source,
            "sources": list(f.sources),
            "ranks": list(f.ranks),
            "fix": f.fix,
            "evidence": f.evidence,
            "consequences": [c.to_json() for c in f.consequences],
        }
    )
    return result


def _related(f: Finding, report: Report, root: Path) -> list[dict[str, Any]]:
    """The findings this one explains (ddpdoctor.causes), as related locations: code-scanning UIs show them with
    the cause instead of as results of their own."""
    out: list[dict[str, Any]] = []
    for c in flatten([f])[1:]:
        g = c
        path = g.file if g.file is not None else report.script
        if not path:
            continue
        physical: dict[str, Any] = {"artifactLocation": artifact_location(path, root)}
        if g.file is not None and g.line and g.line >= 1:
            physical["region"] = {"startLine": int(g.line)}
        out.append({
            "id": len(out),
            "physicalLocation": physical,
            "message": {"text": f"{g.rule} {get_rule(g.rule).name} ({g.severity.label}, explained by {f.rule}): "
                                f"{g.message}"},
        })
    return out


def artifact_location(path: str, root: Path) -> dict[str, Any]:
    """A relative URI under SRCROOT when the file lies in the analysed tree, else an absolute file URI."""
    p = Path(path)
    full = (p if p.is_absolute() else root / p).resolve()
    try:
        rel = full.relative_to(root)
    except ValueError:
        return {"uri": full.as_uri()}
    return {"uri": _quote(rel.as_posix()), "uriBaseId": SRCROOT}


def _quote(posix_path: str) -> str:
    return quote(posix_path, safe="/-._~")


def _dir_uri(directory: Path) -> str:
    uri = directory.as_uri()
    return uri if uri.endswith("/") else uri + "/"
