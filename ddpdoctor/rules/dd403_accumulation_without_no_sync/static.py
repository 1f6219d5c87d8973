"""DD403 accumulation-without-no-sync: gradient accumulation that all-reduces on every micro-step.

What it flags (low): in a DDP script, a `backward()` that runs on every iteration of a loop whose optimizer step
runs only every k-th iteration (`if (i + 1) % accum_steps == 0: optimizer.step()`) or after an inner loop of
micro-steps, without `model.no_sync()` around the intermediate backward passes. Each micro-step pays a full
gradient all-reduce; the result is the same, only slower.

What stays silent: `with model.no_sync():` (also conditional: `model.no_sync() if ... else nullcontext()`),
`model.require_backward_grad_sync = ...` (nanoGPT), `accelerator.accumulate(model)`, plain one-step-per-batch
loops, steps guarded by non-accumulation conditions (`if scaler is not None`).
"""

from __future__ import annotations

import re
from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd403_accumulation_without_no_sync import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached

_ACCUMULATION = re.compile(r"%|accum|update_freq|iters_to_acc|grad_acc|micro", re.I)


def check(script: ScriptModel) -> Iterator[Finding]:
    if not script.ddp_wraps or "require_backward_grad_sync" in script.words or "no_sync" in script.words:
        return
    for step in script.of("opt_step"):
        for bw in script.backward_events:
            if bw.frame != step.frame or bw.in_ctx("no_sync") or bw.in_ctx("accumulate"):
                continue
            shared = [c for c in step.loops if any(c.node is b.node for b in bw.loops)]
            if not shared:
                continue
            outer = shared[-1]
            step_tail = step.ctx[step.ctx.index(outer) + 1 :]
            bw_tail = bw.ctx[bw.ctx.index(outer) + 1 :] if outer in bw.ctx else ()
            gate = next(
                (c for c in step_tail if c.kind == "cond" and c not in bw_tail and _ACCUMULATION.search(str(c.info))),
                None,
            )
            inner = next((c for c in bw_tail if c.kind == "loop" and c not in step_tail), None)
            if gate is None and inner is None:
                continue
            if gate is not None:
                how = f"`if {gate.info}`"
            else:
                how = f"the micro-step loop of {script.place(inner, bw)}" if inner else "the micro-step loop"
            yield script.finding(
                CODE,
                line=bw,
                message=f"gradient accumulation: backward at line {bw.line} runs every micro-step but the optimizer "
                f"steps at {script.place(step, bw)} only after {how}, and without model.no_sync() DDP all-reduces "
                "on every micro-step",
                confidence=cap_unreached(Confidence.LIKELY, bw, step),
                evidence={"backward_line": bw.line, "step_line": step.line, "gate": gate.info if gate else None},
            )
            return
