"""DD103 replicas-diverged: model parameters differ across ranks after optimizer steps.

What it does: compares, step by step, the bit-exact digest of every rank's parameters recorded before the first
optimizer step (step 0: the initial weights) and after each step, reports the first step where the replicas
disagree, and measures how far apart they are: the largest absolute difference at each step (on a fixed sample of
positions) and at the end (on the whole parameter vector, or a strided sample of it for large models).

Replicas are the models of a DDP wrapper (torch's or apex's), or, with Horovod, the parameters of the
DistributedOptimizer every rank steps (`grad_averaging`). Replicas that already differ at step 0 never started
equal: nothing broadcast the initial weights (Horovod without `hvd.broadcast_parameters`).
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_num, fmt_ranks
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd103_replicas_diverged import CODE

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the compared optimizer steps at which the ranks' parameters were measured to differ",
    measure=key("steps_differing"))


def _max_diff(a: list[float], b: list[float]) -> float:
    n = min(len(a), len(b))
    return max((abs(a[i] - b[i]) for i in range(n)), default=0.0)


def analyze(ctx: RunContext) -> list[Finding]:
    import numpy as np

    if not any(e.get("ok") for _, e in ctx.run.events("pg_init")):
        return []  # no process group: DD903 says the processes never synchronised
    # only a data-parallel model is a replica: without DDP or Horovod's averaging optimizer (FSDP, ZeRO, a
    # hand-rolled scheme) ranks may hold different shards or states by design
    horovod = bool(list(ctx.run.events("grad_averaging")))
    sources = ("ddp", "optimizer") if horovod else ("ddp",)
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    for r, p in ctx.ranks.items():
        by_rank[r] = {int(e["step"]): e for e in p.of("params") if e.get("source") in sources}
    ranks = sorted(r for r, v in by_rank.items() if v)
    if len(ranks) < 2:
        return []
    ref = ranks[0]
    common = sorted(set.intersection(*(set(by_rank[r]) for r in ranks)))
    first_step = None
    differing: set[int] = set()
    trace = []
    for step in common:
        digests = {r: by_rank[r][step]["digest"] for r in ranks}
        bad = [r for r in ranks if digests[r] != digests[ref]]
        diff = max(
            (_max_diff(by_rank[ref][step].get("values") or [], by_rank[r][step].get("values") or [])
             for r in ranks[1:]),
            default=0.0,
        )
        trace.append({"step": step, "ranks_differing": bad, "max_abs_diff_sampled": diff})
        if bad:
            differing.update(bad)
            if first_step is None:
                first_step = step
    if first_step is None:
        return []
    final_diff = None
    final_numel = None
    finals = {r: ctx.ranks[r].last("params_final") for r in ranks}
    if all(finals.values()):
        try:
            vecs = {r: ctx.run.load_array(finals[r]["vector"]) for r in ranks if finals[r].get("vector")}
            if len(vecs) == len(ranks) and len({v.shape for v in vecs.values()}) == 1:
                stack = np.stack(list(vecs.values())).astype(np.float64)
                final_diff = float(np.max(np.abs(stack - stack[0])))
                final_numel = int(stack.shape[1])
        except (OSError, ValueError, KeyError):
            final_diff = None
    size = final_diff if final_diff is not None else max(t["max_abs_diff_sampled"] for t in trace)
    diverged = sorted({ref, *differing})
    when = (
        "before the first optimizer step (the initial weights)" if first_step == 0
        else f"from optimizer step {first_step} on"
    )
    message = (
        f"model parameters differ across {fmt_ranks(diverged)} {when} "
        f"({sum(1 for t in trace if t['ranks_differing'])} of {len(common)} steps compared); "
        f"max parameter difference {fmt_num(size)}"
        + (" at the end" if final_diff is not None else "")
        + ": the replicas are training different models"
    )
    fix_detail = None
    site = None
    if first_step == 0:
        broadcasts = [e for _, e in ctx.run.events("hvd_broadcast") if e.get("what") == "parameters"]
        if horovod and not broadcasts:
            site = next((e.get("site") for _, e in ctx.run.events("grad_averaging")), None)
            message += (
                "; the script never calls hvd.broadcast_parameters, so each rank keeps its own random initial "
                "weights and averaging gradients never brings them together"
            )
            fix_detail = (
                "Call hvd.broadcast_parameters(model.state_dict(), root_rank=0) (and "
                "hvd.broadcast_optimizer_state(optimizer, root_rank=0)) before the first step."
            )
        else:
            message += "; nothing made the initial weights equal before training"
    evidence = {
        "first_step": first_step,
        "steps_compared": len(common),
        "steps_differing": sum(1 for t in trace if t["ranks_differing"]),
        "max_abs_diff_final": final_diff,
        "final_values_compared": final_numel,
        "trace": trace[:50],
        "digest_source": by_rank[ref][common[0]].get("source"),
        "digest_sampled": any(by_rank[ref][s].get("sampled") for s in common),
    }
    if horovod:
        evidence["replicas_of"] = "horovod.torch.DistributedOptimizer"
    return [
        ctx.finding(
            CODE,
            message=message,
            fix_variant=None if horovod else "probe",
            fix_detail=fix_detail,
            site=site,
            ranks=diverged,
            evidence=evidence,
            magnitude=size,
        )
    ]
