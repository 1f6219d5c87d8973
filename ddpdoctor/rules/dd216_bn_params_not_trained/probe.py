"""DD216 bn-params-not-trained: the converted BN layers' weight and bias are not what the optimizer updates.

What it does: reads the `bn_conversion` events of the lowest rank, written at the first optimizer step after each
conversion. A replacement whose weight or bias requires gradients, that no optimizer holds, while an optimizer
holds the original layer's parameters (or optimizers exist at all) is a cloning converter applied after the
optimizer was built: the optimizer keeps updating tensors the model no longer uses. Parameters left out of every
optimizer on purpose (requires_grad False) are not counted.

Measured over the run: when an optimizer held, at the first step after each conversion, the weight and bias of
every layer the run converted (a converter that reuses the original Parameter objects, whatever its code looks
like), a static suspicion is dropped with the layer count.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses import bn_checks
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd216_bn_params_not_trained import CODE

MEASURES = Measures(
    scope="run",
    what="at the first optimizer step after each BatchNorm conversion: whether an optimizer holds the weight and bias "
    "the converted layers use",
)
# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the BN layers measured with parameters the optimizer does not update",
    measure=key("untrained_layers"))


def untrained(convs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in convs:
        if not e.get("optimizers") or not e.get("in_model", True):
            continue
        now = e.get("at_step") or e.get("after") or {}
        new_opt = e.get("optimizer_new") or {}
        old_opt = e.get("optimizer_original") or {}
        missing = [k for k in ("weight", "bias") if k in new_opt and new_opt[k] is None
                   and now.get(f"{k}_requires_grad") is True]
        if missing:
            out.append({**e, "missing": missing, "original_in_optimizer": any(old_opt.get(k) for k in missing)})
    return out


def analyze(ctx: RunContext) -> list[Finding]:
    convs = bn_checks.lowest_rank_conversions(ctx.run)
    hits = untrained(convs)
    _measure_trained(ctx, convs, hits)
    if not hits:
        return []
    first = hits[0]
    stale = [e for e in hits if e["original_in_optimizer"]]
    cloned = [e for e in hits if (e.get("same_params") or {}).get("weight") is False]
    message = (
        f"the optimizer never updates the weight/bias of {len(hits)} converted BatchNorm "
        f"layer{'s' if len(hits) != 1 else ''}: the converter at {ctx.at(first.get('site'))} gave "
        f"{'them' if len(hits) != 1 else 'it'} new parameters"
        + (" (cloned)" if cloned else "")
        + " after the optimizer was built"
        + (f", and the optimizer still holds the pre-conversion tensors of {len(stale)}" if stale else "")
        + f" (first: `{first.get('name')}`) — those BN affine parameters stay at their initial values"
    )
    evidence = {
        "layers": [{"name": e.get("name"), "missing": e["missing"], "cloned": (e.get("same_params") or {}),
                    "original_in_optimizer": e["original_in_optimizer"]} for e in hits][:16],
        "untrained_layers": len(hits),
        "optimizers": first.get("optimizers"),
    }
    return [ctx.finding(CODE, message=message, site=first.get("site"), ranks=sorted(ctx.ranks),
                        evidence=evidence, magnitude=float(len(hits)))]


def _measure_trained(ctx: RunContext, convs: list[dict[str, Any]], hits: list[dict[str, Any]]) -> None:
    """Every layer the run converted was held by an optimizer at the first step after its conversion. Run-wide: the
    recorded site is the line that registered the new layer (inside a converter), not the call static analysis
    flagged, and a conversion that ran is one of the run's."""
    held = [e for e in convs if e.get("optimizers") and e.get("in_model", True)]
    if hits or not held:
        return
    sites = sorted({ctx.at(e.get("site")) for e in held})
    same = sum(1 for e in held if (e.get("same_params") or {}).get("weight") is True)
    kept = f", {same} of them with the original Parameter objects" if same else ""
    ctx.measured(CODE, run_wide=True, reason=(
        f"at the first optimizer step after each conversion ({', '.join(sites[:3])}), an optimizer held the weight "
        f"and bias of {'all' if len(held) != 1 else 'the'} {len(held)} converted layer{'s' if len(held) != 1 else ''}"
        f"{kept}"
    ), evidence={"layers": len(held)})
