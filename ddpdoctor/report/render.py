"""One entry point per command for turning results into text: `render` for reports, `render_rules` for the
catalog. The CLI picks the format; the renderers never print, they return the whole document as a string."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.errors import UsageError
from ddpdoctor.report import Report
from ddpdoctor.report.jsonfmt import dumps

REPORT_FORMATS = ("text", "json", "sarif", "github", "concise", "markdown")
RULES_FORMATS = ("text", "json")


def render(report: Report, fmt: str, *, color: bool, base_dir: Path | None = None, verbose: bool = False,
           width: int | None = None) -> str:
    """The report as `fmt` (text, json, sarif, github, concise or markdown). `color` only affects text, `verbose`
    (all evidence) text and markdown; `base_dir` is what relative file paths in SARIF are relative to (default: the
    current directory); `width` the text report's columns (default: ddpdoctor.report.text.report_width)."""
    if fmt == "text":
        from ddpdoctor.report.text import render_text

        return render_text(report, color=color, verbose=verbose, width=width)
    if fmt == "concise":
        from ddpdoctor.report.concise import render_concise

        return render_concise(report)
    if fmt == "markdown":
        from ddpdoctor.report.markdown import render_markdown

        return render_markdown(report, verbose=verbose)
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
        from ddpdoctor.rules import RULES  # the whole catalog, which a report never needs

        return dumps([rule.to_json() for rule in RULES])
    raise UsageError(f"--format: {fmt!r} is not one of {', '.join(RULES_FORMATS)}")
