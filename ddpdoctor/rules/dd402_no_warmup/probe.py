"""DD402 no-warmup: the learning rate starts at 4× or more the reference recipe's and nothing ramps it up.

What it does: reads the learning rate the optimizer used at every observed step (the lr trace of its largest
param group) and the schedulers' target (`initial_lr`). The peak is compared with the reference recipe's lr
(--base-lr); without one, a static DD402 finding recorded with the run (an lr multiplied by the world size) says
the lr was scaled up. The finding needs the trace to show no warmup: the first step already runs at the peak and
no later observed step raises the lr.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ddpdoctor.analyses.context import RunContext, fmt_num
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd402_no_warmup import CODE, RAMP, SCALE_THRESHOLD


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


def analyze(ctx: RunContext) -> list[Finding]:
    opt = lr_trace(ctx)
    if opt is None:
        return []
    trace = opt["trace"]
    peak = max([*trace, *(x for x in (opt["initial_lr"],) if x is not None)])
    if peak <= 0:
        return []
    ramps = any(b > a * (1 + RAMP) for a, b in zip(trace, trace[1:])) or trace[0] < peak * (1 - 1e-3)
    shown = ", ".join(fmt_num(x) for x in trace[:6]) + (", ..." if len(trace) > 6 else "")
    if ramps:
        ctx.clear(CODE, site=opt["site"], reason=(
            f"the lr the ranks stepped with ramps up: {shown} over the first {len(trace)} observed steps (peak "
            f"{fmt_num(peak)}): a warmup, whatever implements it"
        ), evidence={"lr_trace": trace[:20]})
        static = _static_scaled(ctx)
        if static is not None and static.file and static.line:
            ctx.clear(CODE, site={"file": static.file, "line": static.line},
                      reason=f"the lr the ranks stepped with ramps up: {shown} (peak {fmt_num(peak)})")
        return []
    base = ctx.settings.base_lr
    static = _static_scaled(ctx)
    if base:
        ratio = peak / base
        if ratio < SCALE_THRESHOLD:
            ctx.clear(CODE, site=opt["site"], reason=(
                f"the peak lr {fmt_num(peak)} is {fmt_num(ratio)}× the reference recipe's {fmt_num(base)} "
                f"(--base-lr): below the {fmt_num(SCALE_THRESHOLD)}× at which a warmup matters"
            ))
            return []
        reference = f"{fmt_num(ratio)}× the reference recipe's lr {fmt_num(base)} (--base-lr)"
    elif static is not None:
        ratio = None
        reference = f"an lr scaled with the world size ({ctx.path(static.file)}:{static.line})"
    else:
        return []
    steps = len(trace)
    shape = "stays there" if all(abs(x - trace[0]) <= abs(trace[0]) * RAMP for x in trace) else "only decays"
    message = (
        f"{opt['cls']} (created at {ctx.at(opt['site'])}) takes its first step at lr {fmt_num(trace[0])}, "
        f"{reference}, and {shape} over the {steps} observed step{'s' if steps != 1 else ''}: no warmup ramps up to "
        "the scaled lr, which is when large-batch training diverges or settles in a worse region"
    )
    return [
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
                "ratio": ratio,
                "scaled_per_static_analysis": static is not None and not base,
            },
            magnitude=float(ratio) if ratio else float(SCALE_THRESHOLD),
        )
    ]
