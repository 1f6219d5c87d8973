"""A probe finding's own measurement may never contradict it (issue 20: "a finding whose own evidence contradicts its
message is impossible by construction").

A rule's probe half declares, as its module-level `CONSEQUENCE`, the measured quantity its finding is about — the
share of samples the ranks actually shared (DD302), the ranks actually on one device (DD105), the layers the
conversion actually changed (DD208-DD210, DD216)... — as a function of the finding's evidence. `analyze_context`
applies it to every finding the rule raises: one whose measured consequence is absent or not above `floor` is not
reported, and a note says so with the number. tests/test_catalog.py holds every probe half to declaring one, or to
saying in its table why its finding is the observation itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ddpdoctor.findings import Finding


@dataclass(frozen=True, kw_only=True)
class Consequence:
    """`what`: the measured quantity, in the user's words; `measure(evidence)`: its value in a finding's evidence
    (None: not measured); a finding whose value is None or <= `floor` contradicts itself."""

    what: str
    measure: Callable[[dict[str, Any]], float | None]
    floor: float = 0.0


def key(name: str) -> Callable[[dict[str, Any]], float | None]:
    """The numeric evidence field `name` (a list or dict counts its items)."""
    def measure(evidence: dict[str, Any]) -> float | None:
        value = evidence.get(name)
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, (list, tuple, dict)):
            return float(len(value))
        return None

    return measure


def contradiction(module: Any, finding: Finding) -> str | None:
    """Why `finding` (raised by the probe half `module`) contradicts its own measurement, or None."""
    declared = getattr(module, "CONSEQUENCE", None)
    if not isinstance(declared, Consequence) or "probe" not in finding.sources:
        return None
    try:
        value = declared.measure(dict(finding.evidence))
    except (TypeError, ValueError, KeyError, AttributeError):
        value = None
    if value is None:
        return f"{declared.what} was not measured"
    if value != value or value <= declared.floor:  # NaN included
        return f"{declared.what} measured {value:g}"
    return None


def keep_consistent(module: Any, findings: list[Finding], notes: list[str]) -> list[Finding]:
    """`findings` of one probe half without those its own measurement contradicts (a note for each)."""
    kept = []
    for f in findings:
        why = contradiction(module, f)
        if why is None:
            kept.append(f)
        else:
            notes.append(f"{f.rule} not reported: its own measurement contradicts it ({why})")
    return kept
