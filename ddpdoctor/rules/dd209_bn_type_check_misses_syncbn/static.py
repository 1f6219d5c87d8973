"""DD209 bn-type-check-misses-syncbn: code that picks BatchNorm layers by a class SyncBatchNorm is not.

What it flags, in a script that converts to SyncBatchNorm or builds it: `type(m) is nn.BatchNorm2d` (also `==`,
`in (...)`, `m.__class__ is ...`), `isinstance(m, nn.BatchNorm2d)` or a tuple of BatchNorm1d/2d/3d (names bound
to such a tuple at module level included), and class-name tests against "BatchNorm1d/2d/3d"
(`type(m).__name__ == "BatchNorm2d"`). After conversion none of them matches: SyncBatchNorm derives from
`_BatchNorm`, not from the BatchNorm*d classes.

What stays silent: tests that also accept SyncBatchNorm or test `_BatchNorm` / `_NormBase` (what a converted layer
is), substring tests (`"BatchNorm" in type(m).__name__`, which SyncBatchNorm passes), tests inside a converter (a
function that builds SyncBatchNorm: it runs on the plain layers), tests earlier in the same function as the
conversion (they run on the plain layers: YOLOv7's optimizer groups), and scripts without SyncBN.

Confidence: likely — the test may be applied to a model that is never converted (a teacher, an EMA copy);
`ddpdoctor triage` measures whether it changed anything.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd209_bn_type_check_misses_syncbn import CODE
from ddpdoctor.static.engine.support import SourceIndex, walk
from ddpdoctor.static.model import ScriptModel

EXACT = {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d"}
COVERS_SYNCBN = {"SyncBatchNorm", "_BatchNorm", "_NormBase"}


def _class_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _classes(node: ast.AST, constants: dict[str, ast.AST], depth: int = 0) -> list[str] | None:
    """The class names a class expression or tuple of them names; None when it is something else."""
    if depth > 3:
        return None
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        out: list[str] = []
        for elt in node.elts:
            names = _classes(elt, constants, depth + 1)
            if names is None:
                return None
            out.extend(names)
        return out
    name = _class_name(node)
    if isinstance(node, ast.Name) and name in constants:
        return _classes(constants[name], constants, depth + 1)
    return [name] if name else None


def _misses_syncbn(names: list[str] | None) -> bool:
    return bool(names) and any(n in EXACT for n in names) and not any(n in COVERS_SYNCBN for n in names)


def _type_of(node: ast.AST) -> bool:
    """`type(x)` or `x.__class__`."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"
            and len(node.args) == 1) or (isinstance(node, ast.Attribute) and node.attr == "__class__")


def _name_of_type(node: ast.AST) -> bool:
    """`type(x).__name__` or `x.__class__.__name__`."""
    return isinstance(node, ast.Attribute) and node.attr == "__name__" and _type_of(node.value)


def _strings(node: ast.AST) -> list[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        out = []
        for elt in node.elts:
            if not (isinstance(elt, ast.Constant) and isinstance(elt.value, str)):
                return None
            out.append(elt.value)
        return out
    return None


def _converters(index: SourceIndex) -> set[int]:
    """ids of the nodes inside functions that build SyncBatchNorm (converters select the plain layers)."""
    inside: set[int] = set()
    if "SyncBatchNorm" not in index.called_names:
        return inside  # no function of the file builds one
    for fn in index.functions:
        nodes = walk(fn)
        if any(isinstance(n, ast.Call) and _class_name(n.func) == "SyncBatchNorm" for n in nodes):
            inside |= {id(n) for n in nodes}
    return inside


def exact_class_tests(tree: ast.Module, index: SourceIndex) -> Iterator[tuple[int, str]]:
    """(line, source form) of every BatchNorm test by exact class in the module (`index` is its tree's),
    outside converters."""
    if not ("isinstance" in index.called_names or "type" in index.called_names or "__class__" in index.words):
        return  # every test below calls isinstance() or type(), or reads __class__
    constants = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name)}
    skip = _converters(index)
    for node in index.nodes:
        t = type(node)
        if t is not ast.Call and t is not ast.Compare:
            continue  # the tests below look at calls and comparisons only
        if id(node) in skip:
            continue
        if t is ast.Call and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2 and _misses_syncbn(_classes(node.args[1], constants)):
            yield node.lineno, "isinstance"
        elif t is ast.Compare and len(node.ops) == 1:
            left, op, right = node.left, node.ops[0], node.comparators[0]
            if not isinstance(op, (ast.Is, ast.Eq, ast.In, ast.IsNot, ast.NotEq, ast.NotIn)):
                continue
            if _type_of(left) and _misses_syncbn(_classes(right, constants)):
                yield node.lineno, "type"
            elif _name_of_type(left):
                names = _strings(right)
                if names and any(n in EXACT for n in names) and "SyncBatchNorm" not in names:
                    yield node.lineno, "class name"


def _innermost_function(index: SourceIndex, line: int) -> ast.AST | None:
    """The innermost function of the file whose lines hold `line` (None: the module body)."""
    best = None
    for fn in index.functions:
        if fn.lineno <= line <= (fn.end_lineno or fn.lineno) and (best is None or fn.lineno > best.lineno):
            best = fn
    return best


def _runs_before_conversion(index: SourceIndex, lineno: int, conversions: list[int]) -> bool:
    """A test earlier in the same function body as a conversion runs on the plain layers, before it (YOLOv7
    groups BatchNorm weights for its optimizer, then converts: torch's converter keeps those Parameters)."""
    here = _innermost_function(index, lineno)
    return any(lineno < line and _innermost_function(index, line) is here for line in conversions)


def check(script: ScriptModel) -> Iterator[Finding]:
    if not (script.of("convert_syncbn") or script.of("syncbn_layer")):
        return
    line = (script.of("convert_syncbn") or script.of("syncbn_layer"))[0].line
    conversions = [ev.line for ev in script.of("convert_syncbn") if ev.file == script.filename]
    seen: set[int] = set()
    for lineno, how in exact_class_tests(script.tree, script.index):
        if lineno in seen or _runs_before_conversion(script.index, lineno, conversions):
            continue
        seen.add(lineno)
        text = script.lines[lineno - 1].strip()
        yield script.finding(
            CODE,
            line=lineno,
            message=f"`{text[:80]}` selects BatchNorm layers by exact class ({how}), but the model is made "
            f"SyncBatchNorm at line {line}, which is not a BatchNorm1d/2d/3d: after the conversion this code skips "
            "every layer",
            confidence=Confidence.LIKELY,
            evidence={"line": lineno, "test": how, "syncbn_line": line},
        )
