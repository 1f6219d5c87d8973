"""Index orders and sets from a recorded run (DistributedSampler orders, indices drawn by loaders), and how
much they overlap. Orders beyond the recording cap are consistent samples (the same hash rule on every rank and
epoch), so fractions computed on them estimate the true ones without bias."""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpdoctor.analyses.context import RunContext


def order(ctx: RunContext, ref: dict[str, Any] | None) -> np.ndarray | None:
    if not ref:
        return None
    try:
        return ctx.run.load_array(ref)
    except (OSError, ValueError, KeyError):
        return None


def position_identity(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of positions holding the same index in two orders (1.0 = the same order)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0.0
    return float(np.mean(a[:n] == b[:n]))


def shared_fraction(mine: np.ndarray, others: list[np.ndarray]) -> float:
    """Fraction of the indices in `mine` that some other rank also visits."""
    if len(mine) == 0 or not others:
        return 0.0
    other = np.unique(np.concatenate(others))
    return float(np.mean(np.isin(np.unique(mine), other)))


HASH_MULT = 2654435761  # the probe's consistent-sample rule (ddpdoctor.probe.recorders.data)


def consistent(arr: np.ndarray, k: int | None) -> np.ndarray:
    """Keep the indices the probe's 1/K consistent sample would keep."""
    if not k or k <= 1:
        return arr
    a = arr.astype(np.int64)
    return a[((a * HASH_MULT) % (1 << 32)) % k == 0]


def loader_subset(p, loader: Any) -> dict[str, Any] | None:  # noqa: ANN001
    """The `subset` record of a DataLoader's creation (None when its dataset is no Subset or it was not seen)."""
    created = next((e for e in p.of("loader_created") if e.get("loader") == loader), None)
    return (created or {}).get("subset") or None


def subsets_differ(ctx: RunContext, loaders: dict[int, Any]) -> bool | None:
    """Whether the ranks' DataLoaders (rank -> loader id) iterate Subsets holding different samples: True when
    the Subset index lists differ (a `random_split` without a seeded generator gives every rank its own split),
    False when they agree, None when no rank's dataset is a Subset or it cannot be told.

    The exact digests of the index lists (`dataset_items.subsets`) decide where every rank recorded them; otherwise
    the index lists kept with `loader_created` (whole, or the same consistent sample on every rank) are compared."""
    if len(loaders) < 2:
        return None
    digests = {}
    for r, lid in loaders.items():
        items = next((e for e in ctx.ranks[r].of("dataset_items") if e.get("loader") == lid), None)
        chain = (items or {}).get("subsets")
        if chain:
            digests[r] = tuple(s.get("digest") for s in chain)
    if len(digests) == len(loaders):
        return len(set(digests.values())) > 1
    subsets = {r: loader_subset(ctx.ranks[r], lid) for r, lid in loaders.items()}
    if not any(subsets.values()):
        return None
    if not all(subsets.values()):
        return True  # a Subset on some ranks only
    if len({(s.get("len"), s.get("base_len"), s.get("sample_mod")) for s in subsets.values()}) > 1:
        return True
    arrays = [order(ctx, s.get("indices")) for s in subsets.values()]
    if any(a is None for a in arrays):
        return None
    return any(not np.array_equal(arrays[0], a) for a in arrays[1:])
