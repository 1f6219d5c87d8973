"""DD102 forward-bypasses-ddp: training forwards ran through the module DDP wraps, not through DDP.

What it does: counts, per rank, the training-mode forwards (grad enabled, module in train mode) of modules owned by
a DDP that ran outside DDP's forward, against the forwards that went through DDP, during the optimizer steps the
probe observed. Without DDP's forward the reducer never all-reduces the gradients: every rank steps on its own
gradient and the replicas drift apart (DD103 measures how far). A bypassing forward that no optimizer step
followed (a validation pass through the wrapped module after the last step) trains nothing.

Run-wide measurement: when the ranks took optimizer steps with a DDP model and none of those steps followed a
forward that bypassed DDP, a static DD102 suspicion is dropped with the counts.
"""

from __future__ import annotations

from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Finding, Measures, Severity
from ddpdoctor.rules.dd102_forward_bypasses_ddp import CODE

MEASURES = Measures(
    scope="run",
    what="the training forwards before each optimizer step: through DDP's forward, or around it",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the training forwards measured bypassing the DDP wrapper",
    measure=key("bypass_forwards"))


def analyze(ctx: RunContext) -> list[Finding]:
    per_rank = {}
    first_event = None
    for r, p in ctx.ranks.items():
        steps = p.of("optimizer_step")
        bypass = sum(int(e.get("bypass_forwards") or 0) for e in steps)
        through = sum(int(e.get("ddp_forwards") or 0) for e in steps)
        events = p.of("forward_bypass")
        if events and first_event is None:
            first_event = events[0]
        if bypass or events:
            per_rank[r] = {"steps": len(steps), "bypass_forwards": bypass, "ddp_forwards": through,
                           "sites": [ctx.at(e.get("site")) for e in events][:5],
                           "modules": sorted({e.get("module_class") for e in events if e.get("module_class")})}
    if not per_rank or first_event is None or not any(v["bypass_forwards"] for v in per_rank.values()):
        _measure_clean(ctx, per_rank)
        return []
    steps_total = sum(v["steps"] for v in per_rank.values())
    bypass_total = sum(v["bypass_forwards"] for v in per_rank.values())
    through_total = sum(v["ddp_forwards"] for v in per_rank.values())
    module = first_event.get("module_class") or "module"
    path = first_event.get("module_path")
    what = f"the wrapped {module}" if not path else f"{module} '{path}' inside the DDP model"
    if through_total == 0:
        severity = Severity.CRITICAL
        per = sorted({(v["bypass_forwards"], v["steps"]) for v in per_rank.values()})
        counts = (f"{per[0][0]} forwards in {per[0][1]} optimizer steps on each of {fmt_ranks(per_rank)}"
                  if len(per) == 1
                  else f"{bypass_total} forwards in {steps_total} optimizer steps on {fmt_ranks(per_rank)}")
        message = (
            f"the training forward at {ctx.at(first_event.get('site'))} calls {what} directly, not the DDP wrapper: "
            f"{counts} bypassed DDP and DDP's forward never ran, so gradients were never all-reduced"
        )
    else:
        severity = Severity.HIGH
        message = (
            f"{bypass_total} training forwards at {ctx.at(first_event.get('site'))} call {what} directly, besides "
            f"{through_total} through DDP, on {fmt_ranks(per_rank)}: the parameters they use get unsynchronised "
            "gradient contributions"
        )
    return [
        ctx.finding(
            CODE,
            message=message,
            fix_variant="probe",
            severity=severity,
            site=first_event.get("site"),
            ranks=list(per_rank),
            evidence={"per_rank": {str(r): v for r, v in per_rank.items()}, "module_path": path,
                      "bypass_forwards": bypass_total},
            magnitude=float(bypass_total),
        )
    ]


def _measure_clean(ctx: RunContext, bypassing: dict) -> None:
    """Every optimizer step of a DDP run followed forwards through DDP only: the condition was measured absent."""
    if not any(e.get("ok") for _, e in ctx.run.events("ddp_init")):
        return  # no DDP: DD110's question, not this one
    steps = {r: p.of("optimizer_step") for r, p in ctx.ranks.items()}
    n = sum(len(s) for s in steps.values())
    if not n:
        ctx.not_measured(CODE, run_wide=True, reason="no optimizer step was observed")
        return
    through = sum(int(e.get("ddp_forwards") or 0) for s in steps.values() for e in s)
    after = ""
    if bypassing:
        sites = sorted({s for v in bypassing.values() for s in v["sites"]})
        after = f"; the forwards at {', '.join(sites[:3])} that ran outside DDP were followed by no optimizer step"
    ctx.measured(CODE, run_wide=True, reason=(
        f"all {through} training forwards before the {n} optimizer steps on {fmt_ranks(steps)} went through DDP's "
        f"forward, none around it{after}"
    ), evidence={"optimizer_steps": n, "ddp_forwards": through})
