"""DD303 eval-sampler-padding: a DistributedSampler over evaluation data pads it with duplicates (or drops a tail).

What it does: finds DistributedSamplers iterated only for evaluation (no optimizer step during any of their
loader iterations, and gradients disabled or the rank training through another loader), and counts, over the
orders every rank's sampler produced for the same pass, the indices evaluated more than once (drop_last=False:
the sampler repeats indices from the start until the length divides by the world size) or never
(drop_last=True). Where not every rank's order was recorded, the count follows from the sampler's own numbers:
num_samples × num_replicas − len(dataset).

Orders are recorded as indices of the dataset under any Subset. When the ranks' Subsets hold different samples (a
`random_split` without a seeded generator: DD305), a base index shared by two ranks is a chance overlap of two
splits, not padding, so the orders are counted as positions within each rank's own Subset (or, where those cannot
be recovered, from the sampler's arithmetic), and the finding says the ranks evaluate different subsets.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, pct
from ddpdoctor.analyses.orders import loader_subset, order, subsets_differ
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd303_eval_sampler_padding import CODE

MEASURES = Measures(
    scope="site",
    what="the samples each rank evaluated from every evaluation DataLoader with a DistributedSampler, and the "
    "duplicates padding added",
)


def _padded(evidence: dict) -> float | None:
    """The samples the sampler repeated to pad the shards, or dropped with drop_last."""
    value = key("duplicated")(evidence)
    return value if value is not None else key("dropped")(evidence)


# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the evaluation samples measured repeated (padding) or dropped by the sampler",
    measure=_padded)


def _key(site: dict[str, Any] | None) -> tuple[str, int]:
    return (site or {}).get("file", "?"), (site or {}).get("line", 0)


def _evaluation_samplers(p) -> dict[Any, bool]:  # noqa: ANN001
    """sampler id -> True when every loader iteration over it was an evaluation pass."""
    ends = {e.get("it"): e for e in p.of("loader_iter_end")}
    trained_elsewhere = bool(p.of("optimizer_step"))
    verdict: dict[Any, bool] = {}
    for start in p.of("loader_iter"):
        sid = start.get("sampler")
        if start.get("sampler_kind") not in (None, "distributed") or sid is None:
            continue
        end = ends.get(start.get("it"), {})
        evaluating = not end.get("training") and not end.get("steps") and (
            start.get("grad_enabled") is False or trained_elsewhere
        )
        verdict[sid] = verdict.get(sid, True) and evaluating
    return verdict


def _loader_of(p, sampler: Any) -> Any:  # noqa: ANN001
    """The DataLoader iterating a sampler (its creation event, else its first iteration)."""
    for kind in ("loader_created", "loader_iter"):
        e = next((e for e in p.of(kind) if e.get("sampler") == sampler and e.get("loader") is not None), None)
        if e is not None:
            return e["loader"]
    return None


def _subset_positions(ctx: RunContext, p, loader: Any, base_order: np.ndarray) -> np.ndarray | None:  # noqa: ANN001
    """A rank's order (indices under its Subset) as positions within that rank's own Subset; None when the
    Subset's whole index list was not kept or does not map every index back to one position."""
    subset = loader_subset(p, loader)
    if not subset or subset.get("sample_mod") is not None:
        return None
    base = order(ctx, subset.get("indices"))
    if base is None or len(np.unique(base)) != len(base):
        return None
    position = {int(b): i for i, b in enumerate(base.tolist())}
    try:
        return np.array([position[int(b)] for b in base_order.tolist()], dtype=np.int64)
    except KeyError:
        return None


def analyze(ctx: RunContext) -> list[Finding]:
    # sampler creation site -> rank -> (sampler_created, first sampler_iter)
    groups: dict[tuple, dict[int, tuple[dict[str, Any], dict[str, Any] | None]]] = {}
    # Keyed by creation site and the sampler's rank among those created there: a helper that builds every
    # loader creates the training and the evaluation samplers at the same line.
    for r, p in ctx.ranks.items():
        evaluation = _evaluation_samplers(p)
        nth: dict[tuple[str, int], int] = {}
        for created in p.of("sampler_created"):
            sid = created.get("sampler")
            if created.get("sampler_kind", created.get("kind")) != "distributed":
                continue
            site_key = _key(created.get("site"))
            n = nth.get(site_key, 0)
            nth[site_key] = n + 1
            if not evaluation.get(sid):
                continue
            first = next((e for e in p.of("sampler_iter") if e.get("sampler") == sid), None)
            groups.setdefault((site_key, n), {})[r] = (created, first)
    findings = []
    for per_rank in groups.values():
        created0, _ = next(iter(per_rank.values()))
        n = created0.get("len")
        replicas = created0.get("num_replicas")
        num_samples = created0.get("num_samples")
        drop_last = bool(created0.get("drop_last"))
        if not isinstance(n, int) or not isinstance(replicas, int) or not isinstance(num_samples, int) or n <= 0:
            continue
        expected = abs(num_samples * replicas - n)
        orders = {}
        for r, (_, it) in per_rank.items():
            arr = order(ctx, it.get("order")) if it and it.get("sample_mod") is None else None
            if arr is not None:
                orders[r] = arr
        loaders = {r: _loader_of(ctx.ranks[r], created.get("sampler")) for r, (created, _) in per_rank.items()}
        split_differs = subsets_differ(ctx, {r: lid for r, lid in loaders.items() if lid is not None}) is True
        if split_differs:  # count positions within each rank's own Subset, not chance overlaps of base indices
            local = {r: _subset_positions(ctx, ctx.ranks[r], loaders[r], a) for r, a in orders.items()}
            orders = {r: a for r, a in local.items() if a is not None} if all(
                a is not None for a in local.values()) else {}
        measured = len(orders) == replicas and replicas > 1
        duplicated_indices: list[int] = []
        if measured:
            allidx = np.concatenate(list(orders.values())).astype(np.int64)
            counts = Counter(allidx.tolist())
            if drop_last:
                count = n - len(counts)
            else:
                count = int(sum(c - 1 for c in counts.values() if c > 1))
                if not split_differs:  # positions in different Subsets name no one sample
                    duplicated_indices = sorted(i for i, c in counts.items() if c > 1)[:10]
        else:
            count = expected
        if measured:
            how = ("counted over the positions each rank's order takes in its own Subset" if split_differs
                   else "counted over the orders of all ranks")
        else:
            how = "from the sampler's num_samples × num_replicas"
        if count <= 0:
            ctx.clear(
                CODE,
                site=created0.get("site"),
                reason=(
                    f"its {n} evaluation samples split evenly over {replicas} ranks ({num_samples} each), "
                    f"{'none dropped' if drop_last else 'none padded'}"
                    + (f" ({how})" if measured else "")
                ),
                evidence={"dataset_len": n, "num_replicas": replicas, "num_samples_per_rank": num_samples,
                          "measured_from_orders": measured},
            )
            continue
        if drop_last:
            consequence = (
                f"{count} of its {n} samples {'is' if count == 1 else 'are'} never evaluated (drop_last=True), "
                f"so the metric covers {pct((n - count) / n)} of the evaluation set"
            )
        else:
            shown = ", ".join(str(i) for i in duplicated_indices[:5])
            consequence = (
                f"{count} sample{' is' if count == 1 else 's are'} evaluated twice"
                + (f" (index {shown})" if shown else "")
                + f" to pad {n} samples to {num_samples} per rank, so a metric gathered over ranks counts "
                f"{num_samples * replicas} results for {n} samples"
            )
        message = (
            f"the evaluation DistributedSampler created at {ctx.at(created0.get('site'))} splits {n} samples over "
            f"{replicas} ranks: {consequence} ({how})"
        )
        if split_differs:
            message += (
                "; moreover the ranks evaluate different subsets: their Subset index lists differ (a random_split "
                "without a seeded generator, DD305), so the gathered metric mixes samples of different splits"
            )
        findings.append(
            ctx.finding(
                CODE,
                message=message,
                site=created0.get("site"),
                ranks=list(per_rank),
                evidence={
                    "dataset_len": n,
                    "num_replicas": replicas,
                    "num_samples_per_rank": num_samples,
                    "drop_last": drop_last,
                    "duplicated" if not drop_last else "dropped": count,
                    "duplicated_indices": duplicated_indices,
                    "measured_from_orders": measured,
                    "subsets_differ_across_ranks": split_differs,
                    "per_rank_order_length": {str(r): int(len(a)) for r, a in orders.items()},
                },
                magnitude=count / n,
            )
        )
    return findings


