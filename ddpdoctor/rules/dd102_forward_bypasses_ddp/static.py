"""DD102 forward-bypasses-ddp: the training forward calls the module that DDP wraps instead of the wrapper.

What it flags: a forward call (`net(x)`, `net.forward(x)`, `model.module(x)`) of a module whose model DDP
wrapped earlier, outside no_grad/inference_mode, not in eval mode, whose output is not detached — the wrapper's
forward is what arms the gradient all-reduce, so steps taken on this forward train each rank on its own.

What stays silent: the wrapper's own forward; `model = DDP(model)` under `if args.distributed:` (the variable
holds the wrapper or, on the other path, the unwrapped model — never the wrapped module behind the wrapper's
back); evaluation through `model.module` under no_grad; forwards of other models (EMA, teacher copies), also when
they were wrapped only to broadcast rank 0's weights (no forward through that wrapper, no optimizer over them).

Confidence: certain when a backward pass follows in the same function and the wrap is in the same function;
likely when the relation goes through calls/attributes; possible when no backward pass is seen near it.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd102_forward_bypasses_ddp import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import Event, Obj


def _optimised(script: ScriptModel) -> list[Obj] | None:
    """The modules (or wrappers) whose parameters the script's optimizers hold; None when some optimizer's
    parameters are not traced (or there is none): then nothing says what is trained."""
    owners = [script.param_owners(ev.data["obj"].props.get("params") or ()) for ev in script.of("optimizer")]
    return [o for found in owners for o in found] if owners and all(owners) else None


def _wrapped_only_to_broadcast(obj: Obj, run_through: set[int], optimised: list[Obj] | None) -> bool:
    """A model that no forward runs through its DDP wrapper (`run_through`: the ids of the objects inside the
    wrappers that forwards run through) and that no optimizer trains (`optimised`): the wrap only broadcast rank
    0's weights at construction (StyleGAN2 wraps its EMA generator so, and throws the wrapper away); a forward of
    the model itself bypasses nothing."""
    if optimised is None or id(obj) in run_through:
        return False
    # by identity, not by family: a loop that wraps several models (`for m in [G, G_ema]: DDP(m)`) gives them one
    # family in the walk, and G's optimizer does not train G_ema
    return not any(o is obj or (o.kind == "wrapper" and _holds(o, obj)) for o in optimised)


def _holds(wrapper: Obj, obj: Obj) -> bool:
    return any(i is obj for i in wrapper.props.get("inner", ()))


def check(script: ScriptModel) -> Iterator[Finding]:
    forwards = script.of("forward")
    through_wrapper: list[Event] | None = None  # forwards of a DDP wrapper, listed at the first hit
    run_through: set[int] = set()  # ids of the objects inside those wrappers
    optimised = _optimised(script)
    for fw in forwards:
        if fw.data["inside_forward"] or fw.data["detached"] or fw.grad_off is not False:
            continue
        targets = fw.data["target"]
        raw = [o for o in targets if o.kind != "wrapper"]
        hit = None
        for o in raw:
            wrap = script.wrap_event_before(o, fw)
            if wrap is None:
                continue
            # a variable that holds the wrapper on one path and the plain module on the other is the usual
            # `if args.distributed: model = DDP(model)`: the wrapper is what runs when DDP is on
            if any(t.kind == "wrapper" and t.family is o.family for t in targets):
                continue
            hit = (o, wrap)
            break
        if hit is None or all(m == "eval" for m in fw.data["modes"]):
            continue
        obj, wrap = hit
        if through_wrapper is None:
            through_wrapper = [f for f in forwards if any(t.kind == "wrapper" for t in f.data["target"])]
            run_through = {
                id(i) for f in through_wrapper for t in f.data["target"] if t.kind == "wrapper"
                for i in t.props.get("inner", ())
            }
        if _wrapped_only_to_broadcast(obj, run_through, optimised):
            continue
        fw_loops = {c.node for c in fw.loops}
        backward_after = [
            b
            for b in script.backward_events
            if b.seq > fw.seq and (b.frame == fw.frame or any(c.node in fw_loops for c in b.loops))
        ]
        innermost = fw.loops[-1].node if fw.loops else None
        ddp_forward_same_loop = innermost is not None and any(
            f is not fw
            and any(c.node is innermost for c in f.loops)
            and any(t.kind == "wrapper" and t.family is obj.family for t in f.data["target"])
            for f in through_wrapper
        )
        if backward_after and wrap.frame == fw.frame:
            confidence = Confidence.CERTAIN
        elif backward_after:
            confidence = Confidence.LIKELY
        else:
            confidence = Confidence.POSSIBLE
        if ddp_forward_same_loop:
            confidence = Confidence.POSSIBLE
        confidence = cap_unreached(confidence, fw, wrap)
        callee = script.text(fw.node.func if hasattr(fw.node, "func") else fw.node)
        wrapped_text = script.text(wrap.data["args"].node(0, "module"))
        yield script.finding(
            CODE,
            line=fw,
            message=f"the forward at line {fw.line} calls `{callee}` — the module that DDP wraps at "
            f"{script.place(wrap, fw)} — instead of the DDP wrapper, so its gradients are never averaged across ranks",
            confidence=confidence,
            evidence={
                "forward_line": fw.line,
                "wrap_line": wrap.line,
                "callee": callee,
                "wrapped": wrapped_text,
                "backward_lines": sorted({b.line for b in backward_after})[:5],
                "wrapper_forward_in_same_loop": bool(ddp_forward_same_loop),
            },
        )
