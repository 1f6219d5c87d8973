"""DD107 moved-after-wrap: `.to()`/`.cuda()` (or a dtype change) on a model after DDP wrapped it.

What it flags: a move or cast of the DDP wrapper, or of the module inside it, after the wrap, when the model
still trains afterwards. DDP builds its gradient buckets and broadcasts parameters for the device and dtype the
module had at construction; moving it later leaves the reducer pointing at the old tensors.

What stays silent: moves before wrapping (`DDP(model.to(device))`), moves of other models, a move after the last
training step (exporting on CPU at the end). A move that repeats exactly the move made before wrapping is a
no-op today and is reported at low severity only.

Confidence: certain when the move and the wrap are in the same function; likely through data flow.
"""

from __future__ import annotations

import ast
from typing import Iterator

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.rules.dd107_moved_after_wrap import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached


def _args_key(node: ast.AST) -> str:
    if not isinstance(node, ast.Call):
        return ""
    return (
        ast.dump(ast.Tuple(elts=list(node.args), ctx=ast.Load()))
        + ast.dump(ast.Tuple(elts=[k.value for k in node.keywords], ctx=ast.Load()))
    )


def check(script: ScriptModel) -> Iterator[Finding]:
    moves = script.of("move")
    for mv in moves:
        for obj in mv.data["target"]:
            if obj.kind == "wrapper" and obj.wrapper_kind == "ddp":
                wrap = script.wrap_event_of(obj)
            else:
                wrap = script.wrap_event_before(obj, mv)
            if wrap is None or wrap.seq > mv.seq or wrap.exclusive_with(mv):
                continue
            family = obj.family
            trains_after = any(
                f.seq > mv.seq and any(t.family is family for t in f.data["target"])
                for f in script.of("forward")
            ) or any(b.seq > mv.seq for b in script.backward_events)
            if not trains_after:
                continue
            key = _args_key(mv.node)
            repeated = next(
                (
                    m
                    for m in moves
                    if m.seq < wrap.seq
                    and m.data["method"] == mv.data["method"]
                    and _args_key(m.node) == key
                    and any(t.family is family for t in m.data["target"])
                ),
                None,
            )
            call = script.text(mv.node)
            if repeated is not None:
                yield script.finding(
                    CODE,
                    line=mv,
                    message=f"`{call}` at line {mv.line} moves the model again after DDP wrapped it at "
                    f"{script.place(wrap, mv)}; it repeats the move of {script.place(repeated, mv)}, so it is a no-op "
                    "today but breaks if they diverge",
                    confidence=Confidence.POSSIBLE,
                    evidence={"move_line": mv.line, "wrap_line": wrap.line, "same_as_line": repeated.line},
                    severity=Severity.LOW,
                )
                break
            confidence = Confidence.CERTAIN if mv.frame == wrap.frame else Confidence.LIKELY
            yield script.finding(
                CODE,
                line=mv,
                message=f"`{call}` at line {mv.line} moves the model after DDP wrapped it at "
                f"{script.place(wrap, mv)}; DDP's gradient buckets still refer to the parameters it saw when it was "
                "built",
                confidence=cap_unreached(confidence, mv, wrap),
                evidence={"move_line": mv.line, "wrap_line": wrap.line, "method": mv.data["method"]},
            )
            break
