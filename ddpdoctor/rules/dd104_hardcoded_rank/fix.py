"""DD104's fix: the rank (or world size) init_process_group was given as a constant comes from the launcher."""

from __future__ import annotations

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch, keyword

CODE = "DD104"
MEASURE = "literal_rank"


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    call = next(iter(code.calls(ev.get("init_line"), "init_process_group")), None)
    if call is None:
        raise NoFix("init_process_group is not called on the finding's line")
    which = [(arg, var) for key, arg, var in (("literal_rank", "rank", "RANK"),
                                              ("literal_world_size", "world_size", "WORLD_SIZE")) if key in ev]
    if not which:
        raise NoFix("the rank comes from a computation, not a constant")
    edits = []
    for arg, var in which:
        kw = keyword(call, arg)
        if kw is None:
            raise NoFix(f"{arg} is not passed by keyword")
        value, imports = code.env_int(var)
        edits += [code.replace(kw.value, value), *imports]
    names = " and ".join(arg for arg, _ in which)
    return Patch(rule=CODE, line=finding.line, edits=tuple(edits),
                 summary=f"take {names} from the launcher's environment")
