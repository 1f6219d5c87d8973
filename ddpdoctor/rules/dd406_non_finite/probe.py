"""DD406 non-finite: NaN or Inf in the loss, the gradients, the parameters or BatchNorm running statistics.

What it does: collects the probe's `nonfinite` events (the loss at backward or out of an `nn` loss module, the
gradients the optimizer was about to use, the parameters and norm-layer running statistics after a step) and
reports where it started: the earliest step, the rank, and the tensors; then how far it spread.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd406_non_finite import CODE

# Within one step, the order in which a NaN travels: loss → gradients → parameters → running statistics.
ORDER = {"loss": 0, "grad": 1, "param": 2, "running_mean": 3, "running_var": 3}
WORDS = {
    "loss": "the loss",
    "grad": "the gradients",
    "param": "the parameters",
    "running_var": "BatchNorm running_var",
    "running_mean": "BatchNorm running_mean",
}

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
# Once the parameters themselves are non-finite, every later step trains nothing: the share of the observed steps
# from there on is the share of the training lost (a NaN loss or gradient a GradScaler skips loses nothing).
CONSEQUENCE = Consequence(
    what="the non-finite losses, gradients or parameters measured",
    measure=key("events"), lost=lambda ev: _lost(ev))


def _lost(evidence: dict[str, Any]) -> float | None:
    start, steps = evidence.get("params_nonfinite_from_step"), evidence.get("steps_observed")
    if not isinstance(start, int) or not isinstance(steps, int) or steps <= 0:
        return None
    return max(0.0, min(1.0, (steps - start + 1) / steps))


def analyze(ctx: RunContext) -> list[Finding]:
    events: list[tuple[int, dict[str, Any]]] = []
    for r, p in ctx.ranks.items():
        events.extend((r, e) for e in p.of("nonfinite"))
    if not events:
        return []
    events.sort(key=lambda re: (re[1].get("step") or 0, ORDER.get(re[1].get("tensor"), 9), re[1].get("t", 0.0)))
    r0, first = events[0]
    what = first.get("tensor")
    names = first.get("names") or []
    value = f" ({first['value']})" if first.get("value") else ""
    detail = (
        f"{WORDS.get(what, what)}{value}"
        if what == "loss"
        else f"{WORDS.get(what, what)}: {first.get('count')} of {first.get('total')} tensors ({', '.join(names[:3])}"
        + (", ..." if len(names) > 3 else "") + ")"
    )
    # where it spread: the first step each other kind of tensor turned non-finite, grouped by step
    reached: dict[str, int] = {}
    for _, e in events[1:]:
        kind = e.get("tensor")
        if kind != what and kind not in reached:
            reached[kind] = int(e.get("step") or 0)
    by_step: dict[int, list[str]] = {}
    for kind, step in sorted(reached.items(), key=lambda kv: (kv[1], ORDER.get(kv[0], 9))):
        by_step.setdefault(step, []).append(WORDS.get(kind, kind))
    spread = [
        f"{_join(words)} {'in the same step' if step == first.get('step') else f'at step {step}'}"
        for step, words in by_step.items()
    ]
    ranks = sorted({r for r, _ in events})
    params_from = min((int(e.get("step") or 0) for _, e in events if e.get("tensor") == "param"), default=None)
    steps_observed = max((len(p.of("optimizer_step")) for p in ctx.ranks.values()), default=0)
    message = (
        f"a non-finite value first appeared at step {first.get('step')} on rank {r0}, in {detail}"
        + (f"; it reached {'; '.join(spread)}" if spread else "")
        + f" ({fmt_ranks(ranks)} affected)"
    )
    site = first.get("site") or next((e.get("site") for _, e in events if e.get("site")), None)
    return [
        ctx.finding(
            CODE,
            message=message,
            site=site,
            ranks=ranks,
            evidence={
                "first": {"rank": r0, "step": first.get("step"), "tensor": what, "names": names,
                          "count": first.get("count"), "total": first.get("total"), "value": first.get("value")},
                "events": [
                    {"rank": r, "step": e.get("step"), "tensor": e.get("tensor"), "names": (e.get("names") or [])[:4],
                     "count": e.get("count"), "total": e.get("total")}
                    for r, e in events[:20]
                ],
                "params_nonfinite_from_step": params_from,
                "steps_observed": steps_observed,
            },
            magnitude=1.0 / (1 + float(first.get("step") or 0)),
        )
    ]


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
