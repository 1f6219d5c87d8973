"""DD105's fix: a device given as a constant (`device_ids=[0]`, `set_device(0)`) comes from LOCAL_RANK."""

from __future__ import annotations

import ast

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch

CODE = "DD105"
MEASURE = "devices"


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    if "literal_device" not in ev:
        raise NoFix("no device is bound: where the process should pick its GPU is not one place in the code")
    line = ev.get("line") or finding.line or 0
    here = [c for call in code.calls(line) for c in ast.walk(call)
            if isinstance(c, ast.Constant) and type(c.value) is int and _device_position(code, c)]
    if not here:
        raise NoFix("the constant device is not on the finding's line")
    # the same constant device elsewhere in the function (set_device(0) and device_ids=[0]) is the same defect
    literals = [c for c in ast.walk(code.scope(code.statement(here[0])))
                if isinstance(c, ast.Constant) and type(c.value) is int and _device_position(code, c)]
    value, edits = code.env_int("LOCAL_RANK")
    return Patch(rule=CODE, line=finding.line, edits=(*(code.replace(c, value) for c in literals), *edits),
                 summary="take the device from LOCAL_RANK")


def _device_position(code: Code, const: ast.Constant) -> bool:
    """The constant is a device: inside `device_ids=[...]`, `output_device=`, or set_device's argument."""
    parent = code.parent(const)
    if isinstance(parent, ast.List):
        parent = code.parent(parent)
        return isinstance(parent, ast.keyword) and parent.arg == "device_ids"
    if isinstance(parent, ast.keyword):
        return parent.arg in ("device_ids", "output_device")
    return isinstance(parent, ast.Call) and getattr(parent.func, "attr", None) == "set_device"
