"""DD208 conversion-changed-function: a BatchNorm layer replaced by a SyncBN-like layer computes something else.

What it does: reads the `bn_conversion` events of the lowest rank that has them (the model and the converter are
the same on every rank): each holds the result of `ddpdoctor.probe.equivalence.compare_functions`, which ran the
original layer and its replacement on the replacement's first input at identical weights and statistics, in
train and eval mode, with the replacement normalising over the rank's own batch. Fires when any layer's outputs
differ beyond float rounding, with the layer, both classes, the class that defined the original's own forward,
and the relative difference per mode. Layers that could not be compared (the replacement communicates by itself)
are counted in the evidence, never reported as changed.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses import bn_checks
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, pct
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd208_conversion_changed_function import CODE

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the converted layers measured computing a different function",
    measure=key("changed"))


def changed_layers(convs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in convs:
        eq = e.get("equivalence") or {}
        if eq.get("status") == "measured" and eq.get("equal") is False:
            out.append(e)
    return out


def analyze(ctx: RunContext) -> list[Finding]:
    convs = bn_checks.lowest_rank_conversions(ctx.run)
    if not convs:
        return []
    changed = changed_layers(convs)
    if not changed:
        return []
    first = changed[0]
    eq = first["equivalence"]
    before, after = first.get("before") or {}, first.get("after") or {}
    own = before.get("own_forward")
    modes = " and ".join(
        f"{pct(float(eq[m]['rel']))} in {m} mode" for m in ("train", "eval")
        if isinstance(eq.get(m), dict) and eq[m].get("rel") is not None and not eq[m].get("equal")
    ) + " of the largest output value"
    measured = [e for e in convs if (e.get("equivalence") or {}).get("status") == "measured"]
    message = (
        f"converting {len(changed)} of {len(measured)} compared BatchNorm layer{'s' if len(measured) != 1 else ''} "
        f"to {after.get('cls', 'SyncBatchNorm')} changed what {'they compute' if len(changed) > 1 else 'it computes'}: "
        f"`{first.get('name')}` ({before.get('cls')}"
        + (f", whose own forward is {own}" if own else "")
        + f") and its replacement, run on the same input at identical weights and statistics, differ by {modes}"
        " — the model trained with SyncBN is a different network from the one without it"
    )
    evidence = {
        "layers": [
            {"name": e.get("name"), "original": (e.get("before") or {}).get("cls"),
             "original_forward": (e.get("before") or {}).get("own_forward"),
             "replacement": (e.get("after") or {}).get("cls"),
             "train_rel_diff": ((e.get("equivalence") or {}).get("train") or {}).get("rel"),
             "eval_rel_diff": ((e.get("equivalence") or {}).get("eval") or {}).get("rel")}
            for e in changed
        ][:16],
        "changed": len(changed),
        "compared": len(measured),
        "converted": len(convs),
        "not_compared": [
            {"name": e.get("name"), "reason": (e.get("equivalence") or {}).get("reason")}
            for e in convs if (e.get("equivalence") or {}).get("status") != "measured"
        ][:8],
    }
    return [ctx.finding(CODE, message=message, site=first.get("site"), ranks=sorted(ctx.ranks),
                        evidence=evidence, magnitude=float(len(changed)))]
