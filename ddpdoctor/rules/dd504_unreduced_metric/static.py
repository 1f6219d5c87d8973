"""DD504 unreduced-metric: an evaluation metric computed on one rank's shard and reported as if global.

What it flags (low): an evaluation loop (no backward/step inside) over a loader whose DistributedSampler gives
each rank a different shard, when neither the evaluation function nor its caller reduces anything across ranks
(`dist.all_reduce`, `all_gather`, `gather_object`, a `reduce`/`gather`/`sync`-named helper such as
`meter.all_reduce()` or `metric_logger.synchronize_between_processes()`) before the metric is printed/logged.

Also flagged (low, certain from syntax): a Horovod collective that returns a new tensor — `hvd.allreduce(t)`,
`hvd.allgather(t)`, `hvd.broadcast(t)` — called as a statement: its result is thrown away and `t` stays this
rank's own value (only `hvd.allreduce_` works in place). Such a call is no reduction for the check above either.

Also flagged: Lightning's `self.log(name, value)` in validation_step or an epoch-end hook without `sync_dist=True`
(Lightning gives the validation loader a DistributedSampler; `sync_dist=True` all-reduces the value, and is a
reduction here).

What stays silent: evaluation over the full set (no DistributedSampler), any reduction in the evaluation function
or its caller, results gathered through files (each rank writes its part, then a barrier, in the evaluation
function, its caller or a helper the caller runs: the main rank merges the files), torchmetrics (its metrics
sync on `compute()`; in Lightning, a Metric object given to `self.log`).
"""

from __future__ import annotations

import re
from typing import Iterator

from ddpdoctor import torchnames as N
from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.plain import LazyPattern
from ddpdoctor.rules.dd504_unreduced_metric import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached

_REDUCING_NAME = re.compile(r"reduce|gather|sync|allreduce", re.I)
# Libraries whose calls with such a name stay on the rank: torch.cuda.synchronize() waits for this rank's device,
# torch.gather / np.add.reduce / functools.reduce combine values of one process. torch.distributed is not among them.
_LOCAL_LIBRARIES = ("torch", "numpy", "functools", "operator", "math", "pandas", "scipy")
# Tensor methods with such a name, told from a helper of the same name by their signature (dim and index)
_TENSOR_METHODS = frozenset({"gather", "scatter_reduce", "scatter_reduce_", "index_reduce", "index_reduce_"})


def check(script: ScriptModel) -> Iterator[Finding]:
    # torchmetrics syncs on compute(): a script that uses it is taken to reduce its metrics, except in a
    # framework's loop, whose model tells a Metric object logged (synced) from a tensor (rank-local)
    torchmetrics = any(m.startswith("torchmetrics") for m in script.imported)
    collectives = script.of("collective")
    discarded = [ev for ev in collectives if ev.data.get("discarded")]
    yield from _discarded(script, discarded)
    reductions = [
        ev for ev in collectives
        if ev.data["op"] in N.REDUCING_COLLECTIVES
        or (ev.data.get("library") == "horovod" and not ev.data.get("discarded")
            and _REDUCING_NAME.search(ev.data["op"]))
    ]
    reductions += [ev for ev in script.of("call") if _reduces_across_ranks(ev)]
    reports = script.of("report")
    seen: set[int] = set()
    for it in script.of("iterate"):
        loop = it.data.get("loop")
        if not script.loop_evaluates(loop) or (torchmetrics and not it.data.get("engine")):
            continue
        sharded = [
            ld
            for ld in it.data["loaders"]
            if any(s.kind == "sampler" and s.props.get("distributed") for s in ld.fields.get("sampler", ()))
        ]
        if not sharded or id(loop) in seen:
            continue
        seen.add(id(loop))
        eval_frame = it.frame
        caller = it.frames[-2] if len(it.frames) > 1 else None
        scope = {eval_frame} | ({caller} if caller is not None else set())
        if any(r.seq > it.seq and (eval_frame in r.frames or r.frame == caller) for r in reductions):
            continue
        if _gathered_through_files(script, it, eval_frame, caller):
            continue
        if it.data.get("engine"):  # a framework's loop: the hooks it calls report (`self.log` in validation_step)
            reported = [r for r in reports if r.seq > it.seq and eval_frame in r.frames]
        else:
            reported = [r for r in reports if r.seq > it.seq and r.frame in scope]
        if not reported:
            continue
        report = reported[0]
        name = script.name(sharded[0])
        if it.data.get("engine") == "lightning":
            message = (
                f"`{script.text(report.node)}` logs a value computed on this rank's shard only (Lightning gives "
                f"`{name}`, evaluated by the trainer at {script.place(it, report)}, a DistributedSampler) without "
                f"sync_dist=True, so the logged metric (and a checkpoint or early stop that monitors it) describes "
                f"1/world_size of the data"
            )
            detail = "In Lightning: self.log(name, value, sync_dist=True), or log a torchmetrics Metric object."
        else:
            message = (
                f"the evaluation loop over `{name}` ({script.place(it, report)}) sees only this rank's "
                f"DistributedSampler shard, and the metric reported at line {report.line} is never reduced across "
                f"ranks, so it describes 1/world_size of the data"
            )
            detail = None
        yield script.finding(
            CODE,
            line=report,
            message=message,
            confidence=cap_unreached(Confidence.LIKELY, it, report),
            evidence={"eval_loop_line": it.line, "report_line": report.line, "loader": name},
            fix_detail=detail,
        )


def _reduces_across_ranks(ev) -> bool:  # noqa: ANN001
    """A call that may combine the ranks' values: a helper named like a reduction (`meter.all_reduce()`,
    `reduce_tensor(t)`, `metric_logger.synchronize_between_processes()`), never a library call that stays on the
    rank (`torch.cuda.synchronize()` timing the evaluation, `iu.gather(0, idx)`, `functools.reduce`): taking those
    for a reduction left a confusion matrix accumulated per rank and reported from rank 0 unflagged (issue 20)."""
    name = ev.data.get("name") or ""
    if not _REDUCING_NAME.search(name):
        return False
    qual = ev.data.get("qual") or ""
    if qual and qual.split(".")[0] in _LOCAL_LIBRARIES and not qual.startswith("torch.distributed"):
        return False
    if name == "synchronize":  # a device, stream or event synchronize: this rank waits, nothing moves between ranks
        return False
    args = ev.data.get("args")
    if name in _TENSOR_METHODS and args is not None and (len(args.pos) >= 2 or "index" in args.kw):
        return False
    return True


_WRITES = LazyPattern(r"dump|save|write", re.I)


def _gathered_through_files(script: ScriptModel, it, eval_frame: int, caller: int | None) -> bool:  # noqa: ANN001
    """Results written to a file and a barrier after it, in the evaluation function, its caller or a helper the
    caller runs after the loop (each rank dumps its part, waits, and the main rank merges every rank's file: a
    gather through the file system)."""
    writes = [ev for ev in script.of("call") if ev.seq > it.seq and _WRITES.search(ev.data.get("name") or "")]
    writes += [ev for ev in script.of("save") if ev.seq > it.seq]
    for b in script.of("collective"):
        if b.data["op"] != "barrier" or b.seq <= it.seq:
            continue
        if not (eval_frame in b.frames or (caller is not None and caller in b.frames)):
            continue
        if any(w.frame == b.frame and w.seq < b.seq for w in writes):
            return True
    return False


def _discarded(script: ScriptModel, events: list) -> Iterator[Finding]:  # noqa: ANN001
    """Horovod collectives whose new tensor is thrown away (one finding per line)."""
    seen: set[tuple[str, int]] = set()
    for ev in events:
        if (ev.file, ev.line) in seen:
            continue
        seen.add((ev.file, ev.line))
        op = ev.data["op"]
        arg = script.text(ev.data["args"].node(0, "tensor"))
        yield script.finding(
            CODE,
            line=ev,
            message=f"`{op}({arg}, ...)` at line {ev.line} returns the reduced value as a new tensor and the result "
            f"is thrown away: `{arg}` keeps this rank's own value, so what the script reports is rank-local "
            f"(use the result, or {op}_({arg}) which works in place)",
            confidence=cap_unreached(Confidence.CERTAIN, ev),
            evidence={"line": ev.line, "op": op, "argument": arg, "result_discarded": True},
        )
