"""DD109 single-node-world-size: init_process_group was given torch.cuda.device_count() as the world size.

What it measures: for every rank, the world size it passed to init_process_group against the launcher's (the
probe replaces a disagreeing value with WORLD_SIZE, or SLURM_NTASKS under srun, to go on measuring) and against
`torch.cuda.device_count()` as the script saw it in that process. When the value passed is the node's device count
and the launcher started a different number of processes — several nodes, or `--nproc_per_node` unlike the GPU
count — each node believed it was the whole world: the rendezvous would never have completed. On one node with
one process per GPU the two agree and nothing is measured (the static finding stays, with a note saying why: correct
on one node only). A world size passed that is not the device count clears a static suspicion at that call.
"""

from __future__ import annotations

from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Finding, Measures, Severity
from ddpdoctor.rules.dd109_single_node_world_size import CODE

MEASURES = Measures(
    scope="site",
    what="the world size each process passed to init_process_group, against torch.cuda.device_count() as the "
    "script saw it and the number of processes the launcher started",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the ranks measured passing a world size other than the launch's",
    measure=key("world_size_passed"))


def _measure_agreeing(ctx: RunContext) -> None:
    """No process gave its node's device count for a different world: say what one run can and cannot tell."""
    begins = [(p, p.first("pg_init_begin")) for p in ctx.ranks.values()]
    begins = [(p, b) for p, b in begins if b]
    if not begins:
        return
    p, begin = begins[0]
    count = (p.first("torch_ready") or {}).get("device_count")
    given = begin.get("world_size_arg")
    world = ctx.world_size
    if isinstance(given, int) and isinstance(count, int) and given != count:
        ctx.measured(CODE, site=begin.get("site"), reason=(
            f"init_process_group at {ctx.at(begin.get('site'))} was given world_size={given}, not the "
            f"device count {count}"
        ))
    elif isinstance(count, int) and count == world and len(ctx.nodes) == 1:
        ctx.not_measured(CODE, run_wide=True, reason=(
            f"on one node with one process per (emulated) GPU the device count {count} equals the {world} processes "
            "launched: only a launch across nodes, or with another --nproc_per_node, shows the difference"
        ))


def analyze(ctx: RunContext) -> list[Finding]:
    hits = []
    for r, p in ctx.ranks.items():
        begin = p.first("pg_init_begin")
        if begin and ctx.world_size_from_device_count(p, begin):
            given, used = begin["overridden"]["world_size"]
            hits.append((r, p, begin, int(given), int(used)))
    if not hits:
        _measure_agreeing(ctx)
        return []
    _, _, begin, _, used = hits[0]
    counts = sorted({given for *_, given, _ in hits})
    nodes = ctx.nodes
    per_node = sorted({len(ranks) for ranks in nodes.values()})
    spread = f"{per_node[0]} on each" if len(per_node) == 1 else "/".join(str(len(x)) for x in nodes.values())
    where = f"{used} processes on {len(nodes)} nodes ({spread})" if len(nodes) > 1 else f"{used} processes"
    count_text = " / ".join(map(str, counts))
    message = (
        f"init_process_group at {ctx.at(begin.get('site'))} passes world_size={count_text}, the node's "
        f"torch.cuda.device_count(), on {fmt_ranks([h[0] for h in hits])} while the launcher started {where}: "
        "every node believes it is the whole world, so the rendezvous would never complete (the probe used the "
        "launcher's world size to keep measuring)"
    )
    evidence = {
        "world_size_passed": {str(r): given for r, _, _, given, _ in hits},
        "device_count": {str(r): (p.first("torch_ready") or {}).get("device_count") for r, p, *_ in hits},
        "launcher_world_size": used,
        "nodes": {node: ranks for node, ranks in nodes.items()},
    }
    # the rendezvous cannot complete: the run never starts (same consequence as a hard-coded world size, DD104)
    return [ctx.finding(CODE, message=message, severity=Severity.CRITICAL, site=begin.get("site"),
                        ranks=[h[0] for h in hits], evidence=evidence, magnitude=float(len(hits)))]
