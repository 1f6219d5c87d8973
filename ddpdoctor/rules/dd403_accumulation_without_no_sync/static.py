"""DD403 accumulation-without-no-sync: gradient accumulation that all-reduces on every micro-step.

What it flags (low): in a DDP script, a `backward()` that runs on every iteration of a loop whose optimizer step
runs only every k-th iteration (`if (i + 1) % accum_steps == 0: optimizer.step()`, or `if update_grad:` inside an
AMP loss-scaler helper called with `update_grad=(i + 1) % accum_steps == 0`) or after an inner loop of
micro-steps, without `model.no_sync()` around the intermediate backward passes. Each micro-step pays a full
gradient all-reduce; the result is the same, only slower.

What stays silent: `with model.no_sync():` (also conditional: `model.no_sync() if ... else nullcontext()`),
`model.require_backward_grad_sync = ...` (nanoGPT), `accelerator.accumulate(model)`, plain one-step-per-batch
loops, steps guarded by non-accumulation conditions (`if scaler is not None`).
"""

from __future__ import annotations

import ast
import re
from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd403_accumulation_without_no_sync import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import Ctx, Event

_ACCUMULATION = re.compile(r"%|accum|update_freq|iters_to_acc|grad_acc|micro", re.I)


def _gate(script: ScriptModel, c: Ctx, step: Event) -> tuple[int, str] | None:
    """A branch that lets the step through only every k-th micro-step, as (how directly, how a message names it),
    or None: 0 for a test that reads like one (`if (i + 1) % accum_steps == 0`); 1 for a flag computed like one
    elsewhere — the argument of a helper (`if update_grad:` in an AMP loss scaler called with `update_grad=(idx +
    1) % accum == 0`, Swin's and ConvNeXt's) or a variable (`do_step = (i + 1) % k == 0`)."""
    if _ACCUMULATION.search(str(c.info)):
        return 0, f"`if {c.info}`"
    test = c.node.test if isinstance(c.node, (ast.If, ast.IfExp, ast.While)) else None
    for o in c.test:
        if isinstance(o.node, ast.expr) and o.node is not test:
            text = script.text(o.node)
            if _ACCUMULATION.search(text):
                return 1, f"`if {c.info}`, {c.info} = `{text}` ({script.place(o, step)})"
    return None


def check(script: ScriptModel) -> Iterator[Finding]:
    """One finding per script: the first accumulation seen, one gated by its own test before one gated by a flag
    computed elsewhere (a script with both paths, AMP and not, is named where its test reads directly)."""
    if not script.ddp_wraps or "require_backward_grad_sync" in script.words or "no_sync" in script.words:
        return
    found = sorted(_accumulations(script), key=lambda hit: hit[0])
    if not found:
        return
    _, bw, step, gate, how = found[0]
    wrappers = {script.name(ev.data["wrapper"]) for ev in script.ddp_wraps}
    wrapper = next(iter(wrappers)) if len(wrappers) == 1 else None
    yield script.finding(
        CODE,
        line=bw,
        message=f"gradient accumulation: backward at line {bw.line} runs every micro-step but the optimizer "
        f"steps at {script.place(step, bw)} only after {how}, and without {wrapper or 'model'}.no_sync() DDP "
        "all-reduces on every micro-step",
        confidence=cap_unreached(Confidence.LIKELY, bw, step),
        evidence={"backward_line": bw.line, "step_line": step.line, "gate": gate.info if gate else None,
                  "wrapper": wrapper},
    )


def _accumulations(script: ScriptModel) -> Iterator[tuple[int, Event, Event, Ctx | None, str]]:
    """(how directly, backward, step, gate, how) for each backward that runs more often than the step after it."""
    # what depends on the backward alone, once per backward: a script with hundreds of steps and backwards (a
    # notebook exported as straight-line code) pairs each with each
    backwards = [
        (bw, bw.frame, bw.frames, {id(b.node) for b in bw.loops})
        for bw in script.backward_events
        if not (bw.in_ctx("no_sync") or bw.in_ctx("accumulate"))
    ]
    # a pair needs a loop around both: each step meets only the backwards inside one of its loops (indexed by
    # loop, in their order), not every backward of the script
    by_loop: dict[int, list[int]] = {}
    for i, (_, _, _, loop_nodes) in enumerate(backwards):
        for node_id in loop_nodes:
            by_loop.setdefault(node_id, []).append(i)
    for step in script.of("opt_step"):
        step_loops, step_frame, step_frames = step.loops, step.frame, step.frames
        near = sorted({i for c in step_loops for i in by_loop.get(id(c.node), ())})
        for bw, bw_frame, bw_frames, bw_loop_nodes in (backwards[i] for i in near):
            # the backward in the stepping function or in one it calls (DeepLearningExamples' Trainer.train_step
            # steps, its Executor's method runs backward), or the step in one the backward's function calls
            if not (step_frame in bw_frames or bw_frame in step_frames):
                continue
            shared = [c for c in step_loops if id(c.node) in bw_loop_nodes]
            if not shared or bw.exclusive_with(step):
                continue  # (or on the other side of a branch from the step: the AMP path's backward, the plain step)
            outer = shared[-1]
            step_tail = step.ctx[step.ctx.index(outer) + 1 :]
            bw_tail = bw.ctx[bw.ctx.index(outer) + 1 :] if outer in bw.ctx else ()
            gates = [
                (g, c) for c in step_tail if c.kind == "cond" and c not in bw_tail and (g := _gate(script, c, step))
            ]
            inner = next((c for c in bw_tail if c.kind == "loop" and c not in step_tail), None)
            if (gates or inner is not None) and _stepped_at_once(script, bw, step):
                continue  # an unconditional step of the same optimizer consumes this backward's gradients first
            if gates:
                (rank, how), gate = min(gates, key=lambda g: g[0][0])
                yield rank, bw, step, gate, how
            elif inner is not None:
                yield 0, bw, step, None, f"the micro-step loop of {script.place(inner, bw)}"


def _stepped_at_once(script: ScriptModel, bw: Event, gated: Event) -> bool:
    """Whether an optimizer steps after `bw` in the same iteration with no gate or micro-step loop between them
    (a GAN: the discriminator's backward and step, a regularisation backward and step every k-th iteration, then
    the generator's backward and step): that backward's gradients are used at once, not accumulated."""
    for step in script.of("opt_step"):
        if step is gated or step.seq < bw.seq:
            continue
        if not (step.frame in bw.frames or bw.frame in step.frames) or bw.exclusive_with(step):
            continue
        shared = [c for c in step.loops if any(c.node is b.node for b in bw.loops)]
        if not shared:
            continue
        outer = shared[-1]
        step_tail = step.ctx[step.ctx.index(outer) + 1 :]
        bw_tail = bw.ctx[bw.ctx.index(outer) + 1 :] if outer in bw.ctx else ()
        if all(c in bw_tail for c in step_tail if c.kind in ("cond", "loop")) and not any(
            c.kind == "loop" and c not in step_tail for c in bw_tail
        ):
            return True
    return False
