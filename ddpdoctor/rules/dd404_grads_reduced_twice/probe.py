"""DD404 grads-reduced-twice: gradients of DDP parameters passed to a collective by user code after DDP reduced them.

What it does: the probe records every collective whose tensor is (shares storage with) the `.grad` of a parameter
that DDP reduces, whether DDP had already all-reduced in that step (a backward after a synchronising DDP forward),
and the gradient norm before the first such call and when the optimizer stepped. Their ratio is what the hand
reduction did to the update: the world size for a SUM of DDP's already-averaged gradients (an lr silently N×
larger), 1 when the script divides again (only the communication is doubled). Hand reduction of gradients that
DDP did not reduce (every micro-step under no_sync) is what DDP would have done, and is not reported.

Run-wide measurement: steps in which DDP all-reduced and no collective touched the gradients of its parameters
afterwards clear a static suspicion (a hand reduction of another model's gradients, or of none), with the counts.
"""

from __future__ import annotations

import statistics
from typing import Any

from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_num, fmt_ranks
from ddpdoctor.findings import Finding, Measures, Severity
from ddpdoctor.rules.dd404_grads_reduced_twice import CODE, UNCHANGED

MEASURES = Measures(
    scope="run",
    what="every collective whose tensor is the gradient of a parameter DDP reduces, and whether DDP had already "
    "all-reduced in that step",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the parameters measured reduced again after DDP averaged them",
    measure=key("parameters_reduced"))


def _measure_clean(ctx: RunContext) -> None:
    synced = {r: [e for e in p.of("train_step") if int(e.get("syncing_backwards") or 0)] for r, p in ctx.ranks.items()}
    synced = {r: s for r, s in synced.items() if s}
    if not synced:
        return
    n = sum(len(s) for s in synced.values())
    hand = [e for p in ctx.ranks.values() for e in p.of("grad_collective")]
    before = f"; {len(hand)} hand reductions ran before DDP's (under no_sync)" if hand else ""
    ctx.measured(CODE, run_wide=True, reason=(
        f"in the {n} optimizer steps on {fmt_ranks(synced)} in which DDP all-reduced, no collective touched the "
        f"gradients of DDP's parameters afterwards{before}"
    ))


def analyze(ctx: RunContext) -> list[Finding]:
    per_rank: dict[int, list[dict[str, Any]]] = {}
    events: dict[int, list[dict[str, Any]]] = {}
    for r, p in ctx.ranks.items():
        steps = [e for e in p.of("train_step") if (e.get("hand_reduced") or {}).get("after_ddp")]
        if steps:
            per_rank[r] = steps
            events[r] = [e for e in p.of("grad_collective") if e.get("after_ddp")]
    if not per_rank:
        _measure_clean(ctx)
        return []
    r0, steps = next(iter(per_rank.items()))
    hands = [e["hand_reduced"] for e in steps]
    ratios = [h["ratio_median"] for h in hands if isinstance(h.get("ratio_median"), (int, float))]
    ratio = statistics.median(ratios) if ratios else None
    first = (events.get(r0) or [{}])[0]
    site = first.get("site") or (hands[0].get("sites") or [None])[0]
    ops = sorted({op for h in hands for op in h.get("ops") or []})
    params = max(int(h.get("params") or 0) for h in hands)
    numel = max(int(h.get("numel") or 0) for h in hands)
    world = ctx.world_size
    lead = (
        f"{'/'.join(ops)} at {ctx.at(site)} reduces the gradients of {params} DDP "
        f"parameter{'s' if params != 1 else ''} ({numel:,} elements) again after DDP already averaged them in "
        f"backward, on {fmt_ranks(per_rank)} at {len(steps)} of {len(ctx.ranks[r0].of('train_step'))} steps"
    )
    severity = None
    if ratio is not None and abs(ratio - 1.0) <= UNCHANGED:
        message = (
            f"{lead}; the optimizer stepped with gradients {fmt_num(round(ratio, 3))}× DDP's (divided again): the "
            "update is unchanged but every step pays a second gradient all-reduce"
        )
        severity = Severity.LOW
    elif ratio is not None:
        message = (
            f"{lead}: the optimizer stepped with gradients {fmt_num(round(ratio, 3))}× what DDP produced (world size "
            f"{world}), as if the learning rate were {fmt_num(round(ratio, 3))}× larger"
        )
    else:
        message = f"{lead}; with the default SUM the gradients become {world}× DDP's average"
    return [
        ctx.finding(
            CODE,
            message=message,
            severity=severity,
            site=site,
            ranks=list(per_rank),
            evidence={
                "rank": r0,
                "ops": ops,
                "parameters_reduced": params,
                "elements_reduced": numel,
                "gradient_ratio_optimizer_vs_ddp": ratio,
                "per_step_ratio": ratios,
                "world_size": world,
                "first_calls": [
                    {k: e.get(k) for k in ("op", "param", "numel", "step", "norm_before", "norm_after")}
                    for e in (events.get(r0) or [])[:4]
                ],
            },
            magnitude=float(ratio) if ratio else float(world),
        )
    ]
