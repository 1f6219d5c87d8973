"""DD401's fix: the optimizer's lr times the world size (linear scaling; its square root for Adam-family)."""

from __future__ import annotations

import ast

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch, keyword

CODE = "DD401"
MEASURE = "lr"

_ATOMIC = (ast.Name, ast.Constant, ast.Attribute, ast.Call, ast.Subscript)


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    call = next((c for c in code.calls(ev.get("optimizer_line"), ev.get("optimizer"))), None)
    if call is None:
        raise NoFix("the optimizer is not built on the finding's line")
    kw = keyword(call, "lr")
    node = kw.value if kw is not None else (call.args[1] if len(call.args) > 1 else None)
    if node is None:
        raise NoFix("the optimizer takes its default lr")
    dist = code.module_alias("torch.distributed")
    edits = []
    if dist is None:
        if code.module_alias("torch") is None:
            raise NoFix("torch.distributed is not imported under a name")
        dist = "torch.distributed"
    world = f"{dist}.get_world_size()"
    if ev.get("ddp_only_when"):  # the same optimizer line serves a single-process run
        world = f"({dist}.get_world_size() if {dist}.is_initialized() else 1)"
    factor = world if ev.get("suggested_scaling") != "sqrt" else f"{world} ** 0.5"
    text = code.segment(node)
    if not (isinstance(node, _ATOMIC) or (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)))):
        text = f"({text})"
    edits.append(code.replace(node, f"{text} * {factor}"))
    how = "the square root of the world size" if ev.get("suggested_scaling") == "sqrt" else "the world size"
    return Patch(rule=CODE, line=finding.line, edits=tuple(edits), summary=f"scale the lr by {how}")
