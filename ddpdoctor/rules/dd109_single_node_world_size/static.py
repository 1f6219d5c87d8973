"""DD109 single-node-world-size: the world size is `torch.cuda.device_count()`.

What it flags: `mp.spawn(nprocs=...)`, `init_process_group(world_size=...)` or `DistributedSampler(num_replicas=...)`
fed only from `torch.cuda.device_count()`. On one node that spawns one process per GPU this is correct (low);
across nodes every node believes it is the whole world. When the script also reads the launcher's environment
(RANK/LOCAL_RANK/WORLD_SIZE), the launcher decides the world size and device_count disagrees with it as soon as
`--nproc_per_node` differs from the GPU count: medium.

Also flagged: the per-process batch of a distributed script's DataLoader computed from device_count() (a node's
batch divided by its GPUs) — the batch each rank trains on then depends on how many GPUs the machine has, not on how
many processes the job runs. A Horovod script (`hvd.init()`) has its world size from its launcher (`hvd.size()`),
so every use of device_count() as the world is medium there.

What stays silent: `mp.spawn(nprocs=ngpus_per_node)` with `world_size = ngpus_per_node * args.world_size` (the
multi-node ImageNet recipe), WORLD_SIZE from the environment, `dist.get_world_size()`, `hvd.size()`, and a
DataParallel script's batch scaled by device_count() (one process drives every GPU).
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.rules.dd109_single_node_world_size import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import PER_RANK_TAGS, Event, Value


def _only_device_count(value: Value | None) -> bool:
    if not value:
        return False
    for o in value:
        if o.const:
            continue
        if "device_count" not in o.tags or o.tags & ({"world_size", "env", "rank_dep"} | PER_RANK_TAGS):
            return False
    return any("device_count" in o.tags for o in value)


class _Sink(NamedTuple):
    what: str
    text: str
    event: Event


def check(script: ScriptModel) -> Iterator[Finding]:
    sinks: list[_Sink] = []
    worlds = [ev.data["params"].get("world_size") for ev in script.of("init_pg")]
    # nprocs = device_count is the per-node process count; it is only the world size when the process group
    # is told so too (the ImageNet recipe passes ngpus_per_node * nodes and is correct on many nodes)
    per_node_only = any(w and not _only_device_count(w) for w in worlds)
    for ev in script.of("spawn"):
        if _only_device_count(ev.data.get("nprocs")) and not per_node_only:
            sinks.append(_Sink("mp.spawn nprocs", script.text(ev.data.get("nprocs_node")), ev))
    for ev in script.of("init_pg"):
        if _only_device_count(ev.data["params"].get("world_size")):
            sinks.append(_Sink("init_process_group world_size", script.text(ev.data["nodes"].get("world_size")), ev))
    for ev in script.of("sampler"):
        if _only_device_count(ev.data["obj"].props.get("num_replicas")):
            sinks.append(_Sink("DistributedSampler num_replicas", "", ev))
    if script.distributed:
        for ev in script.of("loader"):
            if _only_device_count(ev.data["obj"].props.get("batch_size")):
                sinks.append(_Sink("per-process batch size of the DataLoader", "device_count", ev))
    if not sinks:
        return
    sinks.sort(key=lambda s: s.event.seq)
    first = sinks[0]
    ev = first.event
    confidence = cap_unreached(Confidence.CERTAIN if "device_count" in first.text else Confidence.LIKELY, ev)
    evidence: dict[str, object] = {"sinks": [{"what": s.what, "line": s.event.line} for s in sinks]}
    launcher_env = sorted(
        {
            e.data["var"]
            for e in script.of("env_read")
            if e.data.get("var") in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        }
    )
    horovod = any(e.data.get("via") == "horovod.torch.init" for e in script.of("init_pg"))
    if horovod:
        yield script.finding(
            CODE,
            line=ev,
            message=f"the {first.what} at line {ev.line} comes from torch.cuda.device_count() (the GPUs this machine "
            f"has) in a Horovod job, whose size is hvd.size(): they disagree as soon as horovodrun -np differs from "
            f"the GPU count or the job spans several nodes",
            confidence=confidence,
            evidence={**evidence, "horovod": True},
            severity=Severity.MEDIUM,
        )
        return
    if launcher_env:
        yield script.finding(
            CODE,
            line=ev,
            message=f"the {first.what} at line {ev.line} is torch.cuda.device_count() while the ranks come from the "
            f"launcher ({', '.join(launcher_env)}); they disagree whenever the launcher starts a different number "
            f"of processes or more than one node",
            confidence=confidence,
            evidence={**evidence, "launcher_env": launcher_env},
            severity=Severity.MEDIUM,
        )
        return
    if first.what.startswith("per-process batch"):
        message = (
            f"the {first.what} at line {ev.line} is computed from torch.cuda.device_count() (the machine's batch "
            f"split over its GPUs): the global batch then follows the GPUs per machine, not the world size — "
            f"correct on one node with one process per GPU"
        )
    else:
        message = (
            f"the {first.what} at line {ev.line} is torch.cuda.device_count(): correct on one node, but on several "
            f"nodes each believes it is the whole world"
        )
    yield script.finding(
        CODE,
        line=ev,
        message=message,
        confidence=confidence,
        evidence=evidence,
    )
