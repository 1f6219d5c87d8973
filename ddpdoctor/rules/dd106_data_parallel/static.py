"""DD106 data-parallel: `nn.DataParallel` used for multi-GPU training.

What it flags: every `nn.DataParallel(...)` wrap. DataParallel is one process driving several GPUs: BatchNorm
normalises each replica's slice and only replica 0's running statistics survive, and it cannot use SyncBN.

What stays silent: nothing is silent, but a DataParallel that sits on the non-distributed path of a script that
also builds DDP (`if args.distributed: DDP(...) else: DataParallel(...)`, as in the ImageNet example) is reported
at low severity and possible confidence: it only matters when the script is launched without distributed mode.
The paths are told apart by the test itself, or by its text when the wrap sits in a helper called once per network
(`if self.opt['dist']: DDP(net) else: DataParallel(net)`, also under another test such as a loss weight).
"""

from __future__ import annotations

import re
from typing import Iterator

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.plain import LazyPattern
from ddpdoctor.rules.dd106_data_parallel import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached

_DISTRIBUTED_WORDS = LazyPattern(r"distributed|ddp|world|rank|nproc", re.I)


def check(script: ScriptModel) -> Iterator[Finding]:
    has_ddp = bool(script.ddp_wraps)
    for ev in script.of("wrap"):
        if ev.data["wrapper_kind"] != "dp":
            continue
        wrapped = script.text(ev.data["args"].node(0, "module"))
        conds = (
            [c for c in ev.ctx if c.kind == "cond" and c.frame == ev.frame] or [c for c in ev.ctx if c.kind == "cond"]
        )
        branch = next((c for c in conds if _DISTRIBUTED_WORDS.search(str(c.info))), None) or next(
            (c for c in reversed(conds) if any(script.on_other_side(w, ev) for w in script.ddp_wraps)),
            conds[-1] if conds else None,
        )
        other_path = (
            all(script.on_other_side(w, ev) for w in script.ddp_wraps)
            or _DISTRIBUTED_WORDS.search(str(branch.info if branch else ""))
        )
        if has_ddp and branch is not None and other_path:
            yield script.finding(
                CODE,
                line=ev,
                message=f"nn.DataParallel wraps `{wrapped}` at line {ev.line} on the path where `{branch.info}` "
                f"(the script uses DDP otherwise); launched that way, BatchNorm keeps only replica 0's statistics",
                confidence=Confidence.POSSIBLE,
                evidence={"line": ev.line, "branch": branch.info, "ddp_lines": [w.line for w in script.ddp_wraps]},
                severity=Severity.LOW,
            )
            continue
        confidence = Confidence.LIKELY if ev.data.get("heuristic") else Confidence.CERTAIN
        yield script.finding(
            CODE,
            line=ev,
            message=f"nn.DataParallel wraps `{wrapped}` at line {ev.line}: one process splits each batch over the "
            f"GPUs, so BatchNorm normalises per-GPU slices and keeps only replica 0's running statistics",
            confidence=cap_unreached(confidence, ev),
            evidence={"line": ev.line, "wrapped": wrapped, "also_uses_ddp": has_ddp},
        )
