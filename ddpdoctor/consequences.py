"""The measured accuracy cost of each defect (`ddpdoctor/data/consequences.json`), as `explain` and the README show it.

The data file is written by `benchmarks/consequences/run.py` and by nothing else: every number here was measured
(scikit-learn's digits, an MLP with BatchNorm, real DDP on 2 CPU ranks; each defect against its fixed twin over
the same seeds). This module only reads and formats it; it imports nothing of torch.
"""

from __future__ import annotations

import json
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).resolve().parent / "data" / "consequences.json"
README_BEGIN = "<!-- consequences table: generated from ddpdoctor/data/consequences.json -->"
README_END = "<!-- end of consequences table -->"


@lru_cache(maxsize=1)
def load() -> dict[str, Any] | None:
    """The benchmark's result, or None where the file is absent (a trimmed install)."""
    try:
        return json.loads(DATA_FILE.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def rows_for(code: str, data: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rows measuring `code`, its primary row first."""
    data = load() if data is None else data
    if not data:
        return []
    rows = [r for r in data["rows"] if code in r["rules"]]
    return sorted(rows, key=lambda r: not r["primary"])


def _points(value: float) -> str:
    """A signed cost in points: a cost is a loss, so it is shown negative (-1.2 points), a gain positive."""
    if round(value, 1) == 0:
        return "0.0"
    return f"{-value:+.1f}".replace("-", "\u2212")


def row_line(row: dict[str, Any], seeds: int) -> str:
    verdict = (f"significant, p = {row['p']:.2g}" if row["significant"]
               else f"not significant, p = {row['p']:.2g}; detectable: {row['detectable']:.1f}")
    return (f"measured cost on digits: {_points(row['cost'])} points (\u00b1 {row['cost_se']:.1f} s.e., {seeds} "
            f"seeds, {row['setting']}; {verdict}): {row['defect_arm']} vs {row['twin_arm']}")


def explain_lines(code: str) -> list[str]:
    """`explain`'s "Measured cost" lines for `code` (empty: not measured)."""
    data = load()
    rows = rows_for(code, data)
    if not rows:
        return []
    seeds = len(data["seeds"])
    return [row_line(r, seeds) for r in rows]


def render_markdown(data: dict[str, Any]) -> str:
    """The README's table."""
    seeds = len(data["seeds"])
    head = (
        "| rule | defect (vs fixed twin) | setting | defect acc. | twin acc. | baseline acc. | cost (points) | "
        "Welch p | detectable |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in data["rows"]:
        def acc(arm: dict[str, Any]) -> str:
            return f"{arm['mean']:.1f} \u00b1 {arm['std']:.1f}"

        sig = f"**{r['p']:.2g}**" if r["significant"] else f"{r['p']:.2g}"
        lines.append(
            f"| {r['label']} | {r['defect_arm']} (vs: {r['twin_arm']}) | {r['setting']} | {acc(r['defect'])} | "
            f"{acc(r['twin'])} | {acc(r['baseline'])} | {_points(r['cost'])} \u00b1 {r['cost_se']:.1f} | {sig} | "
            f"{r['detectable']:.1f} |"
        )
    load_avg = data["load_average"]
    if data["wall_s"] is None:
        timing = (f"Written from the finished runs of an interrupted benchmark: the runs' own wall times add up to "
                  f"{data['run_seconds']:.0f} s (groups of ranks overlapping)")
    else:
        timing = f"Benchmark wall time {data['wall_s']:.0f} s"
    lines.append("")
    lines.append(
        f"Accuracy: test-set mean \u00b1 std over {seeds} seeds (percent); cost: twin \u2212 defect, shown as the "
        f"loss in points \u00b1 its standard error; p: {data['test']}; baseline: the single-process recipe "
        f"({data['model']}). {timing} on {data['cpus']} CPUs at load average "
        f"{load_avg['before'][0]:.1f} \u2192 {load_avg['after'][0]:.1f}; torch {data['versions']['torch']}, "
        f"scikit-learn {data['versions']['scikit-learn']}."
    )
    if data.get("unmeasured_rows"):
        lines.append("")
        lines.append("Not measured yet (the benchmark defines them; their runs did not finish): "
                     + "; ".join(data["unmeasured_rows"]) + ".")
    return "\n".join(lines)


def explain_section(rule: Any, width: int = 100) -> str:
    """`explain`'s "Measured cost" section for a rule (empty where the benchmark did not measure it), with the
    rule's `cost_note` where its severity differs from what the cost would give."""
    lines = explain_lines(rule.code)
    if not lines:
        return ""
    paragraphs = [*lines, *([f"Severity: {rule.cost_note}"] if rule.cost_note else [])]
    body = "\n".join(textwrap.fill(p, width=width, break_long_words=False, break_on_hyphens=False)
                     for p in paragraphs)
    return f"\nMeasured cost (benchmarks/consequences/)\n{body}\n"
