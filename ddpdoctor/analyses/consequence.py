"""A probe finding's own measurement may never contradict it (issue 20: "a finding whose own evidence contradicts its
message is impossible by construction").

A rule's probe half declares, as its module-level `CONSEQUENCE`, the measured quantity its finding is about — the
share of samples the ranks actually shared (DD302), the ranks actually on one device (DD105), the layers the
conversion actually changed (DD208-DD210, DD216)... — as a function of the finding's evidence. `analyze_context`
applies it to every finding the rule raises: one whose measured consequence is absent or not above `floor` is not
reported, and a note says so with the number. tests/test_catalog.py holds every probe half to declaring one, or to
saying in its table why its finding is the observation itself.

Where that quantity says how much of the run's training is lost — no parameter ever moved on these ranks
(DD405), these keys of the model never got the checkpoint (DD503) — the declaration also gives `lost(evidence)`,
that share in [0, 1]. `keep_consistent` records it as the finding's `evidence["training_lost"]`, and ranking puts a
finding that measured more of the training lost first among findings of one severity (`findings.sort_key`): the
size of the measured consequence orders the report, not the rule's family or number.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ddpdoctor.findings import Finding


@dataclass(frozen=True, kw_only=True)
class Consequence:
    """`what`: the measured quantity, in the user's words; `measure(evidence)`: its value in a finding's evidence
    (None: not measured); a finding whose value is None or <= `floor` contradicts itself."""

    what: str
    measure: Callable[[dict[str, Any]], float | None]
    floor: float = 0.0
    # the share of the run's training this measurement shows lost (1.0: nothing the run did is kept), for the
    # quantities that mean that; None: the finding's consequence is not a loss of training (it biases or slows it)
    lost: Callable[[dict[str, Any]], float | None] | None = None


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

    measure.field = name  # type: ignore[attr-defined]  # the evidence key, for the catalog tests
    return measure


def share(part: str, whole: str) -> Callable[[dict[str, Any]], float | None]:
    """`evidence[part] / evidence[whole]` (a list or dict counts its items), clipped to [0, 1]; None where either is
    missing or the whole is 0."""
    num, den = key(part), key(whole)

    def measure(evidence: dict[str, Any]) -> float | None:
        a, b = num(evidence), den(evidence)
        if a is None or not b:
            return None
        return min(1.0, max(0.0, a / b))

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


def training_lost(module: Any, finding: Finding) -> float | None:
    """The share of the run's training `finding`'s measurement shows lost, where its rule declares one."""
    declared = getattr(module, "CONSEQUENCE", None)
    if not isinstance(declared, Consequence) or declared.lost is None:
        return None
    try:
        value = declared.lost(dict(finding.evidence))
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError):
        return None
    if value is None or value != value:
        return None
    return min(1.0, max(0.0, float(value)))


def keep_consistent(module: Any, findings: list[Finding], notes: list[str]) -> list[Finding]:
    """`findings` of one probe half without those its own measurement contradicts (a note for each); each kept
    finding whose rule measures a loss of training carries it as `evidence["training_lost"]` (ranking reads it)."""
    kept = []
    for f in findings:
        why = contradiction(module, f)
        if why is not None:
            notes.append(f"{f.rule} not reported: its own measurement contradicts it ({why})")
            continue
        lost = training_lost(module, f)
        kept.append(f if lost is None else replace(f, evidence={**f.evidence, "training_lost": lost}))
    return kept
