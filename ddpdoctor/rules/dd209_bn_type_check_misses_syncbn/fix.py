"""DD209's fix: the exact-class BatchNorm test also accepts SyncBatchNorm (what convert_sync_batchnorm turns the
layers into): `isinstance(m, (nn.BatchNorm2d, nn.SyncBatchNorm))`, a class-name test with "SyncBatchNorm" too."""

from __future__ import annotations

import ast

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch

CODE = "DD209"


def _is_type_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" \
        and len(node.args) == 1


def fix(finding: Finding, code: Code) -> Patch:
    line = finding.evidence.get("line") or finding.line or 0
    nn = code.module_alias("torch.nn") or ("torch.nn" if code.module_alias("torch") else None)
    if nn is None:
        raise NoFix("torch.nn is not imported under a name")
    sync = f"{nn}.SyncBatchNorm"
    for node in code.nodes((ast.Call, ast.Compare), line):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            cls = node.args[1]
            if isinstance(cls, ast.Attribute) and "BatchNorm" in cls.attr:
                return Patch(rule=CODE, line=finding.line, edits=(code.replace(cls, f"({code.segment(cls)}, {sync})"),),
                             summary=f"the isinstance test also accepts {sync}")
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.Eq)):
            left, right = node.left, node.comparators[0]
            if _is_type_call(left) and isinstance(right, ast.Attribute) and "BatchNorm" in right.attr:
                text = f"isinstance({code.segment(left.args[0])}, ({code.segment(right)}, {sync}))"
                return Patch(rule=CODE, line=finding.line, edits=(code.replace(node, text),),
                             summary=f"an isinstance test that also accepts {sync}")
            if isinstance(right, ast.Constant) and isinstance(right.value, str) and "BatchNorm" in right.value:
                q = code.quote
                text = f"{code.segment(left)} in ({code.segment(right)}, {q}SyncBatchNorm{q})"
                return Patch(rule=CODE, line=finding.line, edits=(code.replace(node, text),),
                             summary="the class-name test also accepts SyncBatchNorm")
    raise NoFix("the test names its BatchNorm classes elsewhere (a tuple defined apart)")
