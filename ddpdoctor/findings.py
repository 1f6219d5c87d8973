"""The finding model: one frozen record per diagnosed cause, and how findings rank and merge.

Every producer (static rules, probe analyses, compare-bn) returns `Finding`s; every consumer (ranking,
suppression, text/JSON/SARIF) reads them. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from ddpdoctor.levels import Confidence, Severity
from ddpdoctor.plain import FrozenRecord
from ddpdoctor.rules import get_rule

__all__ = ["SOURCES", "Clearance", "Confidence", "Finding", "Measurement", "Measures", "Severity", "merge_findings",
           "new_finding", "rank_findings", "resolve_measurements", "sort_key", "summarize"]


SOURCES = ("static", "probe", "compare-bn")


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One diagnosed cause.

    `message` is one sentence with the measured numbers; `evidence` holds the raw numbers as JSON values;
    `magnitude` is the measured size used to rank findings of equal severity and confidence (e.g. the overlap
    fraction for DD302): bigger ranks first.
    """

    rule: str
    severity: Severity
    confidence: Confidence
    message: str
    fix: str
    sources: tuple[str, ...] = ("static",)
    file: str | None = None
    line: int | None = None
    ranks: tuple[int, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    magnitude: float = 0.0
    # findings this one explains (ddpdoctor.causes): folded under it, never ranked on their own
    consequences: tuple["Consequence", ...] = field(default=(), hash=False, compare=False)

    def __post_init__(self) -> None:
        for src in self.sources:
            if src not in SOURCES:
                raise ValueError(f"unknown finding source {src!r}")
        if not isinstance(self.severity, Severity) or not isinstance(self.confidence, Confidence):
            raise TypeError("severity/confidence must be Severity/Confidence members")

    @property
    def name(self) -> str:
        return get_rule(self.rule).name

    @property
    def source(self) -> str:
        """Compact label: "static", "probe", "static+probe"."""
        return "+".join(self.sources)

    @property
    def location(self) -> str:
        if self.file is None:
            return "-"
        return f"{self.file}:{self.line}" if self.line else self.file

    def to_json(self) -> dict[str, Any]:
        out = {
            "rule": self.rule,
            "name": self.name,
            "severity": self.severity.label,
            "confidence": self.confidence.label,
            "source": self.source,
            "sources": list(self.sources),
            "file": self.file,
            "line": self.line,
            "ranks": list(self.ranks),
            "message": self.message,
            "evidence": self.evidence,
            "fix": self.fix,
            "magnitude": self.magnitude,
        }
        if self.consequences:
            out["consequences"] = [c.to_json() for c in self.consequences]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Finding":
        return cls(
            rule=data["rule"],
            severity=Severity.parse(data["severity"]),
            confidence=Confidence.parse(data["confidence"]),
            message=data["message"],
            fix=data["fix"],
            sources=tuple(data.get("sources") or data["source"].split("+")),
            file=data.get("file"),
            line=data.get("line"),
            ranks=tuple(data.get("ranks") or ()),
            evidence=dict(data.get("evidence") or {}),
            magnitude=float(data.get("magnitude") or 0.0),
            consequences=tuple(Consequence.from_json(c) for c in data.get("consequences") or ()),
        )


class Consequence(FrozenRecord):
    """A finding explained by another one (its cause), and why this run's evidence says so."""

    __match_args__ = ("finding", "because")
    finding: Finding
    because: str

    def __init__(self, *, finding: Finding, because: str) -> None:
        object.__setattr__(self, "finding", finding)
        object.__setattr__(self, "because", because)

    def to_json(self) -> dict[str, Any]:
        return {**self.finding.to_json(), "because": self.because}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Consequence":
        return cls(finding=Finding.from_json(data), because=str(data.get("because") or ""))


def new_finding(
    code: str,
    *,
    sources: tuple[str, ...],
    message: str,
    confidence: Confidence,
    severity: Severity | None = None,
    fix_variant: str | None = None,
    fix_args: Mapping[str, Any] | None = None,
    fix_detail: str | None = None,
    file: str | None = None,
    line: int | None = None,
    ranks: Iterable[int] = (),
    evidence: dict[str, Any] | None = None,
    magnitude: float = 0.0,
) -> Finding:
    """The one way to build a finding: severity (unless the measurement says otherwise) and fix text come from
    the rule. `fix_variant` picks one of the rule's `fix_variants`, formatted with `fix_args`; `fix_detail` is
    appended to the fix, never a replacement for it. Rules call it through `ScriptModel.finding` (static) and
    `RunContext.finding` (probe), which fill in the source and the place."""
    rule = get_rule(code)
    return Finding(
        rule=rule.code,
        severity=severity if severity is not None else rule.severity,
        confidence=confidence,
        message=message,
        fix=rule.fix_text(fix_variant, fix_args, fix_detail, evidence),
        sources=sources,
        file=file,
        line=line,
        ranks=tuple(sorted(set(ranks))),
        evidence=evidence or {},
        magnitude=float(magnitude),
    )


def training_lost(f: Finding) -> float:
    """The share of the run's training `f`'s measurement showed lost (`evidence["training_lost"]`, set where the
    rule's probe half declares that its measured quantity means it: ddpdoctor.analyses.consequence); 0 otherwise."""
    value = f.evidence.get("training_lost") if isinstance(f.evidence, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def sort_key(f: Finding) -> tuple:
    """Severity, then the measured loss of training (a run that learns nothing before one that learns from the
    wrong shards), then confidence, then the rule's own measured size, then rule, then location."""
    return (-f.severity, -training_lost(f), -f.confidence, -f.magnitude, f.rule, f.file or "", f.line or 0)


def rank_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=sort_key)


def _merge_pair(static: Finding, probe: Finding) -> Finding:
    """A rule seen from the source and on the ranks: the probe's measurement speaks for severity and message
    (it measured the consequence); the static finding's line wins when it has one, since it points at the
    construct to change and is where an inline `# ddpdoctor: ignore[...]` sits."""
    sources = tuple(s for s in SOURCES if s in static.sources or s in probe.sources)
    evidence = {**static.evidence, **probe.evidence}
    if static.evidence:
        evidence.setdefault("static", static.evidence)
    return replace(
        probe,
        fix=get_rule(probe.rule).named(probe.fix, evidence),  # the script's names, which static analysis knows
        sources=sources,
        confidence=Confidence.CERTAIN,
        file=probe.file or static.file,
        line=static.line if static.line else probe.line,
        evidence=evidence,
        magnitude=max(static.magnitude, probe.magnitude),
    )


def merge_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Merge the same rule seen statically and on the probe into one finding.

    Pairs are matched on (rule, file, line) first; then, per rule and file, a single remaining static finding
    and a single remaining probe finding are the same cause seen twice (their lines can differ: the probe may
    attribute a sampler bug to the loop, the linter to the constructor). Exact duplicates are dropped.
    """
    findings = list(findings)  # iterated twice below; a generator would lose every probe finding
    static = [f for f in findings if "probe" not in f.sources]
    probe = [f for f in findings if "probe" in f.sources]
    out: list[Finding] = []
    used_static: set[int] = set()
    # A probe finding that recorded the user call chain of what it saw (`call_sites`: a save made through the
    # script's own helper) is the same cause as the static findings of its rule on any of those lines.
    for k, p in enumerate(probe):
        places = {(c.get("file"), c.get("line")) for c in p.evidence.get("call_sites") or () if isinstance(c, dict)}
        hits = [i for i, s in enumerate(static) if i not in used_static and s.rule == p.rule
                and (s.file, s.line) in places]
        if hits:
            used_static.update(hits)
            merged = _merge_pair(static[hits[0]], p)
            if len(hits) > 1:
                merged = replace(merged, evidence={**merged.evidence,
                                                   "static_lines": [static[i].line for i in hits]})
            probe[k] = merged
    pending_probe: list[Finding] = []
    for p in probe:
        match = next(
            (
                i
                for i, s in enumerate(static)
                if i not in used_static and s.rule == p.rule and s.file == p.file and s.line == p.line
            ),
            None,
        )
        if match is None:
            pending_probe.append(p)
        else:
            used_static.add(match)
            out.append(_merge_pair(static[match], p))
    for p in pending_probe:
        same_rule_static = [
            i
            for i, s in enumerate(static)
            if i not in used_static and s.rule == p.rule and (p.file is None or s.file == p.file)
        ]
        same_rule_probe = [q for q in pending_probe if q.rule == p.rule]
        if len(same_rule_static) == 1 and len(same_rule_probe) == 1:
            used_static.add(same_rule_static[0])
            out.append(_merge_pair(static[same_rule_static[0]], p))
        else:
            out.append(p)
    out.extend(s for i, s in enumerate(static) if i not in used_static)
    seen: set[tuple] = set()
    unique: list[Finding] = []
    for f in out:
        key = (f.rule, f.file, f.line, f.sources, f.message)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return rank_findings(merge_same_site(unique))


def merge_same_site(findings: Iterable[Finding]) -> list[Finding]:
    """One finding per cause: findings of one rule at the same place (file and line) are the same cause seen
    several times (a save on every rank writing one file per epoch, a check firing once per checkpoint). The
    best-ranked one stays, with the count and the others' differing evidence; the ranks are the union."""
    groups: dict[tuple, list[Finding]] = {}
    order: list[tuple] = []
    for f in rank_findings(findings):
        key = (f.rule, f.file, f.line) if f.file is not None and f.line else (f.rule, id(f))
        if key not in groups:
            order.append(key)
        groups.setdefault(key, []).append(f)
    out: list[Finding] = []
    for key in order:
        first, *rest = groups[key]
        if not rest:
            out.append(first)
            continue
        others = [
            {k: v for k, v in g.evidence.items() if first.evidence.get(k) != v} | {"message": g.message}
            for g in rest
        ]
        n = len(rest) + 1
        out.append(replace(
            first,
            message=f"{first.message} (the same at this place {len(rest)} more time{'s' if len(rest) > 1 else ''})",
            sources=tuple(src for src in SOURCES if any(src in g.sources for g in groups[key])),
            ranks=tuple(sorted({r for g in groups[key] for r in g.ranks})),
            evidence={**first.evidence, "occurrences": n, "other_occurrences": others},
            magnitude=max(g.magnitude for g in groups[key]),
        ))
    return out


class Measures(FrozenRecord):
    """What the probe half of a rule that also has a static half measures of the condition the static half
    suspects: `probe.py`'s module-level `MEASURES`, required of every rule with both halves (tests/test_measured.py).

    `scope` is "site" when the condition belongs to a place in the code (a save call, a sampler, an optimizer
    constructor: the probe measures it where that code ran) or "run" when it is a property of the whole run (the
    gradients were never averaged, every forward went through DDP). `what` says, in the user's words, what the probe
    reads. In each run the analysis then calls `RunContext.measured` where it could measure the condition, or
    `RunContext.not_measured` where it could not (the code did not run, too few steps), and the report follows:
    a static suspicion measured and not found is dropped with the numbers (`resolve_measurements`)."""

    __match_args__ = ("scope", "what")
    scope: str
    what: str

    def __init__(self, *, scope: str, what: str) -> None:
        object.__setattr__(self, "scope", scope)
        object.__setattr__(self, "what", what)
        if self.scope not in ("site", "run"):
            raise ValueError(f"Measures.scope must be 'site' or 'run', not {self.scope!r}")


class Measurement(FrozenRecord):
    """One rule's condition measured on the ranks (`measured`), or not measurable in this run (`reason` says why),
    at a place in the code (`file`/`line`) or for the whole run (`file` None).

    A measurement with no probe finding of its rule in its scope — at its place (or whose recorded call sites
    include it), anywhere for a run-wide one — means the probe looked and the condition was absent: it becomes a
    `Clearance` (`resolve_measurements`). One with a probe finding there is a confirmation: the probe finding
    carries the measurement and merges with the static one. `about` narrows which static suspicions of the rule
    the measurement speaks to: evidence keys a static finding must have one of (empty: all of them)."""

    __match_args__ = ("rule", "reason", "measured", "file", "line", "about", "evidence")
    __compared__ = ("rule", "reason", "measured", "file", "line", "about")  # not the evidence
    rule: str
    reason: str
    measured: bool
    file: str | None
    line: int | None
    about: tuple[str, ...]
    evidence: dict[str, Any]

    def __init__(self, *, rule: str, reason: str, measured: bool = True, file: str | None = None,
                 line: int | None = None, about: tuple[str, ...] = (), evidence: dict[str, Any] | None = None
                 ) -> None:
        object.__setattr__(self, "rule", rule)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "measured", measured)
        object.__setattr__(self, "file", file)
        object.__setattr__(self, "line", line)
        object.__setattr__(self, "about", about)
        object.__setattr__(self, "evidence", {} if evidence is None else evidence)

    def in_scope(self, f: Finding) -> bool:
        """Whether probe finding `f` is this measurement's rule at its place: the condition was found there."""
        if f.rule != self.rule or "probe" not in f.sources:
            return False
        if self.file is None:
            return True
        if f.file == self.file and (self.line is None or f.line == self.line):
            return True
        places = f.evidence.get("call_sites") or ()
        return any(
            isinstance(c, dict) and c.get("file") == self.file and (self.line is None or c.get("line") == self.line)
            for c in places
        )

    def clearance(self) -> Clearance:
        return Clearance(rule=self.rule, reason=self.reason, file=self.file, line=self.line, about=self.about,
                         evidence=self.evidence)

    def covers(self, f: Finding) -> bool:
        return self.clearance().covers(f)

    def note(self, f: Finding) -> str:
        return f"static {f.rule} at {f.location} not measured by the probe: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "reason": self.reason, "measured": self.measured, "file": self.file,
                "line": self.line, "about": list(self.about), "evidence": self.evidence}


def resolve_measurements(
    findings: Iterable[Finding], measurements: Iterable[Measurement]
) -> tuple[list[Clearance], list[Measurement]]:
    """(clearances, not-measured marks) from a run's measurements and its probe findings: a measured condition
    with no probe finding of its rule in its scope was absent there."""
    findings = list(findings)
    clearances: list[Clearance] = []
    unmeasured: list[Measurement] = []
    for m in measurements:
        if not m.measured:
            unmeasured.append(m)
        elif not any(m.in_scope(f) for f in findings):
            clearances.append(m.clearance())
    return clearances, unmeasured


class Clearance(FrozenRecord):
    """A rule's condition measured on the ranks and found absent at a place in the code.

    Static analysis flags what *may* go wrong from the source (padding "unless len(dataset) is a multiple of the
    world size", a literal lr "while nothing scales it"); the probe can measure that it did not (48 evaluation
    samples on 2 ranks, no padding). A clearance removes the static-only findings of its rule below `certain`
    confidence at its file and line (`line` None: anywhere in the file; `file` None: in any file), and the report
    says so in a note, with the numbers in `reason`. Static findings that are certain from syntax stay. `about`:
    only static findings whose evidence has one of these keys (empty: any).
    """

    __match_args__ = ("rule", "reason", "file", "line", "about", "evidence")
    __compared__ = ("rule", "reason", "file", "line", "about")  # not the evidence
    rule: str
    reason: str
    file: str | None
    line: int | None
    about: tuple[str, ...]
    evidence: dict[str, Any]

    def __init__(self, *, rule: str, reason: str, file: str | None = None, line: int | None = None,
                 about: tuple[str, ...] = (), evidence: dict[str, Any] | None = None) -> None:
        object.__setattr__(self, "rule", rule)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "file", file)
        object.__setattr__(self, "line", line)
        object.__setattr__(self, "about", about)
        object.__setattr__(self, "evidence", {} if evidence is None else evidence)

    def covers(self, f: Finding) -> bool:
        return (
            f.rule == self.rule
            and f.sources == ("static",)
            and f.confidence < Confidence.CERTAIN
            and (self.file is None or f.file == self.file)
            and (self.line is None or f.line == self.line)
            and (not self.about or any(k in f.evidence for k in self.about))
        )

    def note(self, f: Finding) -> str:
        return f"static {f.rule} at {f.location} cleared by the probe: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        out = {"rule": self.rule, "reason": self.reason, "file": self.file, "line": self.line,
               "evidence": self.evidence}
        if self.about:
            out["about"] = list(self.about)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Clearance":
        return cls(rule=data["rule"], reason=data["reason"], file=data.get("file"), line=data.get("line"),
                   about=tuple(data.get("about") or ()), evidence=dict(data.get("evidence") or {}))


def apply_clearances(
    findings: Iterable[Finding], clearances: Iterable[Clearance], unmeasured: Iterable[Measurement] = ()
) -> tuple[list[Finding], list[str]]:
    """(the findings no clearance covers, one note per finding cleared or left unmeasured). Apply to the static
    findings before `merge_findings`, so that a cleared static finding cannot pair up with a probe finding of
    another place. A static finding a not-measured mark covers stays, with a note saying why the probe could not
    settle it."""
    clearances = list(clearances)
    unmeasured = list(unmeasured)
    kept: list[Finding] = []
    notes: list[str] = []
    for f in findings:
        by = next((c for c in clearances if c.covers(f)), None)
        if by is None:
            kept.append(f)
            why = next((m for m in unmeasured if m.covers(f)), None)
            if why is not None:
                notes.append(why.note(f))
        else:
            notes.append(by.note(f))
    return kept, list(dict.fromkeys(notes))


def summarize(findings: Iterable[Finding]) -> dict[str, int]:
    counts = {s.label: 0 for s in sorted(Severity, reverse=True)}
    for f in findings:
        counts[f.severity.label] += 1
    return counts
