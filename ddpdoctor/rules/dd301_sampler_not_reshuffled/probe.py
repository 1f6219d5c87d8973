"""DD301 sampler-not-reshuffled: a DistributedSampler(shuffle=True) gives the same order every epoch.

What it does: compares the order each rank's training DistributedSampler produced in consecutive epochs
(bit-exact digests of the whole order, and the fraction of positions holding the same index) and the set_epoch
calls seen on that sampler.

Samplers are followed as objects (the probe's id), and a sampler is a training sampler when a loader iteration
that drew from it ran optimizer steps: a helper that builds every loader's sampler at one line
(`def loader(ds, shuffle): return DataLoader(ds, sampler=DistributedSampler(ds, shuffle=shuffle))`) gives a
training and a validation sampler of one line, which must not be mixed. A sampler re-created every epoch at the
same line (the loader built inside the epoch loop) is followed as one: same line, a single training pass each.
An evaluation pass over the training loader within an epoch legitimately repeats its order and is not counted.

When a shuffling training sampler was observed over two or more epochs on every rank and its order changed every
epoch, the condition is measured absent: static DD301 findings at its line are cleared.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.consequence import key as evidence_key
from ddpdoctor.analyses.context import RunContext, fmt_ranks, pct
from ddpdoctor.analyses.orders import order, position_identity
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd301_sampler_not_reshuffled import CODE

MEASURES = Measures(
    scope="site",
    what="the order each shuffling DistributedSampler gave every rank in each observed epoch, and the set_epoch calls",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the ranks measured drawing the same sample order in every epoch",
    measure=evidence_key("per_rank"))


def _key(site: dict[str, Any] | None) -> tuple[str, int]:
    return (site or {}).get("file", "?"), (site or {}).get("line", 0)


def _owners(p) -> list[tuple[dict[str, Any], bool | None]]:  # noqa: ANN001
    """Each sampler_iter of the process with whether the loader iteration it fed trained (None: it fed no loader
    iteration). The order is drawn inside the iteration, or just before its `loader_iter` event when loader
    workers prefetch indices while the iterator is built."""
    pos = {id(e): i for i, e in enumerate(p.events)}
    ends = {e.get("it"): e for e in p.of("loader_iter_end")}
    iterations: dict[Any, list[tuple[int, int, bool]]] = {}
    for start in p.of("loader_iter"):
        sid = start.get("sampler")
        if sid is None:
            continue
        end = ends.get(start.get("it"))
        iterations.setdefault(sid, []).append(
            (pos[id(start)], pos[id(end)] if end is not None else len(p.events), bool(end and end.get("training")))
        )
    used: set[tuple[Any, int]] = set()
    out: list[tuple[dict[str, Any], bool | None]] = []
    for e in p.of("sampler_iter"):
        sid, at = e.get("sampler"), pos[id(e)]
        candidates = iterations.get(sid, [])
        owner = next((it for it in reversed(candidates) if it[0] < at < it[1] and (sid, it[0]) not in used), None)
        if owner is None:  # prefetched by workers before the iteration's own event
            owner = next((it for it in candidates if it[0] > at and (sid, it[0]) not in used), None)
        if owner is None:
            out.append((e, None))
            continue
        used.add((sid, owner[0]))
        out.append((e, owner[2]))
    return out


def _chains(p) -> dict[tuple, dict[str, Any]]:  # noqa: ANN001
    """The training samplers of one process, keyed the same way on every rank: (creation site, k-th training
    sampler created there), or (creation site, "re-created") for a sampler built anew every epoch."""
    created = {e.get("sampler"): e for e in p.of("sampler_created")}
    passes: dict[Any, list[dict[str, Any]]] = {}
    first_seen: list[Any] = []
    for e, training in _owners(p):
        sid = e.get("sampler")
        if training is False:
            continue  # an evaluation pass (of a validation sampler, or over the training loader)
        if sid not in passes:
            first_seen.append(sid)
        passes.setdefault(sid, []).append(e)  # training, or iterated outside any loader
    by_site: dict[tuple[str, int], list[Any]] = {}
    for sid in first_seen:
        by_site.setdefault(_key((created.get(sid) or {}).get("site")), []).append(sid)
    set_epochs: dict[Any, list[Any]] = {}
    for e in p.of("set_epoch"):
        set_epochs.setdefault(e.get("sampler"), []).append(e.get("epoch"))
    chains: dict[tuple, dict[str, Any]] = {}
    for site_key, sids in by_site.items():
        site = (created.get(sids[0]) or {}).get("site")
        if len(sids) > 1 and all(len(passes[s]) == 1 for s in sids):
            groups = [(("re-created",), sids)]
        else:
            groups = [((k,), [sid]) for k, sid in enumerate(sids)]
        for suffix, members in groups:
            chains[(site_key, *suffix)] = {
                "site": site,
                "samplers": members,
                "orders": [e for s in members for e in passes[s]],
                "set_epoch": [v for s in members for v in set_epochs.get(s, [])],
            }
    return chains


def analyze(ctx: RunContext) -> list[Finding]:
    groups: dict[tuple, dict[int, dict[str, Any]]] = {}
    for r, p in ctx.ranks.items():
        for key, chain in _chains(p).items():
            groups.setdefault(key, {})[r] = chain
    findings = []
    for per_rank in groups.values():
        site = next(iter(per_rank.values()))["site"]
        if not all(e.get("shuffle") for c in per_rank.values() for e in c["orders"]):
            continue  # shuffle=False repeats by design
        repeating: dict[int, dict[str, Any]] = {}
        observed = min(len(c["orders"]) for c in per_rank.values())
        for r, c in per_rank.items():
            evs = c["orders"]
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
                "set_epoch_calls": c["set_epoch"],
                "seed": evs[0].get("seed"),
                "samplers": len(c["samplers"]),
            }
        if not repeating:
            calls = sorted({v for c in per_rank.values() for v in c["set_epoch"]}, key=str)
            if observed >= 2 and len(per_rank) == len(ctx.ranks):
                how = f"set_epoch was called with {', '.join(map(str, calls))}" if calls else "set_epoch was not called"
                ctx.clear(
                    CODE,
                    site=site,
                    reason=f"{how} and the order changed from epoch to epoch in the {observed} observed epochs on "
                    f"{fmt_ranks(per_rank)}",
                    evidence={"epochs_observed": observed, "set_epoch_values": calls},
                )
            continue
        calls = sorted({str(v) for x in repeating.values() for v in x["set_epoch_calls"]})
        epochs_seen = sorted({str(v) for x in repeating.values() for v in x["sampler_epoch_values"]})
        recreated = any(x["samplers"] > 1 for x in repeating.values())
        if not calls and recreated:
            why = "a new sampler is created every epoch with the same seed and set_epoch is never called"
        elif not calls:
            why = "set_epoch was never called"
        elif len(epochs_seen) == 1:
            why = f"set_epoch was always called with {epochs_seen[0]}"
        else:
            why = "the order repeated although the sampler's epoch changed (a sampler subclass ignoring the epoch?)"
        identity = min(x["position_identity_epoch0_vs_1"] for x in repeating.values())
        longest = max(x["epochs_compared"] for x in repeating.values())
        message = (
            f"the DistributedSampler(shuffle=True) created at {ctx.at(site)} gave {fmt_ranks(repeating)} the "
            f"same order in every one of the {longest} observed epochs ({pct(identity)} of positions identical "
            f"between epochs 0 and 1): {why}, so every epoch feeds the same batches in the same order"
        )
        findings.append(
            ctx.finding(
                CODE,
                message=message,
                site=site,
                ranks=list(repeating),
                evidence={"per_rank": {str(r): v for r, v in repeating.items()}},
                magnitude=identity,
            )
        )
    return findings
