"""DD209 bn-type-check-misses-syncbn (within one run): a converter did not carry a layer's momentum or eps over.

What it does: reads the `bn_conversion` events of the lowest rank and compares each original layer's momentum and
eps with its replacement's when it was registered. Code elsewhere that stops recognising converted layers (weight
decay exclusions, momentum schedules, freezing, precise-BN helpers that select by exact class) only shows against a
run without the conversion: `ddpdoctor triage` reports it from arm A against arm P, `check` from its own two short
arms (ddpdoctor.conversion, which also settles the static suspicions), and static analysis from the source. In a
single run a static suspicion of an exact-class test is noted as not measured (when the run converted layers at
all); the conversion check replaces that note with its measurement."""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses import bn_checks
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_num
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd209_bn_type_check_misses_syncbn import CODE

MEASURES = Measures(
    scope="site",
    what="each BatchNorm layer a converter replaced: whether its momentum and eps carried over (code that selects "
    "layers by exact class is measured only by `ddpdoctor triage`, against a run without the conversion)",
)
# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the converted layers measured with a lost momentum/eps",
    measure=key("changed_layers"))

ATTRIBUTES = ("momentum", "eps")


def lost_attributes(convs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in convs:
        before, after = e.get("before") or {}, e.get("after") or {}
        changed = {a: [before.get(a), after.get(a)] for a in ATTRIBUTES if before.get(a) != after.get(a)}
        if changed:
            out.append({**e, "changed": changed})
    return out


def _pair(values: list[Any]) -> str:
    return " → ".join("None" if v is None else fmt_num(float(v)) for v in values)


def analyze(ctx: RunContext) -> list[Finding]:
    convs = bn_checks.lowest_rank_conversions(ctx.run)
    if convs and ctx.run.meta.arm is None:
        for site in ctx.static_sites(CODE):
            ctx.not_measured(CODE, site=site, reason=(
                f"{len(convs)} layers were converted, but whether code selecting them by exact class changes what "
                "the run does shows only against a run without the conversion (`ddpdoctor triage`)"
            ))
    hits = lost_attributes(convs)
    if not hits:
        return []
    first = hits[0]
    what = ", ".join(f"{a} {_pair(v)}" for a, v in first["changed"].items())
    message = (
        f"the converter at {ctx.at(first.get('site'))} did not carry BatchNorm hyper-parameters over to "
        f"{len(hits)} {(first.get('after') or {}).get('cls')} layer{'s' if len(hits) != 1 else ''} "
        f"(`{first.get('name')}`: {what}): only the SyncBN run trains with the changed values"
    )
    evidence = {
        "layers": [{"name": e.get("name"), **{a: v for a, v in e["changed"].items()}} for e in hits][:16],
        "changed_layers": len(hits),
        "source": "conversion",
    }
    return [ctx.finding(CODE, message=message, site=first.get("site"), ranks=sorted(ctx.ranks),
                        evidence=evidence, magnitude=float(len(hits)))]
