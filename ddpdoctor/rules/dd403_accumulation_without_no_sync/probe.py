"""DD403 accumulation-without-no-sync: gradient accumulation whose every micro-step all-reduces.

What it does: counts, per optimizer step, the backward passes and how many of them followed a training forward
through DDP with gradient synchronisation on (DDP decides in its forward, from `require_backward_grad_sync`,
which `no_sync()` clears): each of those all-reduced every gradient. It fires when the typical step (the median
over the observed steps) all-reduced more than once. Run-wide measurement: observed steps whose typical step
all-reduced once (one backward per step — no accumulation in this run — or micro-steps under no_sync) clear a
static suspicion, with the counts.
"""

from __future__ import annotations

import statistics
from typing import Any

from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.formatting import fmt_count
from ddpdoctor.rules.dd403_accumulation_without_no_sync import CODE

MEASURES = Measures(
    scope="run",
    what="the backward passes of every optimizer step and how many of them DDP all-reduced",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the gradient all-reduces measured in a typical optimizer step (one is what accumulation needs)",
    measure=key("typical_allreduces_per_step"), floor=1)


def analyze(ctx: RunContext) -> list[Finding]:
    per_rank: dict[int, list[dict[str, Any]]] = {}
    observed: dict[int, list[dict[str, Any]]] = {}
    for r, p in ctx.ranks.items():
        steps = [e for e in p.of("train_step") if e.get("backwards")]
        if steps:
            observed[r] = steps
        if steps and statistics.median(_reductions(e) for e in steps) >= 2:
            per_rank[r] = steps
    if not per_rank:
        if observed and any(int(e.get("syncing_backwards") or 0) for s in observed.values() for e in s):
            steps = next(iter(observed.values()))
            micro = statistics.median(int(e.get("backwards") or 0) for e in steps)
            ctx.measured(CODE, run_wide=True, reason=(
                f"the {len(steps)} observed optimizer steps on {fmt_ranks(observed)} ran {fmt_count(micro)} backward "
                f"pass{'es' if micro != 1 else ''} each and DDP all-reduced once per step"
                + (": no gradient accumulation in this run" if micro == 1 else "")
            ))
        return []
    r0, steps = next(iter(per_rank.items()))
    syncing = [_reductions(e) for e in steps]
    backwards = [int(e.get("backwards") or 0) for e in steps]
    nosync = [int(e.get("nosync_backwards") or 0) for e in steps]
    typical = statistics.median(syncing)
    micro = statistics.median(backwards)
    numel = next((int((e.get("grads") or {}).get("numel") or 0) for e in steps), 0)
    site = next((e.get("backward_site") for e in reversed(steps) if e.get("backward_site")), None)
    partial = f" ({int(statistics.median(nosync))} under no_sync)" if any(nosync) else ""
    message = (
        f"gradient accumulation: each optimizer step on {fmt_ranks(per_rank)} ran {fmt_count(micro)} backward passes"
        f"{partial} and DDP all-reduced the gradients after {fmt_count(typical)} of them"
        + (f" ({numel:,} elements each)" if numel else "")
        + f": {fmt_count(typical)}× the gradient communication of one all-reduce per step, for the same result"
    )
    return [
        ctx.finding(
            CODE,
            message=message,
            site=site,
            ranks=list(per_rank),
            evidence={
                "rank": r0,
                "backwards_per_step": backwards,
                "allreducing_backwards_per_step": syncing,
                "typical_allreduces_per_step": typical,
                "no_sync_backwards_per_step": nosync,
                "gradient_elements": numel,
            },
            magnitude=float(typical),
        )
    ]


def _reductions(step: dict[str, Any]) -> int:
    """All-reduces of one DDP model's gradients in a step (backward passes of two different DDP models, as in a
    GAN, are one reduction each, not accumulation)."""
    per_model = step.get("max_syncs_per_ddp")
    return int(per_model if per_model is not None else step.get("syncing_backwards") or 0)
