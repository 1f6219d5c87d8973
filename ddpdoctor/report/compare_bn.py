"""compare-bn's output: a table per layer, a bar chart of running_var errors, the non-i.i.d. test, findings and
the verdict as text, or the `ddpdoctor.compare-bn/1` JSON document."""

from __future__ import annotations

import io
import json
import math

from ddpdoctor.bn.stats import NONIID_THRESHOLD as NONIID_P
from ddpdoctor.comparebn.analysis import SYNC_MATCH, CompareResult
from ddpdoctor.errors import UsageError
from ddpdoctor.findings import rank_findings
from ddpdoctor.formatting import fmt_err, fmt_p
from ddpdoctor.report.layout import layout, report_width
from ddpdoctor.rules import setting

ALARM = setting("local_error_alarm").default  # DD201's: a local error shown red

PLAIN_WIDTH = 100


def render_compare(result: CompareResult, fmt: str, *, color: bool = False) -> str:
    """`text`: a table per layer, a bar chart of running_var errors, findings and the verdict; `json`: the
    `ddpdoctor.compare-bn/1` document."""
    if fmt == "json":
        return json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n"
    if fmt == "markdown":
        from ddpdoctor.report.markdown import render_compare_markdown

        return render_compare_markdown(result)
    if fmt != "text":
        raise UsageError(f"--format: {fmt!r} is not one of text, json, markdown")
    return _render_text(result, color=color)


def _bar(x: float | None, width: int, lo: float = 1e-8, hi: float = 1.0) -> str:
    """A log-scale bar from `lo` (empty) to `hi` (full), in eighths of a cell."""
    if x is None or not x > 0:
        return ""
    frac = (math.log10(max(min(x, hi), lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    eighths = max(1, round(frac * width * 8))
    full, rest = divmod(eighths, 8)
    return "█" * full + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[rest]


def _describe(spec: str | None, demo: str) -> str:
    return spec if spec else demo


def _render_text(result: CompareResult, *, color: bool) -> str:
    from rich import box
    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    width = report_width(color, PLAIN_WIDTH)
    buf = io.StringIO()
    console = Console(
        file=buf, width=width, color_system="standard" if color else None, force_terminal=color,
        highlight=False, emoji=False, markup=False,
    )
    env, plan = result.environment, result.plan
    n_bn = len(result.layers)
    console.print(
        Text.assemble(
            ("compare-bn ", "bold"),
            f"{_describe(result.config.model, 'demo model')} ({n_bn} BN layers) on "
            f"{_describe(result.config.data, 'demo data')} ({env['samples']} samples): {env['nproc']} ranks x "
            f"batch {plan['local_batch']} = global batch {plan['global_batch']}, {plan['steps']} train-mode "
            f"forwards, {plan['shard']} shards, {env['device']}/{env['backend']}",
        )
    )
    if plan.get("uneven_steps"):
        console.print(f"{plan['uneven_steps']} of {plan['steps']} steps had uneven per-rank batch sizes.")

    # related columns side by side (the four running_var errors, then the means): a terminal too narrow for all
    # of them gets one table per group, each led by the layer (ddpdoctor.report.layout), never a cut number
    headers = ["layer", "C", "batch\nloc/sync", "var err\nlocal", "var err\nno-bcast", "var err\nreduce",
               "var err\nSyncBN", "mean err\nlocal", "mean err\nno-bcast", "mean err\nSyncBN",
               "mean shift\nlocal (sd)", "var spread\nno-bcast", "non-iid\np"]
    rows: list[list[tuple[str, str]]] = []
    for layer in result.layers:
        m, v, sh = layer.running_mean_rel_err, layer.running_var_rel_err, layer.running_mean_shift_sd
        p = layer.noniid_p
        shift = max((x for x in (sh.get("local"), sh.get("local_no_broadcast_worst")) if x is not None), default=None)
        rows.append([
            (layer.layer, ""),
            (str(layer.features), ""),
            (f"{layer.norm_batch['local']}/{layer.norm_batch['sync']}", ""),
            _styled(v.get("local")),
            _styled(v.get("local_no_broadcast_worst")),
            _styled(v.get("local_reduce")),
            _styled(v.get("sync")),
            (fmt_err(m.get("local")), ""),
            (fmt_err(m.get("local_no_broadcast_worst")), ""),
            (fmt_err(m.get("sync")), ""),
            ("-" if shift is None else f"{shift:.2g}", ""),
            (fmt_err(layer.rank_spread["running_var"].get("local_no_broadcast")), ""),
            (fmt_p(p), "bold red" if p is not None and p < NONIID_P else ""),
        ])
    console.print(Text("running statistics vs the exact global-batch BN (relative L2 error over channels)",
                       style="bold"))
    plain = [[text for text, _ in row] for row in rows]
    sections = [[1, 2], [3, 4, 5, 6], [7, 8, 9, 10], [11, 12]]  # size, var errors, mean errors, spread and test
    for k, (group, widths) in enumerate(layout(headers, plain, width, sections=sections)):
        if k:
            console.print()
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for j, i in enumerate(group):
            table.add_column(headers[i], justify="left" if i == 0 else "right", overflow="fold",
                             width=None if widths is None else widths[j])
        for row in rows:
            table.add_row(*(Text(row[i][0], style=row[i][1]) for i in group))
        console.print(table)
    console.print(
        Padding(
            "local = rank 0 under DDP's default buffer broadcast (what a rank-0 checkpoint holds); no-bcast = the "
            "worst rank with broadcast_buffers=False; reduce = per-GPU BN with the running statistics averaged over "
            "the ranks at the end of the epoch (timm --dist-bn reduce); SyncBN = the worst rank; "
            "mean shift = RMS over channels of "
            "the running_mean error in reference standard deviations; spread = the largest distance of a rank "
            "from the ranks' average.",
            (0, 0, 1, 0),
        )
    )

    console.print(Text("running_var error vs the global batch (log scale: empty = 1e-8, full = 100%)", style="bold"))
    name_w = max((len(layer.layer) for layer in result.layers), default=5)
    bar_w = 32
    for layer in result.layers:
        if not layer.tracked:
            console.print(f"  {layer.layer:<{name_w}}  (no running statistics)")
            continue
        bars = (("local", "local"), ("no-bcast", "local_no_broadcast_worst"), ("reduce", "local_reduce"),
                ("SyncBN", "sync"))
        for i, (label, key) in enumerate(bars):
            x = layer.running_var_rel_err.get(key)
            style = "green" if key == "sync" else ("red" if (x or 0) >= ALARM else "yellow")
            console.print(
                Text.assemble(
                    f"  {layer.layer if i == 0 else '':<{name_w}}  {label:<8} ",
                    (f"{_bar(x, bar_w):<{bar_w + 1}}", style),
                    f" {fmt_err(x)}",
                )
            )

    n = result.noniid
    console.print()
    console.print(Text("non-i.i.d. test", style="bold"))
    if n.p_value is None:
        console.print(Padding(f"not run: {n.reason}", (0, 0, 0, 2)))
    else:
        strongest = next((t for t in n.layers if t.layer == n.layer), None)
        f_text = ""
        if strongest is not None and strongest.channel_f is not None:
            f_text = f", F({strongest.df_rank}, {strongest.df_residual}) = {strongest.channel_f:.3g}"
        console.print(
            Padding(
                f"p = {fmt_p(n.p_value)} over {len(n.layers)} layers, {n.ranks} ranks x {n.steps} steps; strongest: "
                f"{n.layer} channel {n.channel}{f_text}\nmethod: {n.method}",
                (0, 0, 0, 2),
            )
        )

    if result.findings:
        console.print()
        console.print(Text("findings", style="bold"))
        for f in rank_findings(result.findings):
            console.print(
                Padding(
                    Text.assemble((f"{f.rule} {f.name}", "bold"), f" ({f.severity.label}): ", f.message), (0, 0, 0, 2)
                )
            )
            console.print(Padding(f"fix: {f.fix}", (0, 0, 0, 4)))
    console.print()
    console.print(Text("verdict", style="bold"))
    for line in result.verdict:
        console.print(Padding(line, (0, 0, 0, 2)))
    # rich pads every line to the console width; trailing blanks only get in the way of diffs and pagers
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def _styled(x: float | None) -> tuple[str, str]:
    """A running-statistics error and its style: red at the alarm, green where it matches the reference."""
    if x is None:
        return "-", ""
    return fmt_err(x), "red" if x >= ALARM else ("green" if x <= SYNC_MATCH else "")
