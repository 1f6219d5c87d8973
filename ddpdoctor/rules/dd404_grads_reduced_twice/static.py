"""DD404 grads-reduced-twice: gradients all-reduced by hand on top of DDP.

What it flags: `dist.all_reduce(p.grad)` (or `reduce`/`all_reduce_coalesced`, also on tensors built from
`.grad`) in a script whose model DDP wraps. DDP already averages the gradients during backward; the manual
reduction sums them again — with the default SUM the gradients become world_size times larger (an lr silently
multiplied by the world size), and every step pays two all-reduces.

What stays silent: manual gradient averaging without DDP (the classic "average_gradients" of hand-written data
parallelism); all-reduces of losses and metrics; manual reduction after backward passes run under `no_sync()`.

Confidence: certain when the parameters belong to the model DDP wraps; likely when they cannot be traced.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd404_grads_reduced_twice import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import Obj, Value

_REDUCE_OPS = ("all_reduce", "reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor")


def _grads(value: Value, depth: int = 0) -> list[Obj]:
    out: list[Obj] = []
    for o in value:
        if o.kind == "grad" or "grad" in o.tags:
            out.append(o)
        elif o.kind == "tuple" and depth < 3:
            for v in (o.items or ()) + ((o.props["elem"],) if "elem" in o.props else ()):
                out.extend(_grads(v, depth + 1))
    return out


def check(script: ScriptModel) -> Iterator[Finding]:
    wraps = script.ddp_wraps
    if not wraps:
        return
    if any(b.in_ctx("no_sync") for b in script.backward_events):
        return
    for ev in script.of("collective"):
        if ev.data["op"] not in _REDUCE_OPS:
            continue
        args = ev.data["args"]
        grads = _grads(args.get(0, "tensor") or args.get(0, "tensors") or ())
        if not grads:
            continue
        owners = [o for g in grads for o in g.props.get("owner", ())]
        wrapped = [o for o in owners if o.family is not None and o.family.wrapped]
        if owners and not wrapped:
            continue
        confidence = Confidence.CERTAIN if wrapped else Confidence.LIKELY
        wrap = wraps[0]
        if wrapped:
            wrap = next((w for w in wraps if w.data["wrapper"].family is wrapped[0].family), wrap)
        whose = f"`{script.name(wrapped[0])}`" if wrapped else "the model"
        yield script.finding(
            CODE,
            line=ev,
            message=f"gradients of {whose} are all-reduced by hand at line {ev.line} although DDP "
            f"({script.place(wrap, ev)}) already averages them during backward, so each step reduces them twice",
            confidence=cap_unreached(confidence, ev),
            evidence={"reduce_line": ev.line, "op": ev.data["op"], "wrap_line": wrap.line},
        )
