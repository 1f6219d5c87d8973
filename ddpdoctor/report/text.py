"""The human report: header, notes, findings grouped by severity, extra tables, a one-line summary.

Rendered with rich into a string, so the same code serves a colour terminal, a pipe and `--output FILE`.
Without colour the output is plain text (no escape codes, no trailing blanks, 100 columns), readable in CI logs.
Every string that comes from a finding is printed as `Text`, never as markup: messages and evidence contain
brackets (`ranks [0, 1]`, `ignore[DD301]`) that rich would otherwise swallow as style tags.
"""

from __future__ import annotations

import io
import shlex
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ddpdoctor import __version__
from ddpdoctor.causes import flatten
from ddpdoctor.findings import Finding, Severity, summarize
from ddpdoctor.formatting import fmt_rank_spans as format_ranks
from ddpdoctor.formatting import format_value
from ddpdoctor.report import Report
from ddpdoctor.report.layout import layout, report_width
from ddpdoctor.rules import get_rule

PLAIN_WIDTH = 100
INDENT = 4
SEVERITY_STYLE = {
    Severity.CRITICAL: "bold white on red",
    Severity.HIGH: "bold red",
    Severity.MEDIUM: "bold yellow",
    Severity.LOW: "bold cyan",
    Severity.INFO: "bold blue",
}
# Evidence is shown in the text report only as far as it stays readable; --format json has all of it.
MAX_EVIDENCE_ITEMS = 8
MAX_SCALAR_CHARS = 60
MAX_BLOCK_LINES = 12
MAX_BLOCKS = 4


def make_console(*, color: bool, width: int | None = None) -> Console:
    """A console writing into a string: `COLUMNS` wide when set, else a terminal's width, else 100 columns
    (ddpdoctor.report.layout.report_width)."""
    if width is None:
        width = report_width(color, PLAIN_WIDTH)
    return Console(
        file=io.StringIO(),
        width=max(width, 40),
        color_system="auto" if color else None,
        force_terminal=color,
        markup=False,
        highlight=False,
        emoji=False,
        soft_wrap=False,
    )


def console_text(console: Console, *, color: bool) -> str:
    """The console's output; without colour, trailing blanks (table padding) are removed line by line."""
    out = console.file.getvalue()  # type: ignore[attr-defined]
    if not color:
        out = "\n".join(line.rstrip() for line in out.splitlines()) + "\n"
    return out


class Lines:
    """What a report prints, in order, printed on the console in one go (`Group`): rich's overhead per `print`
    (render options, terminal size, buffer) was half the time of rendering a report of a few dozen findings."""

    def __init__(self, *, verbose: bool = False, width: int = PLAIN_WIDTH) -> None:
        self.items: list[RenderableType] = []
        self.verbose = verbose  # `-v`: every evidence item
        self.width = width  # what tables are laid out for

    def print(self, item: RenderableType | None = None) -> None:
        self.items.append(Text("") if item is None else item)


def render_text(report: Report, *, color: bool, width: int | None = None, verbose: bool = False) -> str:
    """The whole text report (`verbose`: all evidence, `-v`)."""
    console = make_console(color=color, width=width)
    lines = Lines(verbose=verbose, width=console.width)
    _report(lines, report)
    console.print(Group(*lines.items))
    return console_text(console, color=color)


def _report(console: Lines, report: Report) -> None:
    _header(console, report)
    if report.triage is not None:
        _triage(console, report)
    findings = report.ranked()
    if findings:
        number = 0
        for severity in sorted(Severity, reverse=True):
            group = [f for f in findings if f.severity == severity]
            if not group:
                continue
            console.print()
            console.print(
                Text(f"{severity.label.upper()} ({len(group)})", style=SEVERITY_STYLE[severity]),
            )
            for i, f in enumerate(group):
                if i:
                    console.print()
                number += 1
                _finding(console, number, f)
    else:
        console.print()
        console.print(Text(_nothing_found(report), style="bold green"))
    for name, spec in (report.tables or {}).items():
        tables = _table(spec, console.width)
        if tables:
            title = spec.get("title") or name
            console.print()
            console.print(Text(str(title), style="bold"))
            for i, table in enumerate(tables):
                if i:
                    console.print()
                console.print(table)
            if spec.get("caption"):
                console.print(Text(str(spec["caption"]), style="dim"))
    console.print()
    console.print(_summary_line(findings))


VERDICT_STYLE = {
    "confirmed": "bold white on red",
    "likely": "bold yellow",
    "possible": "yellow",
    "both_arms": "bold cyan",
    "ruled_out": "green",
    "not_measurable": "dim",
}
VERDICT_LABEL = {"both_arms": "BOTH ARMS", "ruled_out": "RULED OUT", "not_measurable": "NOT MEASURABLE"}
FAVOURS_LABEL = {"syncbn": "SyncBN", "plain": "plain DDP", "subgroups": "SyncBN subgroups",
                 "fix_conversion": "fix the conversion", "none": "-"}


def _triage(console: Lines, report: Report) -> None:
    """`ddpdoctor triage`: the headline, the arms, pairing, and the ranked verdict table with each cause."""
    tri = report.triage or {}
    extra = report.triage_text or {}
    console.print()
    head = Text("triage: ", style="bold")
    head.append(str(tri.get("headline", "")), style="bold")
    console.print(head)
    for arm in tri.get("arms") or []:
        console.print(Padding(Text(f"arm {arm.get('name')}: {arm.get('what')} ({arm.get('steps')} steps)"),
                              (0, 0, 0, 2)))
    pairing = extra.get("pairing") or {}
    paired = "yes" if tri.get("paired") else "no" + (f" ({pairing.get('reason')})" if pairing.get("reason") else "")
    facts = Text(f"paired: {paired}; emulated: {'yes' if extra.get('emulated') else 'no'}; "
                 "final accuracy: not measured")
    console.print(Padding(facts, (0, 0, 0, 2)))
    causes = tri.get("causes") or []
    if not causes:
        if report.notes:
            console.print()
            _notes(console, report)
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    table.add_column("cause", no_wrap=True)
    table.add_column("favours", no_wrap=True)
    table.add_column("measured", ratio=1, overflow="fold")
    for i, c in enumerate(causes, start=1):
        verdict = str(c.get("verdict"))
        cause = str(c.get("cause")) + (f" {c['rule']}" if c.get("rule") else "")
        table.add_row(str(i), Text(VERDICT_LABEL.get(verdict, verdict.upper()), style=VERDICT_STYLE.get(verdict, "")),
                      Text(cause), Text(FAVOURS_LABEL.get(str(c.get("favours")), str(c.get("favours")))),
                      Text(str((c.get("measured") or {}).get("summary") or "")))
    console.print()
    console.print(table)
    for i, c in enumerate(causes, start=1):
        verdict = str(c.get("verdict"))
        console.print()
        line = Text(f"{i:>2}. ")
        line.append(VERDICT_LABEL.get(verdict, verdict.upper()), style=VERDICT_STYLE.get(verdict, ""))
        line.append(f"  {c.get('cause')}" + (f" ({c['rule']})" if c.get("rule") else ""), style="bold")
        line.append(f"  favours: {FAVOURS_LABEL.get(str(c.get('favours')), str(c.get('favours')))}", style="dim")
        console.print(line)
        console.print(Padding(Text(str(c.get("message"))), (0, 0, 0, INDENT)))
        fix = Text()
        fix.append("fix: ", style="bold green")
        fix.append(str(c.get("fix")))
        console.print(Padding(fix, (0, 0, 0, INDENT)))
    if report.notes:  # the verdicts first: notes (emulation, redirected writes...) after them
        console.print()
        _notes(console, report)


def render_rules_text(*, color: bool, width: int | None = None) -> str:
    """`ddpdoctor rules`: the catalog as a table, one section per category."""
    from ddpdoctor.rules import RULES  # the whole catalog, which a report never needs

    console = make_console(color=color, width=width)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("code", no_wrap=True, style="bold")
    table.add_column("name", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("static", no_wrap=True)
    table.add_column("probe", no_wrap=True)
    table.add_column("summary", ratio=1, overflow="fold")
    previous = None
    for rule in RULES:
        if previous is not None and rule.category != previous:
            table.add_section()
        previous = rule.category
        table.add_row(
            rule.code,
            rule.name,
            Text(rule.severity.label, style=SEVERITY_STYLE[rule.severity]),
            "yes" if rule.static else "-",
            "yes" if rule.probe else "-",
            rule.summary,
        )
    console.print(table)
    console.print()
    console.print(
        f"{len(RULES)} rules. `ddpdoctor explain CODE` prints one rule's documentation; "
        "--select/--ignore take codes or prefixes (DD3 = all data rules)."
    )
    return console_text(console, color=color)


def _header(console: Lines, report: Report) -> None:
    title = Text()
    title.append(f"ddpdoctor {__version__}", style="bold")
    title.append("  triage " if report.triage is not None else "  ")
    title.append(" ".join([report.script, *(shlex.quote(a) for a in report.args)]))
    console.print(title)
    console.print(Text(environment_line(report.environment), style="dim"))
    if report.triage is None:  # a triage prints its verdicts first, its notes after them (_triage)
        _notes(console, report)


def _notes(console: Lines, report: Report) -> None:
    for note in report.notes:
        console.print(Padding(Text(f"note: {note}"), (0, 0, 0, 2)))


def environment_line(env: dict[str, Any]) -> str:
    """One line describing where the script ran; tolerant of missing keys (static-only reports have few)."""
    env = env or {}
    parts: list[str] = []
    if env.get("static_only"):
        parts.append("static analysis only (the script was not run)")
    for key, label in (("torch", "torch"), ("python", "python")):
        if env.get(key):
            parts.append(f"{label} {env[key]}")
    if env.get("nproc") is not None and not env.get("static_only"):
        n = env["nproc"]
        parts.append(f"{n} rank" + ("" if n == 1 else "s") + (f" on {env['nodes']} nodes" if env.get("nodes") else ""))
    if env.get("backend"):
        parts.append(f"backend {env['backend']}")
    if env.get("device"):
        device = f"device {env['device']}"
        if env.get("cuda_emulated"):
            device += " (CUDA emulated on CPU)"
        parts.append(device)
    elif env.get("cuda_emulated"):
        parts.append("CUDA emulated on CPU")
    return "environment: " + (", ".join(parts) if parts else "unknown")


def _finding(console: Lines, number: int, f: Finding) -> None:
    head = Text()
    head.append(f"{number:>2}. ")
    head.append(f.rule, style="bold")
    head.append(" ")
    head.append(_rule_name(f.rule), style="bold")
    head.append("  ")
    head.append(f.severity.label, style=SEVERITY_STYLE[f.severity])
    head.append(f", {f.confidence.label}, {f.source}", style="dim")
    console.print(head)
    where = []
    if f.file is not None:
        where.append(f.location)
    if f.ranks:
        where.append(f"{'rank' if len(f.ranks) == 1 else 'ranks'} {format_ranks(f.ranks)}")
    if where:
        console.print(Padding(Text("  ".join(where), style="cyan"), (0, 0, 0, INDENT)))
    console.print(Padding(Text(f.message), (0, 0, 0, INDENT)))
    fix = Text()
    fix.append("fix: ", style="bold green")
    fix.append(f.fix)
    console.print(Padding(fix, (0, 0, 0, INDENT)))
    for block in _evidence(f.evidence, verbose=console.verbose):
        console.print(Padding(block, (0, 0, 0, INDENT)))
    _consequences(console, f, INDENT)


def _consequences(console: Lines, f: Finding, indent: int) -> None:
    """What this finding explains (ddpdoctor.causes), folded under it: each with its own place, message and
    the reason this run's evidence links it to the cause; fixing the cause fixes them."""
    if not f.consequences:
        return
    n = len(f.consequences)
    console.print(
        Padding(Text(f"explains {n} more finding{'s' if n != 1 else ''} (fix this first):", style="bold"),
                (0, 0, 0, indent))
    )
    for c in f.consequences:
        g = c.finding
        head = Text("- ")
        head.append(g.rule, style="bold")
        head.append(f" {_rule_name(g.rule)}  ")
        head.append(g.severity.label, style=SEVERITY_STYLE[g.severity])
        head.append(f", {g.confidence.label}, {g.source}", style="dim")
        where = [g.location] if g.file is not None else []
        if g.ranks:
            where.append(f"{'rank' if len(g.ranks) == 1 else 'ranks'} {format_ranks(g.ranks)}")
        if where:
            head.append("  " + "  ".join(where), style="cyan")
        console.print(Padding(head, (0, 0, 0, indent + 2)))
        console.print(Padding(Text(g.message), (0, 0, 0, indent + 4)))
        because = Text()
        because.append("because: ", style="bold")
        because.append(c.because)
        console.print(Padding(because, (0, 0, 0, indent + 4)))
        _consequences(console, g, indent + 4)


def _rule_name(code: str) -> str:
    try:
        return get_rule(code).name
    except KeyError:
        return "unknown-rule"


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float)) or (
        isinstance(value, str) and "\n" not in value and len(value) <= MAX_SCALAR_CHARS
    )


def _evidence(evidence: dict[str, Any], *, verbose: bool = False) -> list[Text]:
    """The evidence as far as it fits a terminal: short values on one line, multi-line text (tracebacks,
    per-rank stacks) as the tail of each block; the rest is left to --format json. `verbose` (`-v`): all of it,
    every value, list item and line, nested values as indented JSON."""
    if not evidence:
        return []
    if verbose:
        return _all_evidence(evidence)
    inline: list[str] = []
    blocks: list[tuple[str, str]] = []
    hidden = 0
    for key, value in evidence.items():
        if _is_scalar(value) or (isinstance(value, (list, tuple)) and all(_is_scalar(v) for v in value)):
            inline.append(f"{key}={format_value(value)}")
        elif isinstance(value, str):
            blocks.append((key, value))
        elif isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
            blocks.extend((f"{key}[{k}]", v) for k, v in value.items())
        else:
            hidden += 1
    out: list[Text] = []
    if len(inline) > MAX_EVIDENCE_ITEMS:
        hidden += len(inline) - MAX_EVIDENCE_ITEMS
        inline = inline[:MAX_EVIDENCE_ITEMS]
    if inline:
        line = Text("evidence: ", style="dim")
        line.append(", ".join(inline))
        out.append(line)
    if len(blocks) > MAX_BLOCKS:
        hidden += len(blocks) - MAX_BLOCKS
        blocks = blocks[:MAX_BLOCKS]
    for key, value in blocks:
        lines = value.rstrip("\n").splitlines()
        skipped = len(lines) - MAX_BLOCK_LINES
        block = Text(f"{key}:", style="dim")
        if skipped > 0:
            block.append(f" (last {MAX_BLOCK_LINES} of {len(lines)} lines)", style="dim")
            lines = lines[-MAX_BLOCK_LINES:]
        for ln in lines:
            block.append("\n  " + ln)
        out.append(block)
    if hidden:
        out.append(Text(f"(+{hidden} more evidence item{'s' if hidden > 1 else ''}: -v shows all, as does "
                        "--format json)", style="dim"))
    return out


def _all_evidence(evidence: dict[str, Any]) -> list[Text]:
    """`-v`: every evidence item, one per line; multi-line text and nested values as indented blocks."""
    import json

    from ddpdoctor.report.jsonfmt import json_safe

    out: list[Text] = []
    for key, value in evidence.items():
        if _is_scalar(value) or (isinstance(value, (list, tuple)) and all(_is_scalar(v) for v in value)):
            line = Text(f"{key}: ", style="dim")
            line.append(format_value(value, max_items=None))
            out.append(line)
            continue
        text = value if isinstance(value, str) else json.dumps(json_safe(value), indent=2, ensure_ascii=False)
        block = Text(f"{key}:", style="dim")
        for ln in text.rstrip("\n").splitlines():
            block.append("\n  " + ln)
        out.append(block)
    return out


def _table(spec: Any, width: int = PLAIN_WIDTH) -> list[Table]:
    """A `report.tables` entry ({"columns": [...], "rows": [[...]], "title": str}) as rich tables that fit `width`
    (ddpdoctor.report.layout: no cell cut, several tables repeating the first column when one is too wide);
    entries of another shape are skipped rather than crash the report after a successful run."""
    if not isinstance(spec, dict):
        return []
    columns = [str(c) for c in spec.get("columns") or []]
    rows = [list(r) for r in spec.get("rows") or [] if isinstance(r, (list, tuple))]
    if not columns and rows:
        columns = [""] * max(len(r) for r in rows)
    if not columns:
        return []
    cells = [[format_value(c) for c in r[: len(columns)]] + [""] * (len(columns) - len(r[: len(columns)]))
             for r in rows]
    numeric = []
    for i in range(len(columns)):
        values = [r[i] for r in rows if i < len(r) and r[i] is not None]
        numeric.append(bool(values) and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in values))
    tables = []
    for group, widths in layout(columns, cells, width):
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for j, i in enumerate(group):
            table.add_column(columns[i], justify="right" if numeric[i] else "left", overflow="fold",
                             width=None if widths is None else widths[j])
        for r in cells:
            table.add_row(*(Text(r[i]) for i in group))
        tables.append(table)
    return tables


def _nothing_found(report: Report) -> str:
    env = report.environment or {}
    if env.get("static_only"):
        how = "static analysis"
    elif env.get("nproc"):
        how = f"static analysis and a {env['nproc']}-rank probe run"
    else:
        how = "the analysis"
    return f"No findings: {how} found nothing to report."


def _summary_line(findings: list[Finding]) -> Text:
    counts = summarize(findings)
    line = Text("summary: ", style="bold")
    if not findings:
        line.append("no findings")
        return line
    parts = []
    for severity in sorted(Severity, reverse=True):
        n = counts[severity.label]
        parts.append((f"{n} {severity.label}", SEVERITY_STYLE[severity] if n else "dim"))
    for i, (txt, style) in enumerate(parts):
        if i:
            line.append(", ")
        line.append(txt, style=style)
    line.append(f" ({len(findings)} finding{'s' if len(findings) != 1 else ''}")
    folded = sum(len(flatten(c.finding for c in f.consequences)) for f in findings)
    if folded:
        line.append(f"; {folded} more explained by them")
    line.append(")")
    return line
