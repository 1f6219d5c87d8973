"""DD108's fix: the `--local_rank` option accepts both spellings torch's launchers pass and defaults to LOCAL_RANK
(torchrun sets the environment variable and passes no option)."""

from __future__ import annotations

import ast

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch, keyword

CODE = "DD108"
MEASURE = "flags"


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    call = next(iter(code.calls(ev.get("line") or finding.line or 0, "add_argument")), None)
    if call is None:
        raise NoFix("the option is not declared on the finding's line")
    flags = [a for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    spelled = {a.value for a in flags}
    if not spelled & {"--local_rank", "--local-rank"}:
        raise NoFix("the option is not --local_rank")
    edits = []
    missing = ({"--local_rank", "--local-rank"} - spelled)
    if missing:
        edits.append(code.insert_at(*code.end(flags[-1]), f", {code.string(missing.pop())}"))
    default = keyword(call, "default")
    fallback = code.segment(default.value) if default is not None else "-1"
    alias = code.module_alias("os")
    if alias is None:
        imp = code.add_import("import os", "os")
        alias = "os"
        if imp is not None:
            edits.append(imp)
    env = f"int({alias}.environ.get({code.string('LOCAL_RANK')}, {fallback}))"
    if default is not None:
        edits.append(code.replace(default.value, env))
    else:
        edits.append(code.insert_at(*code.end(call.keywords[-1] if call.keywords else flags[-1]), f", default={env}"))
    return Patch(rule=CODE, line=finding.line, edits=tuple(edits),
                 summary="accept --local-rank and --local_rank, default to LOCAL_RANK")
