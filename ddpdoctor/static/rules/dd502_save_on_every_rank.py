"""DD502 save-on-every-rank: `torch.save` reached by every process.

What it flags (low): a `torch.save` in a distributed script that no rank condition guards: every rank writes the
same file at the same time (wasted I/O, torn files on shared filesystems).

What stays silent: saves inside `if rank == 0`, `if is_main_process()`, `if args.local_rank in [-1, 0]`,
after `if rank != 0: return`, in a `save_on_master()`-style helper that checks the rank, in `@rank_zero_only`
functions; per-rank files (a path built from the rank).

Confidence: certain when the save is unconditional; likely when it sits under conditions that do not depend on
the rank.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import PER_RANK_TAGS

CODE = "DD502"


def check(script: ScriptModel) -> Iterator[Finding]:
    if not script.distributed:
        return
    for ev in script.of("save"):
        if ev.rank_ctx:
            continue
        path = ev.data.get("path") or ()
        if any(o.tags & (PER_RANK_TAGS | {"rank_dep"}) for o in path) or "rank" in script.text(ev.data.get("path_node")).lower():
            continue
        conditional = any(c.kind in ("cond", "try") for c in ev.ctx)
        confidence = Confidence.LIKELY if conditional else Confidence.CERTAIN
        yield script.finding(
            CODE,
            ev.line,
            f"torch.save at line {ev.line} runs on every rank (no rank check guards it), so all processes write "
            f"the same checkpoint at once",
            cap_unreached(confidence, ev),
            evidence={"save_line": ev.line, "path": script.text(ev.data.get("path_node"))},
        )
