"""`--format markdown`: a report to paste into a GitHub issue or a pull-request comment, and what a notebook shows
(`Report._repr_markdown_`, which is why this module does not import the Report it renders): a headline, the
findings with their place, message, fix and evidence (folded in `<details>`), the report's tables (the BN table)
and the environment in a fenced block. No rich: plain strings."""

from __future__ import annotations

import json
import shlex
from typing import Any

from ddpdoctor import __version__
from ddpdoctor.findings import Finding, Severity, rank_findings, summarize
from ddpdoctor.formatting import fmt_err, fmt_p, fmt_rank_spans, format_value


def _cell(value: Any) -> str:
    """A table cell: pipes escaped, one line."""
    return format_value(value, max_items=None).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """Inline code that survives backticks in the text."""
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _fenced(text: str, lang: str = "") -> list[str]:
    fence = "~~~~" if "```" in text else "```"
    return [f"{fence}{lang}", text.rstrip("\n"), fence]


def headline(report: Any) -> str:
    """`3 findings: 1 critical, 2 high (2 more explained by them)` or `no findings`."""
    findings = report.ranked()
    if not findings:
        return "No findings"
    counts = summarize(findings)
    parts = [f"{counts[s.label]} {s.label}" for s in sorted(Severity, reverse=True) if counts[s.label]]
    n = len(findings)
    return f"{n} finding{'s' if n != 1 else ''}: " + ", ".join(parts)


def render_markdown(report: Any, *, verbose: bool = False) -> str:
    out: list[str] = []
    what = "triage" if report.triage is not None else "check"
    target = " ".join([report.script, *(shlex.quote(a) for a in report.args)])
    out.append(f"### ddpdoctor {what}: {_code(target)}")
    out.append("")
    out.append(f"**{headline(report)}** · {environment_summary(report.environment)} · ddpdoctor {__version__}")
    for note in report.notes:
        out.append("")
        out.append(f"> **note:** {note}")
    if report.triage is not None:
        out.extend(_triage(report.triage))
    for number, f in enumerate(report.ranked(), start=1):
        out.append("")
        out.extend(_finding(f, number, verbose=verbose))
    for name, spec in (report.tables or {}).items():
        table = _table(spec)
        if table:
            out.append("")
            out.append(f"#### {spec.get('title') or name}")
            out.append("")
            out.extend(table)
            if spec.get("caption"):
                out.append("")
                out.append(f"_{spec['caption']}_")
    out.append("")
    out.append("<details><summary>Environment</summary>")
    out.append("")
    out.extend(_fenced(environment_block(report), "text"))
    out.append("")
    out.append("</details>")
    return "\n".join(out) + "\n"


def environment_summary(env: dict[str, Any]) -> str:
    env = env or {}
    if env.get("static_only"):
        return "static analysis only"
    parts = []
    if env.get("nproc") is not None:
        parts.append(f"{env['nproc']} ranks")
    if env.get("torch"):
        parts.append(f"torch {env['torch']}")
    if env.get("cuda_emulated"):
        parts.append("CUDA emulated on CPU")
    elif env.get("device"):
        parts.append(str(env["device"]))
    return ", ".join(parts) or "environment unknown"


def environment_block(report: Any) -> str:
    """`key: value` per environment entry of the report (what ran, where), for the fenced block."""
    lines = [f"ddpdoctor: {__version__}", f"script: {report.script}"]
    if report.args:
        lines.append("args: " + " ".join(shlex.quote(a) for a in report.args))
    for key, value in (report.environment or {}).items():
        shown = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
        lines.append(f"{key}: {shown}")
    return "\n".join(lines)


def _finding(f: Finding, number: int, *, verbose: bool) -> list[str]:
    from ddpdoctor.rules import get_rule

    name = get_rule(f.rule).name
    out = [f"#### {number}. {f.rule} {name} — {f.severity.label} ({f.confidence.label}, {f.source})", ""]
    where = []
    if f.file is not None:
        where.append(_code(f.location))
    if f.ranks:
        where.append(f"{'rank' if len(f.ranks) == 1 else 'ranks'} {fmt_rank_spans(f.ranks)}")
    if where:
        out.append(" · ".join(where))
        out.append("")
    out.append(f.message)
    out.append("")
    out.append(f"**Fix:** {f.fix}")
    out.extend(_evidence(f.evidence, verbose=verbose))
    for c in f.consequences:
        g = c.finding
        out.append("")
        place = f" at {_code(g.location)}" if g.file is not None else ""
        out.append(f"- explains **{g.rule}** {get_rule(g.rule).name} ({g.severity.label}){place}: {g.message} "
                   f"_because: {c.because}_")
    return out


def _evidence(evidence: dict[str, Any], *, verbose: bool) -> list[str]:
    """Scalars and short lists as a two-column table, text blocks and nested values fenced; all inside a
    `<details>` (open with `verbose`) so a long report stays readable in an issue."""
    if not evidence:
        return []
    rows: list[str] = []
    blocks: list[str] = []
    for key, value in evidence.items():
        scalar = value is None or isinstance(value, (bool, int, float)) or (
            isinstance(value, str) and "\n" not in value)
        flat = isinstance(value, (list, tuple)) and all(
            v is None or isinstance(v, (bool, int, float, str)) for v in value)
        if scalar or flat:
            shown = _code(_cell(value)) if isinstance(value, str) and value else _cell(value)
            rows.append(f"| {_cell(key)} | {shown} |")
        else:
            text = value if isinstance(value, str) else _compact_json(value)
            blocks.extend(["", f"`{key}`", "", *_fenced(text)])
    out = ["", "<details open>" if verbose else "<details>", "<summary>Evidence</summary>", ""]
    if rows:
        out.extend(["| item | value |", "|---|---|", *rows])
    out.extend(blocks)
    out.extend(["", "</details>"])
    return out


def _compact_json(value: Any) -> str:
    """Nested evidence as JSON with one line per item of the outer list or dict (indented JSON of per-rank records
    runs to hundreds of lines in an issue)."""
    def one(v: Any) -> str:
        return json.dumps(v, default=str, ensure_ascii=False)

    if isinstance(value, list) and value:
        return "[\n" + ",\n".join(f"  {one(v)}" for v in value) + "\n]"
    if isinstance(value, dict) and value:
        return "{\n" + ",\n".join(f"  {one(str(k))}: {one(v)}" for k, v in value.items()) + "\n}"
    return one(value)


def _table(spec: Any) -> list[str]:
    if not isinstance(spec, dict):
        return []
    columns = [str(c) for c in spec.get("columns") or []]
    rows = [list(r) for r in spec.get("rows") or [] if isinstance(r, (list, tuple))]
    if not columns:
        return []
    out = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [_cell(c) for c in r[: len(columns)]] + [""] * (len(columns) - len(r))
        out.append("| " + " | ".join(cells) + " |")
    return out


def _triage(tri: dict[str, Any]) -> list[str]:
    out = ["", f"**triage:** {tri.get('headline', '')}", ""]
    for arm in tri.get("arms") or []:
        out.append(f"- arm {arm.get('name')}: {arm.get('what')} ({arm.get('steps')} steps)")
    causes = tri.get("causes") or []
    if causes:
        out.extend(["", "| # | verdict | cause | favours | measured |", "|---|---|---|---|---|"])
        for i, c in enumerate(causes, start=1):
            cause = str(c.get("cause")) + (f" {c['rule']}" if c.get("rule") else "")
            out.append(f"| {i} | {_cell(c.get('verdict'))} | {_cell(cause)} | {_cell(c.get('favours'))} | "
                       f"{_cell((c.get('measured') or {}).get('summary') or '')} |")
    return out


def render_compare_markdown(result: Any) -> str:
    """compare-bn's CompareResult as Markdown (an issue, a notebook: `CompareResult._repr_markdown_`): the verdict,
    the per-layer table, the non-i.i.d. test, the findings."""
    env, plan = result.environment, result.plan
    out = [f"### ddpdoctor compare-bn: {result.config.model or 'demo model'} on "
           f"{result.config.data or 'demo data'}", "",
           f"{env['nproc']} ranks × batch {plan['local_batch']} = global batch {plan['global_batch']}, "
           f"{plan['steps']} train-mode forwards, {plan['shard']} shards, {env['device']}/{env['backend']}", ""]
    out.extend(f"- {line}" for line in result.verdict)
    out.extend(["", "| layer | C | batch loc/sync | var err local | var err no-bcast | var err reduce | var err SyncBN "
                "| mean err local | mean err SyncBN | non-iid p |", "|---|" + "---:|" * 9])
    for layer in result.layers:
        m, v = layer.running_mean_rel_err, layer.running_var_rel_err
        cells = [layer.layer, layer.features, f"{layer.norm_batch['local']}/{layer.norm_batch['sync']}",
                 fmt_err(v.get("local")), fmt_err(v.get("local_no_broadcast_worst")), fmt_err(v.get("local_reduce")),
                 fmt_err(v.get("sync")), fmt_err(m.get("local")), fmt_err(m.get("sync")), fmt_p(layer.noniid_p)]
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    n = result.noniid
    out.append("")
    out.append(f"non-i.i.d. test: p = {fmt_p(n.p_value)} (threshold {fmt_p(n.threshold)})" if n.p_value is not None
               else f"non-i.i.d. test: not run ({n.reason})")
    for f in rank_findings(result.findings):
        out.append("")
        out.append(f"**{f.rule} {f.name}** ({f.severity.label}): {f.message}")
        out.append("")
        out.append(f"**Fix:** {f.fix}")
    return "\n".join(out) + "\n"
