"""DD901 probe-hang: ranks stopped making progress until the probe's timeout.

What it does: for every rank that had not finished when the timeout hit, shows where its main thread was blocked
(the innermost frame, usually a collective in torch.distributed, and the user's file:line that called it), how
long it had been silent, and its last recorded event; ranks that had finished and were waiting for their peers
are named as such. Stacks come from faulthandler dumps the launcher requested before stopping the run.
"""

from __future__ import annotations

import os
from typing import Any

from ddpdoctor.analyses.context import RunContext, fmt_num, fmt_ranks
from ddpdoctor.analyses.outcome import main_stack
from ddpdoctor.findings import Finding

RULE = "DD901"


def _frame_text(ctx: RunContext, frame: dict[str, Any] | None) -> str:
    if not frame:
        return "?"
    return f"{frame['function']} ({os.path.basename(frame['file'])}:{frame['line']})"


def analyze(ctx: RunContext) -> list[Finding]:
    attach_stall = ctx.run.meta.get("mode") == "attach" and any(
        p.stack_text and p.done is None for p in ctx.ranks.values()
    )
    if not ctx.timed_out and not attach_stall:
        return []
    ended = float(ctx.launcher.get("ended") or max((p.events[-1]["t"] for p in ctx.run.processes if p.events), default=0.0))
    stuck: list[dict[str, Any]] = []
    waiting: list[int] = []
    for rank, p in ctx.ranks.items():
        last = p.events[-1] if p.events else {}
        if p.done is not None:
            waiting.append(rank)
            continue
        view = main_stack(ctx, p)
        collectives = p.of("collective")
        stuck.append(
            {
                "rank": rank,
                "pid": p.pid,
                "silent_seconds": round(ended - float(last.get("t", ended)), 3),
                "last_event": {k: last.get(k) for k in ("kind", "t", "step") if k in last},
                "steps": len(p.of("optimizer_step")),
                "blocked_in": view.blocked_in if view else None,
                "user_frame": view.user_frame if view else None,
                "stack": [f"{f['file']}:{f['line']} in {f['function']}" for f in (view.frames[:15] if view else [])],
                "last_collective": {k: collectives[-1].get(k) for k in ("op", "site", "call")} if collectives else None,
            }
        )
    if not stuck and not waiting:
        message = (
            f"no rank reported progress within the {fmt_num(float(ctx.launcher.get('timeout') or 0))} s timeout "
            "(the script did not reach its training loop: slow data loading, a blocking input, or a rendezvous "
            "that never completed)"
        )
        return [ctx.finding(RULE, message=message, fix=_FIX, evidence={"timeout": ctx.launcher.get("timeout")})]
    if not stuck:
        return []
    parts = []
    for s in stuck:
        where = f" called at {ctx.at(s['user_frame'])}" if s["user_frame"] else ""
        blocked = f"blocked in {_frame_text(ctx, s['blocked_in'])}{where}" if s["blocked_in"] else f"silent after its last event ({s['last_event'].get('kind')})"
        parts.append(f"rank {s['rank']} {blocked}")
    silent = min(s["silent_seconds"] for s in stuck)
    message = (
        f"{fmt_ranks([s['rank'] for s in stuck])} made no progress for {fmt_num(round(silent, 1))} s until the "
        f"{fmt_num(float(ctx.launcher.get('timeout') or 0))} s timeout: " + "; ".join(parts)
    )
    if waiting:
        message += f" ({fmt_ranks(waiting)} had finished and {'was' if len(waiting) == 1 else 'were'} waiting for the others)"
    first_user = next((s["user_frame"] for s in stuck if s["user_frame"]), None)
    evidence = {"timeout": ctx.launcher.get("timeout"), "stuck": stuck, "waiting_for_peers": waiting}
    return [
        ctx.finding(
            RULE,
            message=message,
            fix=_FIX,
            site=first_user,
            ranks=[s["rank"] for s in stuck],
            evidence=evidence,
            magnitude=silent,
        )
    ]


_FIX = (
    "Make every rank call the same collectives in the same order (no collective or DDP forward inside a "
    "rank-dependent branch); the blocked frames are in evidence."
)
