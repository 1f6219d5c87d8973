"""How numbers and rank lists are written in messages, reports and compare-bn's tables: one module, one style each.

Messages are read by people triaging a run: numbers are short (`fmt_num`; `fmt_measure` in triage's verdicts),
fractions are percentages (`pct`), relative errors switch to powers of ten when tiny (`fmt_err`), p-values keep their
order of magnitude (`fmt_p`), and rank lists collapse into spans (`fmt_ranks` in sentences, `fmt_rank_spans` in the
report's ranks column). Pure, no torch.
"""

from __future__ import annotations

import math
from typing import Iterable


def _spans(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted distinct ranks as (first, last) runs of consecutive values."""
    values = sorted(set(ranks))
    spans: list[tuple[int, int]] = []
    for r in values:
        if spans and r == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], r)
        else:
            spans.append((r, r))
    return spans


def fmt_rank_spans(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 3, 6] → "0-3, 6": the report's ranks column (rank lists get long on 64 GPUs)."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in _spans(ranks))


def fmt_ranks(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] → "ranks 0–2, 5"; [0, 1] → "ranks 0, 1"; [3] → "rank 3"; [] → "no rank": ranks in a sentence."""
    spans = _spans(ranks)
    if not spans:
        return "no rank"
    parts = [str(a) if a == b else (f"{a}–{b}" if b > a + 1 else f"{a}, {b}") for a, b in spans]
    single = len(spans) == 1 and spans[0][0] == spans[0][1]
    return ("rank " if single else "ranks ") + ", ".join(parts)


def fmt_num(x: float) -> str:
    """Compact number for messages: 0.1, 0.0025, 1.2e-07, 64."""
    if x == 0:
        return "0"
    if float(x).is_integer() and abs(x) < 1e9:
        return str(int(x))
    if 1e-3 <= abs(x) < 1e6:
        return f"{x:.4g}"
    return f"{x:.2e}"


def fmt_measure(x: float | None) -> str:
    """A measured quantity in triage's verdicts: 3 significant figures, whole numbers from 100 up ("-" if missing)."""
    if x is None:
        return "-"
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def pct(x: float) -> str:
    """A fraction as a percentage: 0.5 → "50%", 0.0004 → "0.04%"."""
    return f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.2g}%"


def fmt_count(x: float) -> str:
    """An average count: 3 → "3", 2.5 → "2.5"."""
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def fmt_sig(x: float | None, digits: int = 2) -> str:
    """`digits` significant figures (one more from 1 to 1000); "n/a" for a missing value."""
    if x is None:
        return "n/a"
    if x == 0:
        return "0"
    if abs(x) >= 0.01 and abs(x) < 1000:
        return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.{digits + 1}g}"
    return f"{x:.{digits}g}"


def fmt_statistic(f: float | None) -> str:
    """A test statistic: 3 significant figures, "inf", or "n/a"."""
    if f is None:
        return "n/a"
    return "inf" if not math.isfinite(f) else f"{f:.3g}"


def fmt_err(x: float | None) -> str:
    """Relative errors the way people read them: percentages when large, powers of ten when tiny."""
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    if x >= 1e-3:
        return f"{100 * x:.3g}%"
    return f"{x:.1e}"


def fmt_p(p: float | None) -> str:
    """A p-value: two figures, scientific below 1e-3, "<1e-300" where float64 underflows."""
    if p is None:
        return "-"
    if p == 0:
        return "<1e-300"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def fmt_evidence_float(value: float) -> str:
    """A float in the text report's evidence and tables: 4 significant figures, scientific outside [1e-3, 1e5)."""
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


MAX_LIST_ITEMS = 8


def format_value(value: object, *, max_items: int | None = MAX_LIST_ITEMS) -> str:
    """A compact, readable evidence value or table cell (the text and Markdown reports): `-` for none, yes/no,
    floats by `fmt_evidence_float`, lists cut after `max_items` with the count left (None: every item)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return fmt_evidence_float(value)
    if isinstance(value, (list, tuple)):
        shown = [format_value(v, max_items=max_items) for v in (value if max_items is None else value[:max_items])]
        more = len(value) - len(shown)
        return "[" + ", ".join(shown) + (f", ... +{more}" if more > 0 else "") + "]"
    return str(value)
