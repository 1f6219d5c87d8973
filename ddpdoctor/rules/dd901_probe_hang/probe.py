"""DD901 probe-hang: ranks stopped making progress until the probe's timeout.

What it does: when the probe's timeout ended the run, decides for every rank that had not finished whether it had
stalled or was still working (outcome.timeout_view). A rank that recorded events within its own pace before the
timeout (three typical steps, at least 5 s or a fifth of a shorter timeout) was still making progress; one silent
for longer whose main thread sat in a call that waits for the other ranks (a collective, DDP's buffer broadcast, or
DDP's backward once a step has been timed) had stalled. Only stalls are findings: for each stalled rank, where its
main thread was blocked (the innermost frame and the user's file:line that called it), how long it had been silent,
and its last recorded event; ranks that had finished and were waiting for their peers, ranks still running and
ranks busy elsewhere are named as such. When every rank that had finished was ended by the probe's own
--epochs/--steps limit (not by the script) and none was still running, the stall is medium/possible and says so: in
the script's own run those ranks go on to their next step, whose first collective may pair with the one the stalled
ranks wait in (a rank-0-only evaluation forward through DDP). A slow run that ran out of time is not a hang: it
gets a note with the steps observed and the --timeout or --steps that would cover the run, and every analysis still
runs on what was recorded. So is a run slow to start: ranks waiting in the rendezvous for a peer still starting
(outcome._peers_still_starting), or no rank started when the timeout hit. In attach mode (no timeout of ours), a
stall-watchdog dump (no optimizer step for --stall-timeout) is the stall. Stacks come from faulthandler dumps the
launcher requested before stopping the run.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ddpdoctor.analyses.context import RunContext, fmt_num, fmt_ranks
from ddpdoctor.analyses.outcome import RankAtTimeout, TimeoutView, ended_by_probe_limit, main_stack, timeout_view
from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.records import LaunchMode
from ddpdoctor.rules.dd901_probe_hang import CODE

RUN_FIRST = True  # how the run ended: analysed first, so its notes lead the report


def _frame_text(ctx: RunContext, frame: dict[str, Any] | None) -> str:
    if not frame:
        return "?"
    return f"{frame['function']} ({os.path.basename(frame['file'])}:{frame['line']})"


def analyze(ctx: RunContext) -> list[Finding]:
    view = timeout_view(ctx)
    if view is not None:
        return _after_timeout(ctx, view)
    attach_stall = ctx.mode is LaunchMode.ATTACH and any(
        p.stack_text and p.done is None for p in ctx.ranks.values()
    )
    if not attach_stall:
        return []
    ended = max((p.events[-1]["t"] for p in ctx.run.processes if p.events), default=0.0)
    stuck = [_stuck_entry(ctx, rank, p, float(ended)) for rank, p in ctx.ranks.items() if p.done is None]
    waiting = [rank for rank, p in ctx.ranks.items() if p.done is not None]
    return [_stall_finding(ctx, stuck, waiting, timeout=None)]


def _stuck_entry(ctx: RunContext, rank: int, p: Any, at: float, r: RankAtTimeout | None = None) -> dict[str, Any]:
    last = p.events[-1] if p.events else {}
    view = r.view if r is not None else main_stack(ctx, p)
    collectives = p.of("collective")
    entry = {
        "rank": rank,
        "pid": p.pid,
        "silent_seconds": r.silent if r is not None else round(at - float(last.get("t", at)), 3),
        "last_event": {k: last.get(k) for k in ("kind", "t", "step") if k in last},
        "steps": len(p.of("optimizer_step")),
        "blocked_in": view.blocked_in if view else None,
        "user_frame": view.user_frame if view else None,
        "stack": [f"{f['file']}:{f['line']} in {f['function']}" for f in (view.frames[:15] if view else [])],
        "last_collective": {k: collectives[-1].get(k) for k in ("op", "site", "call")} if collectives else None,
    }
    if r is not None:
        entry.update(state=r.state, waiting_in=r.waiting_in, allowance_seconds=r.allowance)
    return entry


def _after_timeout(ctx: RunContext, view: TimeoutView) -> list[Finding]:
    if not view.ranks:
        # no rank had recorded anything: they were still starting (interpreter, site hooks, imports — minutes on a
        # loaded machine); data loading, input() and the rendezvous all come later and leave events and stacks
        ctx.notes.append(
            f"the probe's {fmt_num(view.timeout)} s timeout ended the run before any rank had started the script "
            "(interpreter start-up and imports took longer than that on this machine) — not a hang: 0 optimizer "
            "steps observed, so nothing that needs the run was measured; rerun with a longer --timeout"
        )
        return []
    if view.out_of_time:
        ctx.notes.append(out_of_time_note(ctx, view))
        return []
    stalled = view.stalled
    if not stalled:
        return []  # every rank had finished
    stuck = [_stuck_entry(ctx, r.rank, ctx.ranks[r.rank], view.at, r) for r in stalled]
    waiting = [r.rank for r in view.having("finished")]
    return [_stall_finding(ctx, stuck, waiting, timeout=view.timeout, view=view)]


def _stall_finding(
    ctx: RunContext,
    stuck: list[dict[str, Any]],
    waiting: list[int],
    *,
    timeout: float | None,
    view: TimeoutView | None = None,
) -> Finding:
    parts = []
    for s in stuck:
        where = f" called at {ctx.at(s['user_frame'])}" if s["user_frame"] else ""
        if s["blocked_in"]:
            blocked = f"blocked in {_frame_text(ctx, s['blocked_in'])}{where}"
        else:
            blocked = f"silent after its last event ({s['last_event'].get('kind')})"
        parts.append(f"rank {s['rank']} {blocked}")
    silent = min(s["silent_seconds"] for s in stuck)
    until = f"until the {fmt_num(timeout)} s timeout" if timeout is not None else "until the stall watchdog fired"
    message = (
        f"{fmt_ranks([s['rank'] for s in stuck])} made no progress for {fmt_num(round(silent, 1))} s {until}: "
        + "; ".join(parts)
    )
    confidence = Confidence.CERTAIN
    running = view.having("running") if view is not None else []
    busy = view.having("busy") if view is not None else []
    if running:
        message += (
            f", while {fmt_ranks([r.rank for r in running])} kept making progress (last event "
            f"{fmt_num(round(min(r.silent for r in running), 1))} s before the timeout, "
            f"{'/'.join(str(r.steps) for r in running)} optimizer steps)"
        )
    if busy:
        # the stalled ranks wait for a rank that is working, not blocked: it may never finish, or need more time
        confidence = Confidence.LIKELY
        where = "; ".join(
            f"rank {r.rank} at {ctx.at(r.view.user_frame)} in {_frame_text(ctx, r.view.blocked_in)}"
            for r in busy if r.view is not None
        )
        message += (
            f", waiting for {fmt_ranks([r.rank for r in busy])}, busy outside any collective for "
            f"{fmt_num(round(min(r.silent for r in busy), 1))} s ({where}): either that work never ends, or it "
            "needs more than the timeout"
        )
    severity = None
    if waiting and not running and not busy and ended_by_probe_limit(ctx, waiting):
        # the peers did not finish: the probe's limit ended them before their next step, whose first collective
        # the script would have run and that may be the partner of the one the stalled ranks wait in
        verb = "was" if len(waiting) == 1 else "were"
        message += (
            f" ({fmt_ranks(waiting)} {verb} ended by the probe's --epochs/--steps limit, not by the script, and "
            "waited for the others: in the script's own run they go on to their next step, whose first collective "
            "may pair with this one, so this run does not show the script hanging; rerun with a larger --epochs "
            "or --steps to see past it)"
        )
        confidence, severity = Confidence.POSSIBLE, Severity.MEDIUM
    elif waiting:
        verb = "was" if len(waiting) == 1 else "were"
        message += f" ({fmt_ranks(waiting)} had finished and {verb} waiting for the others)"
    first_user = next((s["user_frame"] for s in stuck if s["user_frame"]), None)
    evidence: dict[str, Any] = {"timeout": timeout, "stuck": stuck, "waiting_for_peers": waiting,
                                **({"peers_ended_by_probe_limit": True} if severity is not None else {})}
    if view is not None:
        evidence.update(
            still_running=[{"rank": r.rank, "silent_seconds": r.silent, "steps": r.steps} for r in running],
            busy=[_stuck_entry(ctx, r.rank, ctx.ranks[r.rank], view.at, r) for r in busy],
            seconds_per_step=None if view.pace is None else round(view.pace, 3),
        )
    return ctx.finding(
        CODE,
        message=message,
        fix_variant=fix_for(stuck),
        confidence=confidence,
        severity=severity,
        site=first_user,
        ranks=[s["rank"] for s in stuck],
        evidence=evidence,
        magnitude=silent,
    )


def fix_for(stuck: list[dict[str, Any]]) -> str:
    """The fix that fits the call the stalled ranks were waiting in: a rendezvous that never completed is not a
    collective-order problem, nor is an unmatched send/recv, nor a backward some ranks never reached."""
    kinds = [(s.get("waiting_in") or {}).get("kind") for s in stuck]
    if "rendezvous" in kinds or any((s.get("last_event") or {}).get("kind") == "pg_init_begin" for s in stuck):
        return "rendezvous"
    if "point_to_point" in kinds:
        return "point_to_point"
    if "backward" in kinds and "collective" not in kinds:
        return "backward"
    return "probe"


def out_of_time_note(ctx: RunContext, view: TimeoutView) -> str:
    """The run was still making progress when the timeout hit: what was observed, and what would cover the run."""
    unfinished = [r for r in view.ranks.values() if r.state != "finished"]
    steps = sorted({r.steps for r in view.ranks.values()})
    steps_text = (
        f"{steps[0]} optimizer step{'s' if steps[0] != 1 else ''} per rank" if len(steps) == 1
        else "/".join(str(view.ranks[k].steps) for k in sorted(view.ranks)) + " optimizer steps on "
        + fmt_ranks(view.ranks)
    )
    running = [r for r in unfinished if r.state == "running"]
    parts = [
        f"the probe's {fmt_num(view.timeout)} s timeout ended the run while "
        f"{fmt_ranks([r.rank for r in unfinished])} {'was' if len(unfinished) == 1 else 'were'} still "
        + ("making progress" if running else "working")
        + f" — not a hang: {steps_text} observed"
    ]
    last_steps = [r.last_step_t for r in unfinished if r.last_step_t is not None]
    if last_steps:
        before = round(view.at - max(last_steps), 1)
        # a step can land while the launcher collects the stacks, just after the deadline
        parts[-1] += f", the last {fmt_num(before)} s before the timeout" if before > 0 else ", the last just as it hit"
    if view.pace is not None:
        parts[-1] += f", about {fmt_num(round(view.pace, 1))} s per step"
    busy = [r for r in unfinished if r.state == "busy" and r.view is not None]
    for r in busy:
        parts.append(
            f"rank {r.rank} had been busy for {fmt_num(round(r.silent, 1))} s at {ctx.at(r.view.user_frame)} "
            f"(in {_frame_text(ctx, r.view.blocked_in)}), not waiting for the other ranks"
        )
    parts.append("the findings cover what was recorded until then")
    advice = _advice(ctx, view)
    if advice:
        parts.append(advice)
    return "; ".join(parts)


def _advice(ctx: RunContext, view: TimeoutView) -> str:
    meta = ctx.run.meta
    epochs, per_epoch = int(meta.epochs or 0), int(meta.steps or 0)
    if not epochs or not per_epoch or view.pace is None or view.launched is None:
        return "rerun with a longer --timeout to observe more"
    firsts = [float(p.of("optimizer_step")[0]["t"]) for p in ctx.ranks.values() if p.of("optimizer_step")]
    if not firsts:
        return "rerun with a longer --timeout to observe more"
    startup = max(firsts) - view.launched + view.startup_offset  # launch, imports, set-up and the first step
    wanted = epochs * per_epoch
    needed = startup + (wanted - 1) * view.pace
    timeout = int(math.ceil((needed * 1.25 + 10) / 10.0) * 10)
    plural = "s" if epochs != 1 else ""
    text = f"to observe all {epochs} epoch{plural} × {per_epoch} steps, rerun with --timeout {timeout}"
    fits = int((view.timeout * 0.8 - startup) // view.pace) + 1  # steps that fit in this timeout at this pace
    if 1 <= fits // epochs < per_epoch:
        text += f" (or keep this timeout with --steps {fits // epochs})"
    return text

