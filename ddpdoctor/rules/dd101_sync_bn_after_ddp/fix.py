"""DD101's fix: move the SyncBatchNorm conversion before the DDP wrapping, converting the module DDP wraps."""

from __future__ import annotations

import ast

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch, callee_name

CODE = "DD101"
MEASURE = "converted_is_wrapper"


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    convert_call = next(iter(code.calls(ev.get("convert_line"), "convert_sync_batchnorm")), None)
    wrap_stmt = code.statement_at(ev.get("wrap_line") or 0)
    if convert_call is None:
        raise NoFix("the conversion is not a plain convert_sync_batchnorm call")
    convert = code.statement(convert_call)
    if code.parent(convert) is not code.parent(wrap_stmt) or convert.lineno <= wrap_stmt.lineno:
        raise NoFix("the conversion and the wrapping are not in the same block")
    wrap_call = wrap_stmt.value if isinstance(wrap_stmt, ast.Assign) else None
    if not (isinstance(convert, ast.Assign) and len(convert.targets) == 1 and isinstance(convert.targets[0], ast.Name)
            and isinstance(wrap_call, ast.Call) and wrap_call.args and isinstance(wrap_call.args[0], ast.Name)
            and len(wrap_stmt.targets) == 1 and isinstance(wrap_stmt.targets[0], ast.Name)
            and convert_call.args and isinstance(convert_call.args[0], ast.Name)):
        raise NoFix("the wrapping or the conversion is not `name = call(name, ...)`")
    target, converted = convert.targets[0].id, convert_call.args[0].id
    module, wrapper = wrap_call.args[0].id, wrap_stmt.targets[0].id
    if target == converted == module:  # `ddp = DDP(net); net = convert(net)`: the conversion moves up as it is
        line = code.segment(convert)
    elif target == converted == wrapper:  # `model = DDP(model); model = convert(model)`: convert what DDP wraps
        rest = "".join(f", {code.segment(a)}" for a in [*convert_call.args[1:], *convert_call.keywords])
        line = f"{module} = {code.segment(convert_call.func)}({module}{rest})"
    else:
        raise NoFix(f"`{target} = convert_sync_batchnorm({converted})` is neither the wrapped module nor the wrapper")
    if callee_name(convert_call) != "convert_sync_batchnorm":
        raise NoFix("the conversion is not a plain call")
    edits = (code.insert_lines_before(wrap_stmt.lineno, [line]), code.delete_statement(convert))
    return Patch(rule=CODE, line=finding.line, edits=edits,
                 summary=f"convert `{module}` to SyncBatchNorm before DDP wraps it (line {wrap_stmt.lineno})")
