"""One entry point per command for turning results into text: `render` for reports, `render_rules` for the
catalog. The CLI picks the format; the renderers never print, they return the whole document as a string."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.errors import UsageError
from ddpdoctor.report import Report
from ddpdoctor.report.jsonfmt import dumps
from ddpdoctor.rules import RULES

REPORT_FORMATS = ("text", "json", "sarif", "github")
RULES_FORMATS = ("text", "json")


def render(report: Report, fmt: str, *, color: bool, base_dir: Path | None = None) -> str:
    """The report as `fmt` (text, json, sarif or github). `color` only affects text; `base_dir` is what relative file
    paths in SARIF are relative to (default: the current directory)."""
    if fmt == "text":
        from ddpdoctor.report.text import render_text

        return render_text(report, color=color)
    if fmt == "json":
        return dumps(report.to_json())
    if fmt == "sarif":
        from ddpdoctor.report.sarif import render_sarif

        return render_sarif(report, base_dir=base_dir)
    if fmt == "github":
        from ddpdoctor.report.github import render_github

        return render_github(report, base_dir=base_dir)
    raise UsageError(f"--format: {fmt!r} is not one of {', '.join(REPORT_FORMATS)}")


def render_rules(fmt: str, *, color: bool) -> str:
    """`ddpdoctor rules`: the catalog as a text table or a JSON list (one object per rule, catalog order)."""
    if fmt == "text":
        from ddpdoctor.report.text import render_rules_text

        return render_rules_text(color=color)
    if fmt == "json":
        return dumps([rule.to_json() for rule in RULES])
    raise UsageError(f"--format: {fmt!r} is not one of {', '.join(RULES_FORMATS)}")
