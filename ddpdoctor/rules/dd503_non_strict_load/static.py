"""DD503 non-strict-load: `load_state_dict(strict=False)` whose result nobody looks at.

What it flags: `model.load_state_dict(sd, strict=False)` as a bare statement. Missing and unexpected keys are
returned, not raised; ignored, a "module."-prefixed checkpoint loads nothing at all and the model trains from
its initialisation.

What stays silent: `strict=True` (the default); `msg = model.load_state_dict(sd, strict=False)` followed by any
use of `msg` (printed, asserted, logged); a strict flag that is not a literal; a load whose function goes on to
report how many entries it loaded, `len(sd)` after the call (YOLOv5: `csd = intersect_dicts(...)`, then
"Transferred {len(csd)}/{len(model.state_dict())} items" — a checkpoint whose keys all miss shows as 0).

Confidence: likely when the same file saves checkpoints from a DDP wrapper (the keys cannot match); possible
otherwise — fine-tuning scripts drop heads on purpose.
"""

from __future__ import annotations

import ast
from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd503_non_strict_load import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached


def check(script: ScriptModel) -> Iterator[Finding]:
    from ddpdoctor.rules.dd501_module_prefix_checkpoint import static as dd501_module_prefix_checkpoint

    prefixed_saves = list(dd501_module_prefix_checkpoint.check(script))
    for ev in script.of("load_state_dict"):
        strict = ev.data.get("strict")
        if not strict or not all(o.kind == "const" and o.value is False for o in strict):
            continue
        if ev.data.get("result_used") or _count_reported(script, ev):
            continue
        into_plain = not any(t.kind == "wrapper" for t in ev.data["target"])
        confidence = Confidence.LIKELY if prefixed_saves and into_plain else Confidence.POSSIBLE
        target = script.text(getattr(getattr(ev.node, "func", None), "value", None))
        yield script.finding(
            CODE,
            line=ev,
            message=f"`{target}.load_state_dict(..., strict=False)` at line {ev.line} discards the list of missing and "
            f"unexpected keys, so weights whose names do not match (e.g. a \"module.\" prefix) stay at their "
            f"initial values without a word",
            confidence=cap_unreached(confidence, ev),
            evidence={"line": ev.line, "prefixed_checkpoint_saved_at": [f.line for f in prefixed_saves]},
        )


def _count_reported(script: ScriptModel, ev) -> bool:  # noqa: ANN001
    """`len(sd)` of the loaded dict's variable after the load, in the function that loads it."""
    node = ev.node
    arg = node.args[0] if getattr(node, "args", None) else next(
        (k.value for k in getattr(node, "keywords", ()) if k.arg == "state_dict"), None)
    source = script.sources.get(ev.file)
    if not isinstance(arg, ast.Name) or source is None:
        return False
    around = [f for f in source.index.functions if f.lineno <= ev.line <= (f.end_lineno or f.lineno)]
    scope = min(around, key=lambda f: (f.end_lineno or f.lineno) - f.lineno) if around else source.tree
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "len" and n.args
        and isinstance(n.args[0], ast.Name) and n.args[0].id == arg.id and n.lineno >= ev.line
        for n in ast.walk(scope)
    )
