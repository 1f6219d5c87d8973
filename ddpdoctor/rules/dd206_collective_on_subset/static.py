"""DD206 collective-on-subset: a collective, or a DDP/SyncBN forward that syncs, runs on some ranks only.

What it flags: `dist.all_reduce/barrier/broadcast/all_gather/...` (and `new_group`) inside a branch that only
some ranks take (`if rank == 0:`, `if is_main_process():`, after `if rank != 0: return`, in a
`@rank_zero_only` function), also through helpers called from such a branch; a forward through the DDP wrapper
on a subset of ranks (DDP broadcasts BatchNorm buffers at the start of the first forward after a training step,
even in eval mode) or through SyncBN layers in training mode.

Also: a `dist.recv`/`irecv` when the script never sends anything (point-to-point inside rank branches is normal;
a receive nobody matches is a hang).

What stays silent: collectives every rank reaches; `torch.distributed.barrier()` pairs that complement each other
(the "rank 0 first" pattern: `if rank != 0: barrier()` … `if rank == 0: barrier()`), and the same collective
called on each side of a branch on the rank (role-based code); tests that are uniform across ranks
(`if local_rank != -1:`, `if args.distributed:`); rank-0 evaluation through `model.module`.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.rules.dd206_collective_on_subset import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import Ctx, Event, Obj

_WHO = {"main": "only on the main rank", "nonmain": "on every rank but the main one"}


def _flip(polarity: str) -> str:
    return {"main": "nonmain", "nonmain": "main"}.get(polarity, polarity)


def _shared_branch(a: Event, b: Event) -> list[Ctx]:
    """The branch points (same `if`, same call) where `a` and `b` took different sides."""
    return [
        x
        for x in a.ctx
        for y in b.ctx
        if x.kind in ("cond", "rank") and y.node is x.node and y.frame == x.frame and y.branch != x.branch
    ]


def _branch(ev: Event) -> Ctx:
    return ev.rank_ctx[-1]


def _where(script: ScriptModel, branch: Ctx, ev: Event) -> str:
    node = branch.node
    test = getattr(node, "test", None)
    line = getattr(node, "lineno", 0)
    place = script.place(branch, ev)
    if test is None:
        return f"a rank-only function ({place})"
    if ev.line > (getattr(node, "end_lineno", None) or line) and ev.frame == branch.frame:
        return f"after the early exit `if {script.text(test)}` at {place}"
    return f"`if {script.text(test)}` at {place}"


def check(script: ScriptModel) -> Iterator[Finding]:
    collectives = [ev for ev in script.of("collective") if ev.rank_ctx]
    all_collectives = script.of("collective")
    for ev in collectives:
        branch = _branch(ev)
        op = ev.data["op"]
        complement = [
            other
            for other in all_collectives
            if other is not ev
            and other.data["op"] == op
            and (
                # `if rank != 0: barrier()` ... `if rank == 0: barrier()`: every rank calls it once
                (
                    other.frame == ev.frame
                    and other.rank_ctx
                    and branch.info in ("main", "nonmain")
                    and _branch(other).info == _flip(branch.info)
                )
                # `if rank == A: new_group(...) elif rank == B: new_group(...)`: each role calls it
                or any(c.kind == "rank" for c in _shared_branch(ev, other))
            )
        ]
        if complement:
            continue
        confidence = Confidence.CERTAIN if branch.frame == ev.frame else Confidence.LIKELY
        if branch.info == "other":
            confidence = Confidence.LIKELY if confidence == Confidence.CERTAIN else Confidence.POSSIBLE
        who = _WHO.get(branch.info, "only on some ranks")
        # a library's collective is named as the script calls it (`accelerator.wait_for_everyone`, `hvd.allreduce`)
        name = f"dist.{op}" if not ev.data.get("library") else script.text(getattr(ev.node, "func", ev.node))
        yield script.finding(
            CODE,
            line=ev,
            message=f"{name} at line {ev.line} runs {who} ({_where(script, branch, ev)}); the other ranks never "
            f"join it, so the run hangs or pairs it with a different collective",
            confidence=cap_unreached(confidence, ev),
            evidence={
                "op": op, "line": ev.line, "branch_line": getattr(branch.node, "lineno", 0), "ranks": branch.info
            },
        )
    p2p = script.of("p2p")
    senders = {ev.data["op"] for ev in p2p if ev.data["op"] in ("send", "isend", "batch_isend_irecv")}
    for ev in p2p:
        if ev.data["op"] in ("recv", "irecv") and not senders:
            where = f" ({_where(script, ev.rank_ctx[-1], ev)})" if ev.rank_ctx else ""
            yield script.finding(
                CODE,
                line=ev,
                message=f"dist.{ev.data['op']} at line {ev.line}{where} waits for a tensor that no rank of this "
                f"script ever sends, so it never returns and the other ranks block in their next collective",
                confidence=cap_unreached(Confidence.LIKELY, ev),
                evidence={"op": ev.data["op"], "line": ev.line},
            )
    for fw in script.of("forward"):
        if not fw.rank_ctx or fw.data["inside_forward"]:
            continue
        branch = _branch(fw)
        targets = fw.data["target"]
        ddp = [t for t in targets if t.kind == "wrapper" and t.wrapper_kind == "ddp"]
        modes = fw.data["modes"]
        training = "train" in modes
        syncbn = [t for t in targets if t.family is not None and t.family.syncbn_line and t.kind != "wrapper"]
        who = _WHO.get(branch.info, "only on some ranks")
        if ddp:
            fam = ddp[0].family
            has_bn = fam.has_bn if fam is not None else None
            buffers_off = _broadcast_buffers_off(ddp[0])
            if not training and (has_bn is False or buffers_off):
                continue
            if training:
                confidence, why = Confidence.CERTAIN, "DDP syncs buffers and arms the gradient all-reduce on every rank"
            elif has_bn:
                confidence, why = (
                    Confidence.LIKELY,
                    "even in eval mode DDP broadcasts the BatchNorm buffers at the first forward after training",
                )
            else:
                confidence, why = (
                    Confidence.POSSIBLE,
                    "if the model has buffers, DDP broadcasts them at the first forward after training",
                )
            severity = Severity.MEDIUM if confidence == Confidence.POSSIBLE else None
            if branch.frame != fw.frame:
                confidence = min(confidence, Confidence.LIKELY)
            yield script.finding(
                CODE,
                line=fw,
                message="the forward through the DDP wrapper "
                f"`{script.text(getattr(fw.node, 'func', fw.node))}` at line {fw.line} runs {who} "
                f"({_where(script, branch, fw)}); {why}, so the other ranks' next collective pairs with it — use the "
                "unwrapped module there",
                confidence=cap_unreached(confidence, fw),
                evidence={"line": fw.line, "branch_line": getattr(branch.node, "lineno", 0), "mode": list(modes)},
                severity=severity,
            )
        elif syncbn and training:
            yield script.finding(
                CODE,
                line=fw,
                message=f"the SyncBatchNorm model `{script.text(getattr(fw.node, 'func', fw.node))}` runs a "
                f"training-mode forward at line {fw.line} {who} ({_where(script, branch, fw)}); SyncBN all-reduces "
                f"batch statistics there and the other ranks never join",
                confidence=cap_unreached(Confidence.LIKELY, fw),
                evidence={
                    "line": fw.line,
                    "branch_line": getattr(branch.node, "lineno", 0),
                    "syncbn_line": syncbn[0].family.syncbn_line if syncbn[0].family else None,
                },
            )


def _broadcast_buffers_off(wrapper: Obj) -> bool:
    """`DDP(model, broadcast_buffers=False)`: the wrapper's forward does not broadcast buffers."""
    args = wrapper.props.get("args")
    if args is None:
        return False
    value = args.get(None, "broadcast_buffers")
    return bool(value) and all(o.kind == "const" and o.value is False for o in value)
