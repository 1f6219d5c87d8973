"""Which samples each rank sees at each step of a comparison (pure Python + numpy, no torch).

Every mode of `compare-bn` replays the same plan, so they see exactly the same global batches in the same order.
Each rank has its own stream of sample indices, cut into per-rank batches:

- `iid`: a seeded permutation of the whole dataset per epoch, cut into global batches of R x B and each global
  batch split across the ranks. Without padding: the last global batch of an epoch is shorter and split as evenly
  as possible, so per-rank batch sizes are uneven there (a dataset length not divisible by R x B).
- `sorted`: the dataset sorted by label (stable) and cut into R contiguous slices; each rank shuffles only inside
  its own slice. This is the classic non-i.i.d. layout (per-rank shard files, a sampler without shuffling over
  label-ordered data).
- a list per rank (from `--shard FILE`): used as given, in the given order, every epoch.

A stream that runs out starts the next epoch. A leftover too small to give every rank two samples joins the
previous batch: plain BN cannot train on a single value per channel, and the point is to compare statistics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = ["BatchPlan", "build_plan", "read_shard_file"]


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    shard: str
    nproc: int
    batch_size: int
    # steps[s][r] = the dataset indices rank r normalises over at step s
    steps: tuple[tuple[tuple[int, ...], ...], ...]

    def rank_batch(self, step: int, rank: int) -> tuple[int, ...]:
        return self.steps[step][rank]

    def global_batch(self, step: int) -> tuple[int, ...]:
        """Ranks' batches concatenated in rank order: what the exact reference normalises over."""
        return tuple(i for part in self.steps[step] for i in part)

    @property
    def rank_sizes(self) -> list[list[int]]:
        """sizes[r][s]: samples on rank r at step s."""
        return [[len(step[r]) for step in self.steps] for r in range(self.nproc)]

    @property
    def global_sizes(self) -> list[int]:
        return [sum(len(p) for p in step) for step in self.steps]

    def to_json(self) -> dict[str, Any]:
        return {"shard": self.shard, "nproc": self.nproc, "batch_size": self.batch_size,
                "steps": [[list(p) for p in step] for step in self.steps]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BatchPlan":
        return cls(shard=data["shard"], nproc=data["nproc"], batch_size=data["batch_size"],
                   steps=tuple(tuple(tuple(p) for p in step) for step in data["steps"]))


def _batches(epochs: Iterator[Sequence[int]], batch_size: int) -> Iterator[tuple[int, ...]]:
    for order in epochs:
        order = [int(i) for i in order]
        chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        if len(chunks) > 1 and len(chunks[-1]) == 1:
            chunks[-2].extend(chunks.pop())
        for chunk in chunks:
            yield tuple(chunk)


def _iid_steps(n_items: int, nproc: int, batch_size: int, seed: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    global_batch = nproc * batch_size
    epoch = 0
    while True:
        perm = np.random.default_rng([seed, epoch]).permutation(n_items).tolist()
        chunks = [perm[i : i + global_batch] for i in range(0, n_items, global_batch)]
        if len(chunks) > 1 and len(chunks[-1]) < 2 * nproc:
            chunks[-2].extend(chunks.pop())
        for chunk in chunks:
            if len(chunk) == global_batch:
                yield tuple(tuple(chunk[r * batch_size : (r + 1) * batch_size]) for r in range(nproc))
            else:
                yield tuple(tuple(int(i) for i in part) for part in np.array_split(np.asarray(chunk), nproc))
        epoch += 1


def _slice_epochs(indices: np.ndarray, seed: int, rank: int) -> Iterator[Sequence[int]]:
    epoch = 0
    while True:
        yield np.random.default_rng([seed, epoch, rank, 1]).permutation(indices).tolist()
        epoch += 1


def _fixed_epochs(indices: Sequence[int]) -> Iterator[Sequence[int]]:
    while True:
        yield indices


def build_plan(
    shard: str,
    *,
    n_items: int,
    nproc: int,
    batch_size: int,
    steps: int,
    seed: int,
    labels: Sequence[Any] | None = None,
    rank_lists: Sequence[Sequence[int]] | None = None,
) -> BatchPlan:
    """The per-step, per-rank index lists for `shard` = "iid", "sorted" (needs `labels`) or "file" (needs
    `rank_lists`). Raises ValueError with a one-line reason when the data cannot feed `nproc` ranks."""
    if n_items < 2 * nproc:
        raise ValueError(f"the dataset has {n_items} samples; {nproc} ranks need at least {2 * nproc}")
    if shard == "iid":
        iid = _iid_steps(n_items, nproc, batch_size, seed)
        return BatchPlan(shard=shard, nproc=nproc, batch_size=batch_size,
                         steps=tuple(next(iid) for _ in range(steps)))
    if shard == "sorted":
        if labels is None or len(labels) != n_items:
            raise ValueError("--shard sorted needs one label per sample")
        order = np.argsort(np.asarray(labels), kind="stable")
        slices = np.array_split(order, nproc)
        streams = [_batches(_slice_epochs(slices[r], seed, r), batch_size) for r in range(nproc)]
    elif shard == "file":
        if rank_lists is None or len(rank_lists) != nproc:
            got = 0 if rank_lists is None else len(rank_lists)
            raise ValueError(f"--shard FILE has {got} index lists for {nproc} ranks")
        for r, lst in enumerate(rank_lists):
            if len(lst) < 2:
                raise ValueError(f"--shard FILE: rank {r}'s list has {len(lst)} index(es); batch norm needs >= 2")
            bad = [i for i in lst if not (0 <= int(i) < n_items)]
            if bad:
                raise ValueError(f"--shard FILE: rank {r} has index {bad[0]} outside 0..{n_items - 1}")
        streams = [_batches(_fixed_epochs(list(lst)), batch_size) for lst in rank_lists]
    else:
        raise ValueError(f"unknown shard kind {shard!r}")
    plan_steps = tuple(tuple(next(stream) for stream in streams) for _ in range(steps))
    return BatchPlan(shard=shard, nproc=nproc, batch_size=batch_size, steps=plan_steps)


def read_shard_file(path: Path, nproc: int) -> list[list[int]]:
    """`--shard FILE`: a JSON list with one list of dataset indices per rank. ValueError with a one-line reason."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--shard {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--shard {path}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and "ranks" in data:
        data = data["ranks"]
    if not isinstance(data, list) or not all(isinstance(lst, list) for lst in data):
        raise ValueError(f"--shard {path}: expected a JSON list of per-rank index lists")
    if len(data) != nproc:
        raise ValueError(f"--shard {path}: {len(data)} index lists for --nproc {nproc}")
    out = []
    for r, lst in enumerate(data):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in lst):
            raise ValueError(f"--shard {path}: rank {r}'s list must hold integer dataset indices")
        out.append(list(lst))
    return out
