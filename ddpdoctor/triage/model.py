"""What triage's verdicts are made of: the arms (a recorded run each, analysed), the causes decided across them, and
the result. Pure: no torch.

A `Cause` is one row of the verdict table (SPEC "triage": cause, rule, verdict, favours, measured, message, fix).
`Cause.finding()` is the same cause as a `Finding` — its verdict and the arm it favours in
`evidence["triage_verdict"]` / `evidence["triage_favours"]` — which is how it is folded under the cause that explains
it (ddpdoctor.causes, the one "X explains Y" relation) and how confirmed and likely causes reach the report's
findings (exit codes, --fail-on).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Confidence, Finding, Severity, new_finding
from ddpdoctor.rules import RULES

# rules whose verdict triage decides itself (their check findings are replaced by the causes)
TRIAGE_RULES = ("DD203", "DD204", "DD208", "DD209", "DD210", "DD211", "DD212", "DD213", "DD214", "DD215", "DD216")
# findings about SyncBN itself, not a port problem that could hurt both arms
SYNCBN_ONLY = ("DD101", "DD201", "DD202", "DD205")
# port problems that make a run crash, hang, run slower or put its files at risk, but do not change what the ranks
# learn or the score they report (Rule.run_only): real, listed as BOTH ARMS rows, never "where the regression is"
RUN_ONLY = {r.code: r.run_only for r in RULES if r.run_only}
CONVERSION_RULES = ("DD208", "DD209", "DD210", "DD211", "DD212", "DD216")
CONFIDENCE = {"confirmed": Confidence.CERTAIN, "likely": Confidence.LIKELY}


@dataclass
class Arm:
    name: str
    what: str
    ctx: RunContext
    findings: list[Finding]
    as_written: bool
    mirror: bool = False  # the script uses plain BN: A is the converted arm

    @property
    def steps(self) -> int:
        steps = [self.ctx.steps_of(r) for r in self.ctx.ranks]
        return min(steps) if steps else 0

    def has(self, rule: str) -> list[Finding]:
        return [f for f in self.findings if f.rule == rule]


@dataclass(eq=False)
class Cause:
    cause: str
    rule: str | None
    verdict: str
    favours: str
    measured: dict[str, Any]
    message: str
    fix: str
    severity: Severity = Severity.LOW
    magnitude: float = 0.0
    site: dict[str, Any] | None = None
    file: str | None = None
    line: int | None = None
    port: bool = False  # a check finding of the as-written arm (lr, sampler, eval mode...), not about BatchNorm
    run_only: bool = False  # a port cause in RUN_ONLY: it cannot change what either arm learns
    source: Finding | None = None  # the finding it was decided from, when there is one
    explained_by: Cause | None = field(default=None, repr=False)  # folded under this cause (ddpdoctor.causes)
    because: str | None = None
    # explained by this cause, which ranks below it (a weaker verdict): named in the message, never folded under it
    # — no RULED OUT row heads LIKELY ones
    related: Cause | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "rule": self.rule, "verdict": self.verdict, "favours": self.favours,
                "measured": self.measured, "message": self.message, "fix": self.fix}

    def finding(self, script: str | None = None, ranks: Any = ()) -> Finding | None:
        """This cause as a finding (None without a rule): the finding it was decided from (unchanged when the cause
        repeats its message, else with the cause's message and the verdict added to its evidence), or a new one with
        the verdict's confidence (certain when confirmed) and the measured numbers as evidence."""
        if self.rule is None:
            return None
        verdict = {"triage_verdict": self.verdict, "triage_favours": self.favours}
        if self.source is not None:
            if self.source.message == self.message:
                return self.source
            return replace(self.source, message=self.message, evidence={**self.source.evidence, **verdict})
        return new_finding(
            self.rule, sources=("probe",), severity=self.severity,
            confidence=CONFIDENCE.get(self.verdict, Confidence.POSSIBLE), message=self.message,
            file=self.file or script, line=self.line, ranks=ranks,
            evidence={**verdict, **{k: v for k, v in self.measured.items() if k != "summary"}},
            magnitude=self.magnitude,
        )


@dataclass
class TriageResult:
    arms: list[dict[str, Any]]
    paired: bool
    pairing: dict[str, Any]
    headline: str
    causes: list[Cause]
    emulated: bool
    mirror: bool
    notes: list[str] = field(default_factory=list)
    measured: bool = True  # False: no arm took an optimizer step; the triage claims nothing and exits non-zero

    def to_json(self) -> dict[str, Any]:
        return {"arms": self.arms, "paired": self.paired, "headline": self.headline,
                "causes": [c.to_json() for c in self.causes]}


def rounded(x: Any, digits: int = 4) -> Any:
    """A measured value for the JSON `measured` object: floats to `digits` significant figures, finite or None."""
    return bc.rounded(x) if not isinstance(x, float) else bc.finite(x, digits)


def small(evidence: dict[str, Any]) -> dict[str, Any]:
    """Evidence fit for a `measured` object: long strings (tracebacks, stacks) left out."""
    return {k: v for k, v in evidence.items() if not isinstance(v, str) or len(v) < 200}


def clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def layers(n: Any) -> str:
    return f"{n} layer" + ("" if n == 1 else "s")
