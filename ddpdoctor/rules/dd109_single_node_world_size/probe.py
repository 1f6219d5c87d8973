"""DD109 single-node-world-size: init_process_group was given torch.cuda.device_count() as the world size.

What it measures: for every rank, the world size it passed to init_process_group against the launcher's (the
probe replaces a disagreeing value with WORLD_SIZE, or SLURM_NTASKS under srun, to go on measuring) and against
`torch.cuda.device_count()` as the script saw it in that process. When the value passed is the node's device count
and the launcher started a different number of processes — several nodes, or `--nproc_per_node` unlike the GPU
count — each node believed it was the whole world: the rendezvous would never have completed. On one node with
one process per GPU the two agree and nothing is measured (the static finding stays: correct on one node only).
"""

from __future__ import annotations

from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Finding, Severity
from ddpdoctor.rules.dd109_single_node_world_size import CODE


def analyze(ctx: RunContext) -> list[Finding]:
    hits = []
    for r, p in ctx.ranks.items():
        begin = p.first("pg_init_begin")
        if begin and ctx.world_size_from_device_count(p, begin):
            given, used = begin["overridden"]["world_size"]
            hits.append((r, p, begin, int(given), int(used)))
    if not hits:
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
