"""DD502's fix: an unguarded save runs on rank 0 only (`if dist.get_rank() == 0:` around the statement)."""

from __future__ import annotations

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch

CODE = "DD502"
MEASURE = "writers"


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    if not ev.get("unguarded"):
        raise NoFix("the save has a guard that picks one process per node: which rank should write is a decision")
    saves = code.calls(ev.get("save_line"), "save")
    if not saves:
        raise NoFix("the save is not a plain call on the finding's line")
    stmt = code.statement(saves[0])
    if code.line_text(stmt.lineno)[: code.char_col(stmt.lineno, stmt.col_offset)].strip():
        raise NoFix("the save shares its line with other code")
    dist, edits = code.imported_as("torch.distributed", "import torch.distributed as dist", "dist")
    edits.append(code.insert_lines_before(stmt.lineno, [f"if {dist}.get_rank() == 0:"]))
    edits += code.indent_lines(stmt.lineno, stmt.end_lineno)
    return Patch(rule=CODE, line=finding.line, edits=tuple(edits), summary="save on rank 0 only")
