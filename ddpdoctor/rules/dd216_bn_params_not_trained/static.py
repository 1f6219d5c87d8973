"""DD216 bn-params-not-trained: an optimizer built over a model's parameters before a converter that gives the
BN layers new parameters is applied to that model.

What it flags: in one function body (or at module level), `opt = torch.optim.X(model.parameters(), ...)` (any
expression mentioning `model.parameters()` / `model.named_parameters()`) followed later by a cloning conversion of
`model`: apex's `convert_syncbn_model(model)`, or a function of this file that builds SyncBatchNorm layers without
reusing the original's `weight` (a converter that copies `.data` or wraps clones in `nn.Parameter` makes new
Parameter objects). The optimizer then updates tensors the converted model no longer uses.

What stays silent: torch's `convert_sync_batchnorm` (it reuses the original Parameter objects, so an optimizer
built before it still trains the layers), conversions before the optimizer, and converters that assign
`new.weight = old.weight`.

Confidence: certain for apex's converter in the same body; likely for a converter of the file (recognised by what
its body does).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd216_bn_params_not_trained import CODE
from ddpdoctor.static.engine.support import SourceIndex, walk
from ddpdoctor.static.model import ScriptModel

APEX = "convert_syncbn_model"


def _builds_syncbn(fn: ast.FunctionDef) -> bool:
    for n in walk(fn):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "SyncBatchNorm":
                return True
    return False


def _reuses_weight(fn: ast.FunctionDef) -> bool:
    """`x.weight = y.weight` somewhere in the body (torch's and timm's way)."""
    for n in walk(fn):
        if isinstance(n, ast.Assign) and len(n.targets) == 1:
            t, v = n.targets[0], n.value
            if (isinstance(t, ast.Attribute) and t.attr == "weight" and isinstance(v, ast.Attribute)
                    and v.attr == "weight"):
                return True
    return False


def cloning_converters(index: SourceIndex) -> set[str]:
    """The file's functions that build SyncBatchNorm layers with parameters of their own."""
    if "SyncBatchNorm" not in index.called_names:
        return set()  # no function of the file builds one
    return {fn.name for fn in index.functions if isinstance(fn, ast.FunctionDef) and _builds_syncbn(fn)
            and not _reuses_weight(fn)}


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _chain(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of attributes on a name (what ast.unparse gives for it, without unparsing), else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _optimizer_over(node: ast.AST) -> set[str]:
    """Names whose .parameters()/.named_parameters() an optimizer construction takes."""
    if not isinstance(node, ast.Call):
        return set()
    f = node.func
    dotted = _chain(f)
    if dotted is None:
        dotted = ast.unparse(f)
    if not (dotted.startswith(("torch.optim.", "optim.")) or (isinstance(f, ast.Name) and f.id in (
            "SGD", "Adam", "AdamW", "RMSprop", "LARS", "LAMB", "Adagrad"))):
        return set()
    out = set()
    for n in walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in (
                "parameters", "named_parameters"):
            root = _root(n.func.value)
            if root:
                out.add(root)
    return out


def _conversion(node: ast.AST, local: set[str]) -> tuple[str, str] | None:
    """(converted name, converter) of a call `conv(name)`."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name != APEX and name not in local:
        return None
    root = _root(node.args[0])
    return (root, name) if root else None


def _bodies(tree: ast.Module, index: SourceIndex) -> Iterator[list[ast.stmt]]:
    yield tree.body
    for fn in index.functions:
        yield fn.body


def check(script: ScriptModel) -> Iterator[Finding]:
    index = script.index
    local = cloning_converters(index)
    if APEX not in index.called_names and not local & index.called_names:
        return  # a finding is at a conversion call, and nothing in the file calls a converter
    # a statement's calls are looked at once per body that holds it (a method's in the class's module body too):
    # what each call is, is worked out once
    optimizers: dict[int, set[str]] = {}
    conversions: dict[int, tuple[str, str] | None] = {}
    for body in _bodies(script.tree, index):
        optimised: dict[str, int] = {}
        for stmt in body:
            # the statement's calls in the order they run: a statement holding a whole function (`def main()` in
            # the module body) must not see a call nested in an `if` after a later, shallower one
            calls = [node for node in walk(stmt) if type(node) is ast.Call]  # both tests below look at calls only
            calls.sort(key=lambda n: (n.end_lineno or 0, n.end_col_offset or 0))
            for node in calls:
                key = id(node)
                if key not in optimizers:
                    optimizers[key] = _optimizer_over(node)
                    conversions[key] = _conversion(node, local)
                for name in optimizers[key]:
                    optimised.setdefault(name, node.lineno)
                conv = conversions[key]
                if conv is None or conv[0] not in optimised:
                    continue
                name, converter = conv
                opt_line = optimised[name]
                yield script.finding(
                    CODE,
                    line=node.lineno,
                    message=f"`{converter}({name})` at line {node.lineno} gives the BatchNorm layers new weight/bias "
                    f"tensors, but the optimizer built at line {opt_line} holds `{name}`'s parameters from before the "
                    "conversion: the converted layers' affine parameters are never updated",
                    confidence=Confidence.CERTAIN if converter == APEX else Confidence.LIKELY,
                    evidence={"optimizer_line": opt_line, "convert_line": node.lineno, "converter": converter,
                              "model": name},
                )
