"""DD212 syncbn-scope: SyncBN layers synchronise over a set of ranks nobody intended.

What it does: collects, per SyncBN-like layer, the global ranks of its process group as each rank saw it (from the
applied-statistics recorder, else from the batchnorm recorder's `bn_layer`). With more than one rank in the run it
fires when a layer's group on some rank holds that rank alone (statistics are local), does not hold the rank
itself, or when ranks disagree about a group they share. Consistent subgroups of two or more ranks (SyncBN over a
deliberate partition) are not a finding.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses import bn_checks
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd212_syncbn_scope import CODE

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the SyncBN layers measured synchronising over a process group other than the world",
    measure=key("layers"))


def layer_groups(ctx: RunContext) -> dict[str, dict[int, list[int]]]:
    """layer name → rank → global ranks of its process group (SyncBN-like layers only)."""
    out: dict[str, dict[int, list[int]]] = {}
    for layer in bn_checks.applied(ctx.run):
        for fwds in layer.forwards.values():
            for r, f in fwds.items():
                if f.sync_like and f.group_ranks:
                    out.setdefault(layer.name, {}).setdefault(r, list(f.group_ranks))
    for rank, proc in ctx.ranks.items():
        for e in proc.of("bn_layer"):
            if e.get("bn_kind") in ("sync", "emulated_sync") and e.get("group_ranks"):
                out.setdefault(str(e.get("name")), {}).setdefault(rank, list(e["group_ranks"]))
    return out


def problems(groups: dict[int, list[int]]) -> list[str]:
    out = []
    for r, g in sorted(groups.items()):
        if len(g) == 1 and g == [r]:
            out.append(f"rank {r} syncs with itself only")
        elif r not in g:
            out.append(f"rank {r}'s group {g} does not contain rank {r}")
    for r, g in groups.items():
        for q in g:
            if q in groups and sorted(groups[q]) != sorted(g):
                out.append(f"ranks {r} and {q} disagree about their group ({g} vs {groups[q]})")
                return out
    return out


def analyze(ctx: RunContext) -> list[Finding]:
    if ctx.world_size < 2:
        return []
    bad: list[tuple[str, dict[int, list[int]], list[str]]] = []
    for name, groups in layer_groups(ctx).items():
        found = problems(groups)
        if found:
            bad.append((name, groups, found))
    if not bad:
        return []
    name, groups, found = bad[0]
    singleton = all(len(g) == 1 for g in groups.values())
    message = (
        f"{len(bad)} SyncBN layer{'s' if len(bad) != 1 else ''} synchronise{'' if len(bad) != 1 else 's'} over "
        f"{'a single rank' if singleton else 'an unintended set of ranks'} on a {ctx.world_size}-rank run "
        f"(`{name}`: {'; '.join(found[:3])})"
        + (": each rank normalises with its own batch statistics although the layers are SyncBatchNorm"
           if singleton else "")
    )
    evidence: dict[str, Any] = {
        "layers": [{"name": n, "groups": {str(r): g for r, g in gs.items()}, "problems": p} for n, gs, p in bad][:16],
        "world_size": ctx.world_size,
    }
    site = None
    for proc in ctx.ranks.values():
        for e in proc.of("sync_bn_convert"):
            site = site or e.get("site")
    return [ctx.finding(CODE, message=message, site=site, ranks=sorted(ctx.ranks), evidence=evidence,
                        magnitude=float(len(bad)))]
