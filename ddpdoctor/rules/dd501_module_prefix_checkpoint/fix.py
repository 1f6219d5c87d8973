"""DD501's fix: the wrapper's state_dict() that is saved becomes the wrapped module's (`model.module.state_dict()`;
`getattr(model, "module", model)` where the model is wrapped only on some paths)."""

from __future__ import annotations

import ast

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch

CODE = "DD501"
MEASURE = "prefixed_keys"


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    wrapper = ev.get("wrapper")
    if ev.get("loaded_back_into_wrapper"):
        raise NoFix("the checkpoint is also loaded back into the wrapper: the save and the load change together")
    if not isinstance(wrapper, str) or not wrapper.isidentifier():
        raise NoFix("the wrapper has no plain name")
    wrap = code.statement_at(ev.get("wrap_line") or 0)
    scope = code.scope(wrap)
    conditional = code.enclosing(wrap, (ast.If, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef)) is not scope \
        and code.enclosing(wrap, (ast.If, ast.Try)) is not None
    saves = code.calls(ev.get("save_line"), "save")
    here = [c for c in ast.walk(saves[0]) if _wrapper_state_dict(c, wrapper)] if saves else []
    if not here:  # the state dict is built where the wrapper lives and handed to a save helper
        here = [c for c in ast.walk(scope) if _wrapper_state_dict(c, wrapper)]
    if not here or len(here) > 1:
        raise NoFix(f"not one `{wrapper}.state_dict()` to unwrap")
    receiver = here[0].func.value
    unwrapped = f"getattr({wrapper}, {code.string('module')}, {wrapper})" if conditional else f"{wrapper}.module"
    return Patch(rule=CODE, line=finding.line, edits=(code.replace(receiver, unwrapped),),
                 summary=f"save {unwrapped}.state_dict() (keys without the `module.` prefix)")


def _wrapper_state_dict(node: ast.AST, wrapper: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "state_dict"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == wrapper)
