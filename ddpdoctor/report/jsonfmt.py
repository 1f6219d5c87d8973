"""Strict JSON for reports: what analyses put into `evidence` must never make a report unreadable.

Evidence comes from many producers (probe analyses, scipy tests, compare-bn) and can hold values that
`json.dumps` either rejects (numpy scalars and arrays, sets, paths) or writes as invalid JSON (NaN and
infinities, which DD406 reports by design). Every JSON and SARIF document goes through `json_safe` first, so
the output always parses with a strict parser (jq, GitHub code scanning).
"""

from __future__ import annotations

import json
import math
from pathlib import PurePath
from typing import Any

# JSON has no NaN/Infinity; these spellings keep the value readable, and are what JavaScript's String() prints.
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def json_safe(value: Any) -> Any:
    """A copy of `value` made of JSON types only: non-finite floats become "NaN"/"Infinity"/"-Infinity",
    numpy-like scalars and arrays become Python numbers and lists, sets become sorted lists, anything else
    unknown becomes its `str()`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else _NON_FINITE[repr(float(value))]
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [json_safe(v) for v in value]
        try:
            return sorted(items)
        except TypeError:
            return sorted(items, key=repr)
    if isinstance(value, PurePath):
        return value.as_posix()
    # numpy/torch without importing them: arrays have tolist(), 0-d values item()
    for method in ("tolist", "item"):
        fn = getattr(value, method, None)
        if callable(fn):
            try:
                return json_safe(fn())
            except Exception:  # noqa: BLE001 - fall back to str() below
                break
    return str(value)


def dumps(document: Any) -> str:
    """Pretty-printed (indent 2), strict JSON with a trailing newline."""
    return json.dumps(json_safe(document), indent=2, allow_nan=False) + "\n"
