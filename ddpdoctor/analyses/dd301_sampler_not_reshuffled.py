"""DD301 sampler-not-reshuffled: a DistributedSampler(shuffle=True) gives the same order every epoch.

What it does: compares the order each rank's DistributedSampler produced in consecutive epochs (bit-exact
digests of the whole order, and the fraction of positions holding the same index) and the set_epoch calls seen.
Samplers are followed by where they were created, so a sampler re-created every epoch with the same seed counts.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.context import RunContext, fmt_ranks, pct
from ddpdoctor.analyses.orders import order, position_identity
from ddpdoctor.findings import Finding

RULE = "DD301"


def _key(site: dict[str, Any] | None) -> tuple[str, int]:
    return (site or {}).get("file", "?"), (site or {}).get("line", 0)


def _training_orders(p) -> list[dict[str, Any]]:  # noqa: ANN001
    """The sampler orders that fed training epochs. An evaluation pass over the same loader within an epoch
    legitimately repeats the order; a sampler iterated outside any loader counts."""
    training = {e["it"]: bool(e.get("training")) for e in p.of("loader_iter_end")}
    starts = p.of("loader_iter")
    out = []
    for e in p.of("sampler_iter"):
        owner = None
        for s in starts:
            if s.get("sampler") == e.get("sampler") and s["t"] <= e["t"]:
                owner = s
        if owner is None or training.get(owner["it"], False):
            out.append(e)
    return out


def analyze(ctx: RunContext) -> list[Finding]:
    # (creation site) -> rank -> list of sampler_iter events in time order
    groups: dict[tuple[str, int], dict[int, list[dict[str, Any]]]] = {}
    sites: dict[tuple[str, int], dict[str, Any] | None] = {}
    set_epochs: dict[tuple[str, int], dict[int, list[Any]]] = {}
    for r, p in ctx.ranks.items():
        created = {e["sampler"]: e.get("site") for e in p.of("sampler_created")}
        for e in _training_orders(p):
            site = created.get(e.get("sampler"))
            key = _key(site)
            sites.setdefault(key, site)
            groups.setdefault(key, {}).setdefault(r, []).append(e)
        for e in p.of("set_epoch"):
            key = _key(created.get(e.get("sampler")))
            set_epochs.setdefault(key, {}).setdefault(r, []).append(e.get("epoch"))
    findings = []
    for key, per_rank in groups.items():
        if not all(e.get("shuffle") for evs in per_rank.values() for e in evs):
            continue  # shuffle=False repeats by design
        repeating: dict[int, dict[str, Any]] = {}
        observed = 0
        for r, evs in per_rank.items():
            observed = max(observed, len(evs))
            if len(evs) < 2:
                continue
            same = [evs[i]["digest"] == evs[i + 1]["digest"] for i in range(len(evs) - 1)]
            if not any(same):
                continue
            a, b = order(ctx, evs[0].get("order")), order(ctx, evs[1].get("order"))
            identity = position_identity(a, b) if a is not None and b is not None else (1.0 if same[0] else 0.0)
            repeating[r] = {
                "epochs_compared": len(evs),
                "repeats": sum(same),
                "sampler_epoch_values": [e.get("epoch") for e in evs],
                "position_identity_epoch0_vs_1": identity,
                "digests": [e.get("digest") for e in evs],
                "set_epoch_calls": set_epochs.get(key, {}).get(r, []),
                "seed": evs[0].get("seed"),
            }
        if not repeating:
            continue
        calls = sorted({str(v) for v in sum((x["set_epoch_calls"] for x in repeating.values()), [])})
        epochs_seen = sorted({str(v) for x in repeating.values() for v in x["sampler_epoch_values"]})
        samplers = {e.get("sampler") for r in repeating for e in per_rank[r]}
        if not calls and len(samplers) > 1:
            why = "a new sampler is created every epoch with the same seed and set_epoch is never called"
        elif not calls:
            why = "set_epoch was never called"
        elif len(epochs_seen) == 1:
            why = f"set_epoch was always called with {epochs_seen[0]}"
        else:
            why = "the order repeated although the sampler's epoch changed (a sampler subclass ignoring the epoch?)"
        identity = min(x["position_identity_epoch0_vs_1"] for x in repeating.values())
        message = (
            f"the DistributedSampler(shuffle=True) created at {ctx.at(sites[key])} gave {fmt_ranks(repeating)} the "
            f"same order in every one of the {observed} observed epochs ({pct(identity)} of positions identical "
            f"between epochs 0 and 1): {why}, so every epoch feeds the same batches in the same order"
        )
        findings.append(
            ctx.finding(
                RULE,
                message=message,
                fix="Call sampler.set_epoch(epoch) at the start of every epoch, before iterating the DataLoader.",
                site=sites[key],
                ranks=list(repeating),
                evidence={"per_rank": {str(r): v for r, v in repeating.items()}},
                magnitude=identity,
            )
        )
    return findings
