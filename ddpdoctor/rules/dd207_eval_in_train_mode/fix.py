"""DD207's fix: `model.eval()` before the evaluation and `model.train()` after it, around the statement of the
evaluating function (or block) that holds the forward."""

from __future__ import annotations

import ast

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch

CODE = "DD207"
MEASURE = "train_mode_forwards"


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    model = ev.get("callee")
    if not isinstance(model, str) or not all(p.isidentifier() for p in model.split(".")):
        raise NoFix("the evaluated model has no plain name")
    line = ev.get("line") or finding.line or 0
    calls = code.calls(line)
    if not calls:
        raise NoFix("no forward call on the finding's line")
    stmt = code.statement(calls[0])
    scope = code.scope(stmt)
    # the largest block around the forward that does no training (no backward, no optimizer step)
    while isinstance(code.parent(stmt), ast.stmt) and code.parent(stmt) is not scope \
            and not _trains(code.parent(stmt)):
        stmt = code.parent(stmt)
    if any(isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom, ast.Break, ast.Continue)) for n in ast.walk(stmt)):
        raise NoFix("the evaluation leaves its block early (return/yield/break): put eval()/train() at the call site")
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        raise NoFix("no statement around the evaluation to bracket")
    edits = (code.insert_lines_before(stmt.lineno, [f"{model}.eval()"]),
             code.insert_lines_after(stmt, [f"{model}.train()"]))
    return Patch(rule=CODE, line=finding.line, edits=edits,
                 summary=f"{model}.eval() before the evaluation (line {stmt.lineno}), {model}.train() after it")


def _trains(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "attr", None) in ("backward", "step", "train")
               for n in ast.walk(node))
