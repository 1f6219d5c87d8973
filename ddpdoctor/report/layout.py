"""Tables that fit the terminal: how wide the text output is, and how a table too wide for it is laid out.

A cell is never cut: numbers and names (`layer4.1.bn2`, `3.1e-03`) stay whole. Columns narrow by wrapping their
text at spaces down to their longest word; a table that still does not fit is split by meaning into several
tables of the same rows, each repeating the key column(s) (the layer name), in the order the columns were given
(the callers keep related columns, e.g. the four running_var errors, next to each other).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Sequence

MIN_WIDTH = 40
GAP = 3  # what rich puts between two columns of a table with padding (0, 1) and no vertical rules


def report_width(color: bool, default: int) -> int:
    """Columns of the text output: `COLUMNS` when set (in a pipe too: `COLUMNS=80 ddpdoctor ... | less`), else the
    terminal's width on a terminal, else `default`."""
    cols = os.environ.get("COLUMNS", "").strip()
    if cols.isdigit() and int(cols) > 0:
        return max(int(cols), MIN_WIDTH)
    if color:
        return max(shutil.get_terminal_size((default, 24)).columns, MIN_WIDTH)
    return default


def _words(text: str) -> list[str]:
    return [w for line in str(text).splitlines() for w in line.split()] or [""]


def min_widths(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[int]:
    """Per column: the longest word of its header or cells (a column is never narrower, so no word is split)."""
    out = []
    for i, header in enumerate(headers):
        cells = [str(r[i]) for r in rows if i < len(r)]
        out.append(max(len(w) for text in (header, *cells) for w in _words(text)))
    return out


def column_groups(widths: Sequence[int], width: int, keys: int = 1,
                  sections: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """The column indices of each table: all in one when their narrowest layout fits `width`, else the key
    columns followed by as many of the next columns as fit, table after table. `sections` (runs of the non-key
    columns that belong together, e.g. the four running_var errors) are kept whole in one table when they fit."""
    n = len(widths)
    if sum(widths) + GAP * (n - 1) <= width or n <= keys:
        return [list(range(n))]
    key_cols = list(range(keys))
    key_w = sum(widths[:keys]) + GAP * keys
    units = [list(s) for s in sections] if sections else [[i] for i in range(keys, n)]

    def span(cols: list[int]) -> int:
        return sum(widths[i] for i in cols) + GAP * (len(cols) - 1)

    # a section too wide for a table of its own is packed column by column
    units = [u for unit in units for u in ([unit] if key_w + span(unit) <= width else [[i] for i in unit])]
    groups: list[list[int]] = []
    current: list[int] = []
    for unit in units:
        if current and key_w + span(current + unit) > width:
            groups.append(key_cols + current)
            current = []
        current = current + unit
    if current:
        groups.append(key_cols + current)
    return groups


def natural_widths(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[int]:
    """Per column: its longest line (header or cell), the width it takes when nothing wraps."""
    out = []
    for i, header in enumerate(headers):
        cells = [str(r[i]) for r in rows if i < len(r)]
        out.append(max(len(line) for text in (header, *cells) for line in (str(text).splitlines() or [""])))
    return out


def fit_widths(natural: Sequence[int], minimum: Sequence[int], width: int) -> list[int] | None:
    """Column widths that fit `width` (gaps included): the widest columns give up space first, none below its
    longest word. None: all the columns' natural widths fit (let the table lay itself out)."""
    widths = list(natural)
    total = sum(widths) + GAP * (len(widths) - 1)
    if total <= width:
        return None
    while total > width:
        slack = [(w - m, w, i) for i, (w, m) in enumerate(zip(widths, minimum)) if w > m]
        if not slack:
            break
        _, _, i = max(slack, key=lambda t: (t[1], t[0]))
        widths[i] -= 1
        total -= 1
    return widths


def layout(headers: Sequence[str], rows: Sequence[Sequence[Any]], width: int, keys: int = 1,
           sections: Sequence[Sequence[int]] | None = None) -> list[tuple[list[int], list[int] | None]]:
    """The tables to print for one wide table: per table, its column indices and their widths (None: natural)."""
    minimum = min_widths(headers, rows)
    natural = natural_widths(headers, rows)
    out = []
    for group in column_groups(minimum, width, keys, sections):
        out.append((group, fit_widths([natural[i] for i in group], [minimum[i] for i in group], width)))
    return out
