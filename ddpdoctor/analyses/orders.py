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
