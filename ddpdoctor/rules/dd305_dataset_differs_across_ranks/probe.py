"""DD305 dataset-differs-across-ranks: the same dataset index holds different samples on different ranks.

What it does: compares, across ranks, the digests of the items each rank's dataset returned for the same fixed
indices (read through the dataset's own `__getitem__` with every global generator seeded to the same constant on
every rank, then restored), and its length. It fires for datasets that a DistributedSampler (or another sampler
that splits indices across ranks) shards, because that sampler assumes index i is the same sample everywhere.
Datasets sharded by hand (each rank loads its own part, no index-splitting sampler) differ by design and are
left alone; so are items that were not reproducible under a fixed seed (the dataset draws from a private
generator), since their digests cannot be compared.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd305_dataset_differs_across_ranks import CODE

METHOD = (
    "items read through the dataset's own __getitem__ in each rank's main process, with torch, numpy, random and "
    "device generators seeded to the same constant on every rank (states restored afterwards), so random "
    "augmentation cannot make them differ; digests cover dtype, shape and bytes of every tensor/array"
)
# The probe records where a DataLoader is created, not where its dataset or Subset is: findings point at the loader.
LOCATION = "the DataLoader over the dataset (where the dataset or its split is created is not recorded)"


def _differing(evidence: dict) -> float | None:
    """Indices whose items differ across ranks, plus one when the dataset's length differs."""
    if "differing" not in evidence and "lengths" not in evidence:
        return None
    lengths = evidence.get("lengths") or {}
    return float(len(evidence.get("differing") or ()) + (len(set(lengths.values())) > 1))


# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the dataset indices measured holding different samples across ranks (a differing length counts one)",
    measure=_differing)


def _key(e: dict[str, Any]) -> tuple:
    site = e.get("site") or {}
    return e.get("dataset_cls"), site.get("file"), site.get("line")


def _compare(per_rank: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """How one dataset's items and length differ across ranks; None when they agree or cannot be compared."""
    if len(per_rank) < 2 or not any(e.get("sharded") for e in per_rank.values()):
        return None
    if any(e.get("deterministic") is False or e.get("error") for e in per_rank.values()):
        return None
    lengths = {r: e.get("len") for r, e in per_rank.items()}
    items = {r: {it["index"]: it for it in e.get("items") or []} for r, e in per_rank.items()}
    common = sorted(set.intersection(*(set(v) for v in items.values())))
    differing = []
    for i in common:
        digests = {r: items[r][i]["digest"] for r in items}
        if len(set(digests.values())) > 1:
            parts = [items[r][i].get("parts") for r in items]
            same_parts = None
            if all(p is not None and len(p) == len(parts[0]) for p in parts):
                same_parts = [all(p[k] == parts[0][k] for p in parts) for k in range(len(parts[0]))]
            differing.append({
                "index": i,
                "digests": {str(r): d for r, d in digests.items()},
                "first_tensor": {str(r): items[r][i].get("first") for r in items},
                "element_equal_across_ranks": same_parts,
            })
    lengths_differ = len(set(lengths.values())) > 1
    if not differing and not lengths_differ:
        return None
    subsets = {r: [s.get("digest") for s in e.get("subsets") or []] for r, e in per_rank.items()}
    heads = {r: (e.get("subsets") or [{}])[0].get("head") for r, e in per_rank.items()}
    return {
        "events": per_rank,
        "lengths": lengths,
        "lengths_differ": lengths_differ,
        "common": common,
        "differing": differing,
        "subsets": subsets,
        "subset_heads": heads,
        "split_differs": any(subsets.values()) and len({tuple(v) for v in subsets.values()}) > 1,
    }


def _created_site(p, loader: Any) -> dict[str, Any] | None:  # noqa: ANN001
    created = next((e for e in p.of("loader_created") if e.get("loader") == loader), None)
    return created.get("site") if created else None


def analyze(ctx: RunContext) -> list[Finding]:
    if len(ctx.ranks) < 2:
        return []
    groups: dict[tuple, dict[int, dict[str, Any]]] = {}
    for r, p in ctx.ranks.items():
        nth: dict[tuple, int] = {}
        for e in p.of("dataset_items"):  # several datasets of one class can be read at one loop site
            k = _key(e)
            groups.setdefault((*k, nth.get(k, 0)), {})[r] = e
            nth[k] = nth.get(k, 0) + 1
    # One finding per dataset class: a train and a validation instance built the same way are one cause.
    by_class: dict[str, list[dict[str, Any]]] = {}
    for per_rank in groups.values():
        cmp = _compare(per_rank)
        if cmp is not None:
            e0 = next(iter(per_rank.values()))
            by_class.setdefault(e0.get("base_cls") or e0.get("dataset_cls"), []).append(cmp)
    findings = []
    for cls, cmps in by_class.items():
        c = cmps[0]
        per_rank = c["events"]
        e0 = next(iter(per_rank.values()))
        r0 = next(iter(per_rank))
        site = _created_site(ctx.ranks[r0], e0.get("loader")) or e0.get("site")
        differing, common = c["differing"], c["common"]
        what = []
        if differing:
            shown = ", ".join(str(d["index"]) for d in differing[:4])
            what.append(f"{len(differing)} of the {len(common)} indices compared ({shown}) hold different data")
            parts = differing[0]["element_equal_across_ranks"]
            if parts and any(parts) and not all(parts):
                same = [str(k) for k, v in enumerate(parts) if v]
                diff = [str(k) for k, v in enumerate(parts) if not v]
                what[-1] += f" (element {', '.join(diff)} differs, element {', '.join(same)} agrees)"
        if c["lengths_differ"]:
            what.append("its length differs (" + ", ".join(f"rank {r}: {n}" for r, n in c["lengths"].items()) + ")")
        if c["split_differs"]:
            heads = "; ".join(f"rank {r}: {h}" for r, h in c["subset_heads"].items() if h is not None)
            cause = (f"; it is a Subset of {cls} whose index list differs across ranks"
                     + (f" (first indices {heads})" if heads else "")
                     + ": a random_split without a seeded generator gives every rank its own split")
        elif not c["lengths_differ"]:
            cause = ("; the data was generated or ordered differently per process (unseeded synthetic data, "
                     "unsorted file lists)")
        else:
            cause = ""
        others = ""
        if len(cmps) > 1:
            others = f" (and in {len(cmps) - 1} more dataset{'s' if len(cmps) > 2 else ''} of this class)"
        sampler = e0.get("sampler_cls") or "the sampler"
        message = (
            f"{cls} differs across {fmt_ranks(per_rank)}: " + " and ".join(what) + f" even with identical seeds{others}"
            f"{cause}; {sampler} shards indices assuming index i is the same sample on every rank, so the ranks' "
            "shards are not a partition of one dataset"
        )
        fraction = len(differing) / len(common) if common else 1.0
        findings.append(
            ctx.finding(
                CODE,
                message=message,
                fix_variant="split" if c["split_differs"] else None,
                site=site,
                ranks=list(per_rank),
                evidence={
                    "dataset_cls": e0.get("dataset_cls"),
                    "sampler": sampler,
                    "lengths": {str(r): n for r, n in c["lengths"].items()},
                    "indices_compared": common,
                    "differing": differing,
                    "differing_fraction": fraction,
                    "datasets_of_this_class_differing": len(cmps),
                    "method": METHOD,
                    "location": LOCATION,
                    "split_differs": c["split_differs"],
                    **({"subset_index_digests": {str(r): v for r, v in c["subsets"].items()}}
                       if any(c["subsets"].values()) else {}),
                },
                magnitude=fraction,
            )
        )
    return findings
