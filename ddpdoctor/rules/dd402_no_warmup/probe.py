"""DD402 no-warmup: the learning rate starts at 4× or more the reference recipe's and nothing ramps it up.

What it does: reads the learning rate the optimizer used at every observed step (the lr trace of its largest
param group) and the schedulers' target (`initial_lr`). The peak is compared with the reference recipe's lr
(--base-lr); without one, with the unscaled lr of the scaling expression a static DD402 finding recorded with the
run names (`args.lr` in `args.lr * batch * world_size / 256`, its value as the ranks parsed it), or else that
static finding alone says the lr was scaled up. The finding needs the trace to show no warmup (the first step
already runs at the peak and no later observed step raises the lr) and a peak at least SCALE_THRESHOLD× the
reference. An lr that ramps, one scaled *down* (below 1x the unscaled lr already: a global batch below 256 in the
linear rule), or, against --base-lr, one whose peak stays below the threshold is measured clear: the static
suspicion is dropped with the numbers. Between 1x and the threshold without --base-lr nothing is settled: the
expression scales with the world size and the probe's few ranks are not the job's (2x at 2 ranks is 8x at 8 GPUs).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ddpdoctor.analyses.context import RunContext, fmt_num
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd402_no_warmup import CODE, RAMP, SCALE_THRESHOLD

MEASURES = Measures(
    scope="site",
    what="the lr the ranks stepped with at every observed step, against --base-lr or the unscaled lr of the "
    "scaling expression static analysis saw (evaluated with the parsed options)",
)


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def lr_trace(ctx: RunContext) -> dict[str, Any] | None:
    """The lowest rank's most-stepped optimizer: its class, site, largest group and that group's lr per step."""
    for r, p in ctx.ranks.items():
        steps = p.of("optimizer_step")
        if not steps:
            continue
        opt_id = Counter(e.get("opt") for e in steps).most_common(1)[0][0]
        init = next((e for e in p.of("optimizer_init") if e.get("opt") == opt_id), None) or {}
        groups = init.get("groups") or []
        g = max(range(len(groups)), key=lambda i: groups[i].get("numel") or 0) if groups else 0
        trace = [_number((e.get("lrs") or [None] * (g + 1))[g]) for e in steps if e.get("opt") == opt_id]
        trace = [x for x in trace if x is not None]
        initial = [
            _number((e.get("initial_lrs") or [None] * (g + 1))[g])
            for e in p.of("train_step") if e.get("opt") == opt_id
        ]
        initial = [x for x in initial if x is not None]
        if not trace:
            continue
        return {"rank": r, "cls": init.get("cls"), "site": init.get("site"), "group": g, "trace": trace,
                "initial_lr": initial[0] if initial else None,
                "constructed_lr": _number(groups[g].get("lr")) if groups else None}
    return None


def _static_scaled(ctx: RunContext) -> Finding | None:
    """The static DD402 of the check that recorded the run: where the script scales its lr with the world size."""
    return next((f for f in (ctx.run.static.findings if ctx.run.static else ()) if f.rule == CODE), None)


def parsed_option(ctx: RunContext, rank: int, dest: str) -> float | None:
    """The value `dest` had after the script parsed its command line on `rank` (the `parsed_args` event)."""
    p = ctx.ranks.get(rank)
    for e in p.of("parsed_args") if p is not None else ():
        value = _number((e.get("values") or {}).get(dest))
        if value is not None:
            return value
    return None


def unscaled(ctx: RunContext, rank: int, static: Finding | None) -> tuple[float, str] | None:
    """(value, how it is named) of the lr the static scaling expression scales, as this run had it: the option
    as parsed on the rank (its default when no parse was recorded), or the literal."""
    term = (static.evidence or {}).get("unscaled_lr") if static is not None else None
    if not isinstance(term, dict):
        return None
    text = str(term.get("text") or "lr")
    if term.get("option"):
        value = parsed_option(ctx, rank, str(term["option"]))
        if value is not None:
            return value, f"{text} ({fmt_num(value)} as parsed)"
        value = _number(term.get("default"))
        return (value, f"{text} (default {fmt_num(value)})") if value else None
    value = _number(term.get("value"))
    return (value, text) if value else None


def _measured(ctx: RunContext, opt: dict[str, Any], static: Finding | None, reason: str,
              evidence: dict[str, Any]) -> None:
    """The warmup question was measured at the optimizer and at the line static analysis flagged."""
    ctx.measured(CODE, site=opt["site"], reason=reason, evidence=evidence)
    if static is not None and static.file and static.line:
        ctx.measured(CODE, site={"file": static.file, "line": static.line}, reason=reason, evidence=evidence)


def analyze(ctx: RunContext) -> list[Finding]:
    static = _static_scaled(ctx)
    opt = lr_trace(ctx)
    if opt is None:
        if static is not None:
            ctx.not_measured(CODE, site={"file": static.file, "line": static.line},
                             reason="no optimizer step was observed, so the lr the ranks step with is unknown")
        return []
    trace = opt["trace"]
    peak = max([*trace, *(x for x in (opt["initial_lr"],) if x is not None)])
    if peak <= 0:
        return []
    ramps = any(b > a * (1 + RAMP) for a, b in zip(trace, trace[1:])) or trace[0] < peak * (1 - 1e-3)
    shown = ", ".join(fmt_num(x) for x in trace[:6]) + (", ..." if len(trace) > 6 else "")
    if ramps:
        _measured(ctx, opt, static, (
            f"the lr the ranks stepped with ramps up: {shown} over the first {len(trace)} observed steps (peak "
            f"{fmt_num(peak)}): a warmup, whatever implements it"
        ), {"lr_trace": trace[:20]})
        return []
    base = ctx.settings.base_lr
    term = None if base else unscaled(ctx, opt["rank"], static)
    if base:
        ratio = peak / base
        reference = f"{fmt_num(ratio)}× the reference recipe's lr {fmt_num(base)} (--base-lr)"
        what = f"the reference recipe's {fmt_num(base)} (--base-lr)"
    elif term is not None:
        ratio = peak / term[0]
        at = f"{ctx.path(static.file)}:{static.line}" if static else "?"
        reference = f"{fmt_num(ratio)}× the unscaled lr {term[1]} that {at} scales"
        what = f"the unscaled lr {term[1]} that {at} scales"
    elif static is not None:
        ratio = None
        reference = f"an lr scaled with the world size ({ctx.path(static.file)}:{static.line})"
    else:
        return []
    if ratio is not None and 1 <= ratio < SCALE_THRESHOLD and not base and static is not None:
        # the expression scales with the world size, and the probe's few ranks are not the job's: a 2x at 2 ranks
        # is 8x at 8 GPUs. Only a scale-down (below 1x already) or the user's own recipe (--base-lr) settles it
        ratio = None
        reference = f"an lr scaled with the world size ({ctx.path(static.file)}:{static.line})"
    if ratio is not None and ratio < SCALE_THRESHOLD:
        if ratio < 1:
            why = (f"the lr is scaled down, not up: the ranks stepped with lr {fmt_num(peak)} at most, "
                   f"{fmt_num(ratio)}× {what} on {len(ctx.ranks)} ranks, and a scale-down needs no warmup")
        else:
            why = (f"the peak lr {fmt_num(peak)} is {fmt_num(ratio)}× {what}: below the "
                   f"{fmt_num(SCALE_THRESHOLD)}× at which a warmup matters")
        _measured(ctx, opt, static, why, {"peak_lr": peak, "ratio": ratio, "lr_trace": trace[:20]})
        return []
    steps = len(trace)
    shape = "stays there" if all(abs(x - trace[0]) <= abs(trace[0]) * RAMP for x in trace) else "only decays"
    message = (
        f"{opt['cls']} (created at {ctx.at(opt['site'])}) takes its first step at lr {fmt_num(trace[0])}, "
        f"{reference}, and {shape} over the {steps} observed step{'s' if steps != 1 else ''}: no warmup ramps up to "
        "the scaled lr, which is when large-batch training diverges or settles in a worse region"
    )
    return [  # the confirmation: it merges with the static finding
        ctx.finding(
            CODE,
            message=message,
            site=opt["site"],
            ranks=[opt["rank"]],
            evidence={
                "optimizer": opt["cls"],
                "param_group": opt["group"],
                "lr_trace": trace,
                "initial_lr": opt["initial_lr"],
                "peak_lr": peak,
                "base_lr": base,
                "unscaled_lr": term[0] if term else None,
                "ratio": ratio,
                "scaled_per_static_analysis": static is not None and not base,
            },
            magnitude=float(ratio) if ratio else float(SCALE_THRESHOLD),
        )
    ]
