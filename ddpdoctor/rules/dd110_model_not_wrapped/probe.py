"""DD110 model-not-wrapped: ranks share a process group and take optimizer steps, but nothing averages gradients.

What it does: on a run where two or more ranks initialised a process group and stepped an optimizer, looks for
what keeps their models the same — a DistributedDataParallel (torch's or apex's), FSDP / fully_shard, an
optimizer that averages gradients itself (Horovod's DistributedOptimizer: `grad_averaging`), or a collective
the script runs on the gradients by hand. With none of them each rank trains its own model on its own shard.
Then it measures the consequence from the parameter digests recorded after every step (on the parameters each
optimizer holds): the first step at which the ranks' models differ and the largest difference sampled, and
whether the data was sharded (a DistributedSampler or another per-rank index source).

Severity critical: the job is N independent trainings, each on 1/N of the data, and the saved model (usually
rank 0's) saw a fraction of it. Confidence certain: absence of every averaging mechanism is observed, not
inferred. A run in which the replicas stayed bit-identical (same data on every rank, no randomness) is still
reported — nothing would keep them together once the data differ — with the measurement in evidence.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.context import RunContext, fmt_num, fmt_ranks
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd110_model_not_wrapped import CODE

MEASURES = Measures(
    scope="run",
    what="what averaged the gradients of ranks that shared a process group and took optimizer steps (DDP, FSDP, "
    "Horovod's optimizer, a collective on the gradients), and whether their parameters stayed equal",
)


def _steps(evidence: dict) -> float | None:
    """Optimizer steps the ranks took with no gradient averaging recorded (all ranks together)."""
    steps = evidence.get("optimizer_steps")
    if not isinstance(steps, dict) or evidence.get("averaging"):
        return None
    return float(sum(int(n or 0) for n in steps.values()))


# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the optimizer steps measured with no gradient averaged across ranks",
    measure=_steps)


def _sampled_diff(a: list[float], b: list[float]) -> float:
    n = min(len(a), len(b))
    return max((abs(a[i] - b[i]) for i in range(n)), default=0.0)


def averaging_mechanisms(ctx: RunContext) -> list[str]:
    """What the run used to keep the ranks' models the same (empty: nothing)."""
    found: list[str] = []
    for _, e in ctx.run.events("ddp_init"):
        if e.get("ok"):
            found.append(str(e.get("wrapper") or "DistributedDataParallel"))
    for _, e in ctx.run.events("sharded_init"):
        found.append(str(e.get("wrapper") or "FSDP"))
    for _, e in ctx.run.events("grad_averaging"):
        found.append(str(e.get("wrapper") or e.get("optimizer") or "gradient averaging"))
    for _, e in ctx.run.events("train_step"):
        hand = e.get("hand_reduced") or {}
        if int(hand.get("params") or 0):
            found.append("a collective on the gradients")
    return sorted(set(found))


def replicas(ctx: RunContext, ranks: list[int]) -> dict[str, Any]:
    """Compare the parameter digests the ranks recorded after each common step."""
    by_rank = {r: {int(e["step"]): e for e in ctx.ranks[r].of("params") if e.get("step") is not None} for r in ranks}
    common = sorted(set.intersection(*(set(v) for v in by_rank.values()))) if by_rank else []
    first = None
    diff = 0.0
    for step in common:
        ref = by_rank[ranks[0]][step]
        others = [by_rank[r][step] for r in ranks[1:]]
        if any(o.get("digest") != ref.get("digest") for o in others):
            if first is None:
                first = step
            diff = max([diff, *(_sampled_diff(ref.get("values") or [], o.get("values") or []) for o in others)])
    return {"steps_compared": len(common), "first_diverged_step": first, "replicas_diverged": first is not None,
            "max_param_diff": diff if first is not None else 0.0}


def _sharding(ctx: RunContext) -> str | None:
    for _, e in ctx.run.events("sampler_created"):
        if e.get("sampler_kind") == "distributed":
            return str(e.get("cls") or "DistributedSampler")
    return None


def analyze(ctx: RunContext) -> list[Finding]:
    inits = {r for r, p in ctx.ranks.items() if any(e.get("ok") for e in p.of("pg_init"))}
    if len(inits) < 2 or ctx.world_size < 2:
        return []
    steps = {r: ctx.steps_of(r) for r in sorted(inits)}
    stepped = [r for r, n in steps.items() if n]
    if len(stepped) < 2:
        ctx.not_measured(CODE, run_wide=True, reason=f"{len(stepped)} of {len(inits)} ranks took an optimizer step")
        return []
    averaging = averaging_mechanisms(ctx)
    if averaging:
        ctx.measured(CODE, run_wide=True, reason=(
            f"the {len(stepped)} ranks that stepped ({min(steps[r] for r in stepped)} optimizer steps each) had their "
            f"gradients averaged by {', '.join(averaging)}"
        ), evidence={"averaging": averaging})
        return []
    measured = replicas(ctx, stepped)
    sharded = _sharding(ctx)
    opt = next((e for _, e in ctx.run.events("optimizer_init")), None)
    backend = next((e.get("backend") for _, e in ctx.run.events("pg_init") if e.get("ok")), None)
    n = min(steps[r] for r in stepped)
    message = (
        f"{fmt_ranks(stepped)} initialised a process group ({backend}, world size {ctx.world_size}) and took "
        f"{n} optimizer step{'s' if n != 1 else ''} each"
        + (f" on their own shard of the data ({sharded})" if sharded else "")
        + ", but the model was never wrapped in DistributedDataParallel or FSDP and no gradient was averaged: "
        "each rank trains its own model"
    )
    if measured["replicas_diverged"]:
        message += (
            f" — the ranks' parameters differed from step {measured['first_diverged_step']} on (max difference "
            f"{fmt_num(measured['max_param_diff'])} sampled)"
        )
    elif measured["steps_compared"]:
        message += (
            f" (the replicas stayed identical over {measured['steps_compared']} steps compared: nothing keeps them "
            "so once the ranks' data differ)"
        )
    evidence = {
        **measured,
        "optimizer_steps": {str(r): n for r, n in steps.items()},
        "process_group": {"backend": backend, "world_size": ctx.world_size},
        "data_sharded_by": sharded,
        "averaging": [],
        "optimizer": (opt or {}).get("cls"),
    }
    return [
        ctx.finding(
            CODE,
            message=message,
            site=(opt or {}).get("site"),
            ranks=stepped,
            evidence=evidence,
            magnitude=float(measured["max_param_diff"] or 0.0),
        )
    ]
