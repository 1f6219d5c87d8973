"""Comparing computed numbers across machines: the same numpy/scipy on two CPUs can disagree in the last digits of a
float64 (vectorised reductions sum in a different order), so tests that pin computed floats compare them to a stated
precision, never by their full repr.

- `SIG_DIGITS`: JSON floats agree to this many significant digits (relative 10**-SIG_DIGITS), or both are below
  `ABS_FLOOR` in magnitude (round-off around zero has no relative precision).
- Text reports print numbers already rounded for reading ("p = 8.9e-05", "1.10 std"): a printed number may differ
  from its pinned twin by one unit in its last printed digit (a value on a rounding boundary flips either way), and
  everything that is not a number must be identical.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

SIG_DIGITS = 6
ABS_FLOOR = 1e-12

_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def close(a: float, b: float, sig_digits: int = SIG_DIGITS) -> bool:
    """`a` and `b` agree to `sig_digits` significant digits (or are both round-off around zero)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    if abs(a) <= ABS_FLOOR and abs(b) <= ABS_FLOOR:
        return True
    return abs(a - b) <= 10.0 ** (-sig_digits) * max(abs(a), abs(b))


def rounded(value: Any, sig_digits: int = SIG_DIGITS + 4) -> Any:
    """`value` (JSON data) with every float rounded to `sig_digits` significant digits: what golden files store, so
    that a file carries no digits a machine cannot reproduce."""
    if isinstance(value, float) and math.isfinite(value) and value != 0.0:
        return float(f"{value:.{sig_digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, sig_digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, sig_digits) for v in value]
    return value


def json_differences(want: Any, got: Any, path: str = "$") -> list[str]:
    """Where two JSON values differ: structure and strings exactly, numbers to `SIG_DIGITS` digits."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}: key {k!r} {'missing' if k in want else 'added'}" for k in sorted(set(want) ^ set(got))]
        for k in want:
            if k in got:
                out += json_differences(want[k], got[k], f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} items pinned, {len(got)} now"]
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in json_differences(w, g, f"{path}[{i}]")]
    numbers = (int, float)
    if isinstance(want, numbers) and isinstance(got, numbers) and not isinstance(want, bool) and not isinstance(
        got, bool
    ):
        return [] if close(float(want), float(got)) else [f"{path}: {want!r} pinned, {got!r} now"]
    if isinstance(want, str) and isinstance(got, str):
        return [] if text_matches(want, got) else [f"{path}: {want!r} pinned, {got!r} now"]
    return [] if want == got else [f"{path}: {want!r} pinned, {got!r} now"]


def _last_digit_unit(token: str) -> float:
    mantissa, _, exponent = token.lower().partition("e")
    decimals = len(mantissa.split(".", 1)[1]) if "." in mantissa else 0
    return 10.0 ** (-decimals + (int(exponent) if exponent else 0))


def text_matches(want: str, got: str) -> bool:
    """Printed text equal but for numbers off by at most one unit in their last printed digit."""
    w_parts, g_parts = _NUMBER.split(want), _NUMBER.split(got)
    if w_parts != g_parts:
        return False
    for w, g in zip(_NUMBER.findall(want), _NUMBER.findall(got)):
        if w == g:
            continue
        if not any(c in w + g for c in ".eE"):
            return False  # integers are counts: exact
        unit = max(_last_digit_unit(w), _last_digit_unit(g))
        if abs(float(w) - float(g)) > unit * 1.0000001 and not close(float(w), float(g)):
            return False
    return True


def load_json(text: str) -> Any:
    return json.loads(text)
