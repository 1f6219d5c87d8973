"""DD405 no-learning-signal: every gradient exactly zero (or None), or the loss bit-identical, at every observed step.

What it does: reads, for every optimizer step, the gradients the optimizer was about to use (how many of its
parameters had no gradient or an exactly zero one) and the value of every scalar tensor `.backward()` was called
on, bit-exact (float.hex). It fires on a rank where, over at least MIN_STEPS steps, no parameter ever got a
non-zero gradient, or the loss never changed by a single bit over at least MIN_LOSSES backward passes.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence, key, share
from ddpdoctor.analyses.context import RunContext, fmt_num, fmt_ranks
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd405_no_learning_signal import CODE, MIN_LOSSES, MIN_STEPS

SINGLE_CLASS_LOSSES = ("CrossEntropyLoss", "NLLLoss")
# a finding its own measurement contradicts is never reported; the share of ranks that learned nothing is the share
# of the run's training lost, and ranks the finding first among its severity (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the ranks measured with no non-zero gradient or no change of the loss at any observed step",
    measure=key("per_rank"), lost=share("per_rank", "ranks_observed"))


def _rank_signal(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    grads = [e.get("grads") or {} for e in steps]
    dead = [g for g in grads if g.get("params") and (g.get("none", 0) + g.get("zero", 0)) == g.get("params")]
    all_dead = len(steps) >= MIN_STEPS and len(dead) == len(steps)
    losses = [loss for e in steps for loss in e.get("losses") or []]
    constant = len(losses) >= MIN_LOSSES and len({loss[1] for loss in losses}) == 1
    if not all_dead and not constant:
        return None
    return {
        "steps": len(steps),
        "all_grads_zero_or_none": all_dead,
        "params": grads[0].get("params") if grads else None,
        "grads_none": [g.get("none") for g in grads],
        "grads_zero": [g.get("zero") for g in grads],
        "loss_constant": constant,
        "loss_value": losses[0][0] if constant else None,
        "loss_hex": losses[0][1] if constant else None,
        "losses_seen": len(losses),
        "loss_first_values": [loss[0] for loss in losses[:6]],
        "site": next((e.get("backward_site") for e in steps if e.get("backward_site")), None),
        "loss_module": next((e.get("loss_module") for e in steps if e.get("loss_module")), None),
    }


def likely_cause(signal: dict[str, Any]) -> str:
    """What the measurements point at; the generic list when they point at nothing in particular."""
    module = signal.get("loss_module") or {}
    shape = module.get("input_shape") or []
    if module.get("cls") in SINGLE_CLASS_LOSSES and len(shape) >= 2 and shape[1] == 1:
        return (f"{module['cls']} over a single output (input shape {shape}): the log-softmax of one logit is always "
                "0, so the loss is 0 whatever the model predicts — use BCEWithLogitsLoss or MSELoss for one output")
    return ("a loss detached or multiplied by zero, zero_grad between backward and step, or an optimizer over "
            "parameters the model no longer uses")


def analyze(ctx: RunContext) -> list[Finding]:
    per_rank = {}
    for r, p in ctx.ranks.items():
        signal = _rank_signal(p.of("train_step"))
        if signal is not None:
            per_rank[r] = signal
    if not per_rank:
        return []
    s = next(iter(per_rank.values()))
    facts = []
    if s["loss_constant"]:
        value = s["loss_value"]
        shown = fmt_num(value) if isinstance(value, (int, float)) else str(value)
        facts.append(
            f"the loss passed to backward() was {shown} to the last bit in all {s['losses_seen']} backward passes"
        )
    if s["all_grads_zero_or_none"]:
        none = max(s["grads_none"])
        if none == s["params"]:
            facts.append(f"none of the optimizer's {s['params']} parameters had a gradient at any step (all None)")
        else:
            facts.append(
                f"every gradient of the optimizer's {s['params']} parameters was exactly zero (or None) at every step"
            )
    message = (
        f"no learning signal on {fmt_ranks(per_rank)} over {s['steps']} observed steps: " + " and ".join(facts)
        + f", so the parameters never move ({likely_cause(s)})"
    )
    return [
        ctx.finding(
            CODE,
            message=message,
            site=s["site"],
            ranks=list(per_rank),
            evidence={
                "per_rank": {str(r): {k: v for k, v in sig.items() if k != "site"} for r, sig in per_rank.items()},
                "ranks_observed": len(ctx.ranks),
            },
            magnitude=float(len(per_rank)) / max(1, len(ctx.ranks)),
        )
    ]
