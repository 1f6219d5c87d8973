"""DD301's fix: `sampler.set_epoch(epoch)` at the top of the epoch loop (or its constant argument replaced by the
epoch counter, or a call before the loop moved into it)."""

from __future__ import annotations

import ast

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch

CODE = "DD301"
MEASURE = "epochs_same_order"


def _sampler_name(code: Code, line: int) -> str:
    stmt = code.statement_at(line)
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        value = stmt.value
        if isinstance(value, ast.Call) and getattr(value.func, "attr", getattr(value.func, "id", "")) == "DataLoader":
            return f"{stmt.targets[0].id}.sampler"
        return stmt.targets[0].id
    raise NoFix("the sampler is not assigned to a name")


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    loop, epoch = code.epoch_loop(ev.get("loop_line") or 0, inner=False)
    sampler = _sampler_name(code, ev.get("sampler_line") or 0)
    if code.scope(loop) is not code.scope(code.statement_at(ev.get("sampler_line") or 0)):
        raise NoFix("the sampler and the epoch loop are in different functions")
    lines = ev.get("set_epoch_lines") or []
    edits = []
    for line in lines:
        call = next(iter(code.calls(line, "set_epoch")), None)
        if call is None or len(call.args) != 1:
            raise NoFix(f"set_epoch at line {line} is not a plain call")
        stmt = code.statement(call)
        if loop.lineno < line <= loop.end_lineno:  # in the loop with a constant: pass the counter
            edits.append(code.replace(call.args[0], epoch))
        elif isinstance(stmt, ast.Expr) and code.parent(stmt) is code.parent(loop) and line < loop.lineno:
            edits.append(code.delete_statement(stmt))  # before the loop: moved into it below
        else:
            raise NoFix(f"set_epoch at line {line} is neither in the epoch loop nor just before it")
    if not any(e.text == epoch for e in edits):
        edits.append(code.first_in_body(loop.body, [f"{sampler}.set_epoch({epoch})"]))
    return Patch(rule=CODE, line=finding.line, edits=tuple(edits),
                 summary=f"call {sampler}.set_epoch({epoch}) every epoch")
