"""DD210 frozen-bn-unfrozen (within one run): a converter dropped the frozen state of BatchNorm layers.

What it does: reads the `bn_conversion` events of the lowest rank: a layer whose original had weight/bias with
requires_grad False, replaced by one whose parameters require gradients at the first optimizer step, and that an
optimizer now updates (or that trains in train mode), was unfrozen by the conversion. The training flag alone is
not used here — the script's own `model.train()` sets it for every layer, converted or not —; `ddpdoctor triage`
compares it between the arms with and without the conversion.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses import bn_checks
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd210_frozen_bn_unfrozen import CODE

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the frozen layers measured training after the conversion",
    measure=key("unfrozen_layers"))


def unfrozen(convs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in convs:
        before, now = e.get("before") or {}, e.get("at_step") or e.get("after") or {}
        was = [k for k in ("weight", "bias") if before.get(f"{k}_requires_grad") is False]
        now_trains = [k for k in was if now.get(f"{k}_requires_grad") is True]
        if now_trains:
            out.append({**e, "unfrozen": now_trains})
    return out


def analyze(ctx: RunContext) -> list[Finding]:
    convs = bn_checks.lowest_rank_conversions(ctx.run)
    hits = unfrozen(convs)
    if not hits:
        return []
    first = hits[0]
    optimised = [e for e in hits if any((e.get("optimizer_new") or {}).get(k) for k in e["unfrozen"])]
    eval_dropped = [e for e in hits if (e.get("before") or {}).get("training") is False
                    and (e.get("after") or {}).get("training") is True]
    message = (
        f"{len(hits)} BatchNorm layer{'s were' if len(hits) != 1 else ' was'} frozen before the conversion "
        f"(requires_grad False) and {'train' if len(hits) != 1 else 'trains'} after it: the converter at "
        f"{ctx.at(first.get('site'))} built {(first.get('after') or {}).get('cls')} layers whose weight and bias "
        "require gradients"
        + (f", {len(optimised)} of them updated by the optimizer" if optimised else "")
        + (f", and {len(eval_dropped)} left eval mode" if eval_dropped else "")
        + f" (first: `{first.get('name')}`)"
    )
    evidence = {
        "layers": [{"name": e.get("name"), "unfrozen": e["unfrozen"],
                    "in_optimizer": bool(any((e.get("optimizer_new") or {}).get(k) for k in e["unfrozen"])),
                    "training_before": (e.get("before") or {}).get("training"),
                    "training_after": (e.get("after") or {}).get("training")} for e in hits][:16],
        "unfrozen_layers": len(hits),
        "optimised": len(optimised),
    }
    return [ctx.finding(CODE, message=message, site=first.get("site"), ranks=sorted(ctx.ranks),
                        evidence=evidence, magnitude=float(len(hits)))]
