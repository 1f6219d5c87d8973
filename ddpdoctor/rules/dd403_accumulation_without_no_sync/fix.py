"""DD403's fix: the forward and backward of an accumulation step run under `model.no_sync()` except on the step
that updates (`with contextlib.nullcontext() if <the step's condition> else model.no_sync():`). DDP decides in the
forward whether the backward all-reduces, so the forward goes inside too."""

from __future__ import annotations

import ast

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch

CODE = "DD403"
MEASURE = "allreduces_per_step"


def _calls_name(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(node))


def _stored(nodes: list[ast.stmt]) -> set[str]:
    return {n.id for s in nodes for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _loaded(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    wrapper = ev.get("wrapper")
    if not isinstance(wrapper, str) or not wrapper.isidentifier():
        raise NoFix("the DDP model has no plain name")
    backward = code.statement(next(iter(code.calls(ev.get("backward_line"), "backward")), None) or _none())
    block = getattr(code.parent(backward), "body", None)
    if not isinstance(block, list) or backward not in block:
        raise NoFix("the backward is not a statement of a loop body")
    i = block.index(backward)
    first = next((k for k in range(i + 1) if _calls_name(block[k], wrapper)), None)
    if first is None:
        raise NoFix(f"the forward through `{wrapper}` is not in the backward's block")
    wrapped = block[first: i + 1]
    gate = ev.get("gate")
    if gate is None:  # the backward runs in an inner `for k in range(n)` loop and the step follows that loop
        loop = code.parent(backward)
        if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and isinstance(loop.iter, ast.Call)
                and getattr(loop.iter.func, "id", None) == "range" and len(loop.iter.args) == 1):
            raise NoFix("no condition tells the updating step from the accumulation steps")
        test = f"{loop.target.id} == {code.segment(loop.iter.args[0])} - 1"
    else:
        after = block[i + 1:]
        branch = next((s for s in after if isinstance(s, ast.If) and code.segment(s.test) == gate), None)
        if branch is None:
            raise NoFix("the optimizer step is not under a condition in the same block")
        test_node = branch.test
        stored = _stored(wrapped)
        if isinstance(test_node, ast.Name) and test_node.id in stored:  # `last = cond` between forward and backward
            assigns = [s for s in wrapped if isinstance(s, ast.Assign) and len(s.targets) == 1
                       and isinstance(s.targets[0], ast.Name) and s.targets[0].id == test_node.id]
            if len(assigns) != 1 or _loaded(assigns[0].value) & stored:
                raise NoFix(f"`{test_node.id}` is computed from the step itself")
            test_node = assigns[0].value
        elif _loaded(test_node) & stored:
            raise NoFix("the step's condition is computed during the forward")
        if _stored(block[i + 1: block.index(branch)]) & _loaded(test_node):
            raise NoFix("the step's condition changes between the backward and the step")
        test = code.segment(test_node)
    ctx, edits = code.imported_as("contextlib", "import contextlib", "contextlib")
    edits.append(code.insert_lines_before(wrapped[0].lineno,
                                          [f"with {ctx}.nullcontext() if {test} else {wrapper}.no_sync():"]))
    edits += code.indent_lines(wrapped[0].lineno, wrapped[-1].end_lineno)
    return Patch(rule=CODE, line=finding.line, edits=tuple(edits),
                 summary=f"accumulation steps under {wrapper}.no_sync() (all-reduce only when {test})")


def _none() -> ast.AST:
    raise NoFix("no backward call on the finding's line")
