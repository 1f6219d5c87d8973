"""DD902 rank-failed: a rank raised or died.

What it does: reports the first failure of the run (elastic's "root cause"): the exception with its traceback,
or the signal / exit code with the telling line of the rank's stderr. Ranks that failed only because a peer went
away (closed connection, terminated by the launcher) are listed in the evidence, not blamed.
A rank that recorded `done` and died in interpreter teardown is not a failure.
"""

from __future__ import annotations

from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.analyses.outcome import LAUNCHERS, Failure, crash_text, failures, root_causes
from ddpdoctor.errors import EMULATED_ORDINAL_RE, EMULATION_FAILED, EMULATION_LIMIT_RE
from ddpdoctor.findings import Finding, Severity
from ddpdoctor.rules.dd902_rank_failed import CODE

RUN_FIRST = True  # how the run ended: analysed first, so its notes lead the report


def _describe(f: Failure) -> str:
    if f.kind == "launcher":
        if f.signal:
            why = " (the kernel's OOM killer, the script or another process sent it)" if f.signal == "SIGKILL" else ""
            return f"{LAUNCHERS.get(f.type or '', 'the launcher')} died with {f.signal}{why}"
        return f"{LAUNCHERS.get(f.type or '', 'the launcher')} failed: {f.message[:300]}"
    if f.kind == "exception":
        first = f.message.splitlines()[0] if f.message else ""
        if f.type == "SystemExit":
            said = crash_text(f.stderr_tail)
            return f"exited with sys.exit({f.exitcode})" + (f" ({said})" if said else "")
        return f"raised {f.type}: {first[:300]}" if first else f"raised {f.type}"
    if f.signal:
        return f"died with {f.signal}" + (f" ({f.message})" if f.message else "")
    return f"exited with code {f.exitcode}" + (f" ({f.message})" if f.message else "")


def analyze(ctx: RunContext) -> list[Finding]:
    if ctx.timed_out:
        return []
    fails = failures(ctx)
    roots = root_causes(fails)
    if not roots:
        return []
    first = roots[0]
    ranks = [f.rank for f in roots if f.rank is not None]
    who = fmt_ranks(ranks) if ranks else ("" if first.kind == "launcher" else "the script")
    where = f" at {ctx.at(first.user_frame)}" if first.user_frame else ""
    steps = ctx.steps_of(first.rank) if first.rank is not None else 0
    when = f" after {steps} optimizer step{'s' if steps != 1 else ''}" if first.rank is not None else ""
    others = [f for f in fails if f not in roots and not f.derived]
    tail = ""
    if others:
        tail = f"; {fmt_ranks([f.rank for f in others if f.rank is not None])} then failed as a consequence"
    elif len(ctx.ranks) > len(ranks):
        tail = "; the other ranks were stopped"
    if first.kind == "launcher":
        unfinished = [r for r, p in ctx.ranks.items() if p.done is None]
        steps_seen = sorted({ctx.steps_of(r) for r in ctx.ranks}) or [0]
        tail = (
            f"; {fmt_ranks(unfinished)} had not finished ({'/'.join(map(str, steps_seen))} optimizer steps "
            "recorded) and were stopped with it" if unfinished else ""
        )
    message = f"{who} {_describe(first)}{where}{when}{tail}".strip()
    said = (first.message + "\n".join(first.stderr_tail)).lower()
    # gloo names it (recent torch), or, older (torch 2.4), enforces that a message is no longer than expected
    if "collective mismatch" in said or "op.preamble.length <= op.nbytes" in said:
        message += (" — a collective mismatch: the ranks called different collectives (one inside a rank-dependent "
                    "branch?)")
    p = ctx.ranks.get(first.rank) if first.rank is not None else None
    last = p.events[-1] if p is not None and p.events else None
    evidence = {
        "root_cause": {
            "rank": first.rank,
            "pid": first.pid,
            "kind": first.kind,
            "type": first.type,
            "message": first.message[:4000],
            "traceback": first.traceback.splitlines()[-40:],
            "user_frame": first.user_frame,
            "exitcode": first.exitcode,
            "signal": first.signal,
            "steps": steps,
        },
        "failures": [
            {
                "rank": f.rank,
                "kind": f.kind,
                "what": _describe(f)[:300],
                "peer_caused": f.peer_caused,
                "root_cause": f in roots,
                "t": round(f.t, 3),
            }
            for f in fails
        ],
        "stderr_tail": first.stderr_tail[-20:],
        "last_event": {"kind": last.get("kind"), "t": last.get("t")} if last else None,
    }
    variant = {"exception": "exception", "launcher": "launcher"}.get(first.kind, "native_crash")
    fix_args = None
    severity = None
    beyond = EMULATED_ORDINAL_RE.search(first.message)
    if beyond is not None:
        # not the script's error: it addresses more GPUs than the emulation gave this run (one per rank)
        needed = int(beyond.group(1)) + 1
        message += (
            f" — the script addresses cuda:{beyond.group(1)}, and this CPU run emulated {beyond.group(2)} CUDA "
            f"devices (one per rank): the script expects at least {needed} GPUs, which the machine it is written for "
            "has; nothing after this line was measured"
        )
        variant, fix_args, severity = "emulated_devices", {"needed": needed}, Severity.HIGH
        evidence["emulated_devices"] = int(beyond.group(2))
    limit = EMULATION_LIMIT_RE.search(first.message) if beyond is None else None
    ready = [e for _, e in ctx.run.events("torch_ready")]
    not_installed = next((e["emulation_error"] for e in ready if e.get("emulation_error")), None)
    if limit is not None and (not_installed or any(e.get("cuda_emulated") for e in ready)):
        # not the script's error either: a CUDA call the CPU emulation does not reproduce, or, where the
        # emulation could not be installed on this torch, any CUDA call
        error = str(not_installed).removeprefix(EMULATION_FAILED)
        what = (f"ddpdoctor's CUDA emulation could not be installed on this torch ({error})"
                if not_installed else "a limit of ddpdoctor's CUDA emulation on this CPU machine")
        message += (
            f" — {what}, not a bug of the script: the call raised \"{limit.group(0)}\" because no GPU is here, "
            "and on the GPUs the script is written for it runs; nothing after this line was measured"
        )
        variant, severity = "emulation_limit", Severity.HIGH
        evidence["emulation_limit"] = limit.group(0)
    return [
        ctx.finding(
            CODE,
            message=message,
            fix_variant=variant,
            fix_args=fix_args,
            **({"severity": severity} if severity is not None else {}),
            site=first.user_frame,
            ranks=ranks,
            evidence=evidence,
            magnitude=float(len(ranks)),
        )
    ]
