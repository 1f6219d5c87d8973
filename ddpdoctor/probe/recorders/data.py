"""Data recorder: samplers (construction, set_epoch, each DistributedSampler order), DataLoader iterations (where
the loop is, batch sizes, indices drawn) — and the probe's epoch/step limit, which lives where epochs are visible.

The limit: a training iteration (one during which optimizer steps happen) is cut after S steps by ending the
loader's iterator early (StopIteration, as if the epoch were over), so the script runs its own end-of-epoch code
(set_epoch, evaluation, checkpoints). Evaluation iterations (no grad, or every DDP model in eval mode) are cut
after S batches. When a loop site is about to start its (E+1)-th training iteration, the run ends cleanly.

Index orders are stored compactly in the process's binary side file: a DistributedSampler's whole order for an
epoch up to ORDER_CAP indices, beyond that a consistent 1/K sample (index i kept iff hash(i) % K == 0, the same
rule on every rank and epoch, so overlaps estimated on it are unbiased).

Indices are recorded in the index space of the dataset under any `Subset` wrappers (nested ones composed): a rank
that iterates `Subset(ds, range(rank * n, (rank + 1) * n))` draws positions 0..n-1 of its own Subset, which are
different samples on every rank. Mapped to `ds`, overlaps between ranks measure shared samples, not shared
positions. Events say how many Subsets were unwrapped (`subset_depth`) and the length of the dataset underneath.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from array import array
from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "data"
ORDER_CAP = 1 << 17
INDICES_CAP = 1 << 18
HEAD = 8
HASH_MULT = 2654435761


def _kind(sampler: Any) -> str:
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    if isinstance(sampler, DistributedSampler):
        return "distributed"
    if isinstance(sampler, RandomSampler):
        return "random"
    if isinstance(sampler, SequentialSampler):
        return "sequential"
    return "other"


def index_sampler(loader: Any) -> Any:
    """What decides the indices a DataLoader draws: its sampler — unless it was given a `batch_sampler=`, whose
    batches are the indices (DataLoader's `sampler` is then an unused default SequentialSampler). torch's own
    BatchSampler is its inner sampler's order in chunks (that sampler decides); any other batch sampler (a custom
    distributed or grouped one) decides itself."""
    from torch.utils.data import BatchSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(loader, "sampler", None)
    if batch_sampler is None:
        return sampler
    if type(batch_sampler) is BatchSampler:
        return getattr(batch_sampler, "sampler", None) or sampler
    return batch_sampler


def _len(obj: Any) -> int | None:
    try:
        return int(len(obj))
    except Exception:
        return None


def batch_size_of(batch: Any) -> int | None:
    """Samples in a collated batch: the leading dimension of its first tensor."""
    import torch

    for _ in range(8):
        if torch.is_tensor(batch):
            return int(batch.shape[0]) if batch.dim() else 1
        if isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        elif isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        else:
            break
    return _len(batch)


def consistent_sample(indices: Any, dataset_len: int | None) -> tuple[Any, int | None]:
    """(int64 tensor of the kept indices in order, K or None when all are kept). `indices`: a list or a tensor."""
    import torch

    t = indices.to(torch.int64) if torch.is_tensor(indices) else torch.tensor(indices, dtype=torch.int64)
    if len(t) <= ORDER_CAP:
        return t, None
    k = max(2, math.ceil((dataset_len or len(t)) / ORDER_CAP))
    mask = ((t * HASH_MULT) % (1 << 32)) % k == 0
    return t[mask], k


class SubsetMap:
    """Where a dataset's indices point in the dataset under its Subset wrappers: `base[i]` for position i (None
    when the dataset is not a Subset), `depth` Subsets unwrapped, `base_len` the length underneath."""

    __slots__ = ("base", "depth", "base_len")

    def __init__(self, base: Any, depth: int, base_len: int | None) -> None:
        self.base, self.depth, self.base_len = base, depth, base_len

    def apply(self, indices: Any) -> Any:
        """Map positions (a list or an int64 tensor) to base indices; unchanged without a Subset."""
        import torch

        t = indices if torch.is_tensor(indices) else torch.tensor(indices, dtype=torch.int64)
        return t if self.base is None else self.base[t]


_NO_SUBSET = SubsetMap(None, 0, None)
_SUBSET_MAPS: dict[int, tuple[Any, SubsetMap]] = {}


def _subset_indices(indices: Any) -> Any:
    import torch

    if isinstance(indices, range):
        return torch.arange(indices.start, indices.stop, indices.step, dtype=torch.int64)
    if torch.is_tensor(indices):
        return indices.to(torch.int64).reshape(-1)
    return torch.as_tensor(indices if hasattr(indices, "__array__") else list(indices)).to(torch.int64).reshape(-1)


def subset_map(dataset: Any) -> SubsetMap:
    """The composed index map of nested `Subset`s (computed once per dataset object)."""
    from torch.utils.data import Subset

    if not isinstance(dataset, Subset):
        return _NO_SUBSET
    cached = _SUBSET_MAPS.get(id(dataset))
    if cached is not None and cached[0]() is dataset:
        return cached[1]
    base = None
    depth = 0
    inner = dataset
    while isinstance(inner, Subset) and depth < 8:
        idx = _subset_indices(inner.indices)
        base = idx if base is None else idx[base]
        inner = inner.dataset
        depth += 1
    result = SubsetMap(base, depth, _len(inner))
    try:
        _SUBSET_MAPS[id(dataset)] = (weakref.ref(dataset), result)
    except TypeError:
        pass
    return result


class _Iteration:
    __slots__ = (
        "it_ref", "loader", "it", "site_key", "site_seq", "grad_enabled", "steps_at_start", "batches", "sizes",
        "grad_batches", "training", "closed", "indices", "indices_ok", "indices_count", "counted_open", "subset",
    )

    def __init__(
        self, it: Any, loader: int, it_id: int, site_key: tuple[str, int], site_seq: int, grad: bool, steps: int
    ) -> None:
        self.it_ref = weakref.ref(it)
        self.loader = loader
        self.it = it_id
        self.site_key = site_key
        self.site_seq = site_seq
        self.grad_enabled = grad
        self.steps_at_start = steps
        self.batches = 0
        self.sizes: list[list[int]] = []
        self.grad_batches = 0
        self.training = False
        self.closed = False
        self.indices = array("q")
        self.indices_ok = True
        self.indices_count = 0
        self.counted_open = False
        self.subset = _NO_SUBSET


class _State:
    def __init__(self) -> None:
        self.iterations: dict[int, _Iteration] = {}  # id(iterator) -> current iteration
        self.by_loader: dict[int, _Iteration] = {}  # loader probe id -> its current iteration
        self.loader_seq: dict[int, int] = {}
        self.site_seq: dict[tuple[str, int], int] = {}
        self.sampler_seq: dict[int, int] = {}
        self.loader_sites: dict[int, tuple[Any, Any]] = {}  # id(loader) -> (weakref, site)
        self.counted_rounds: set[tuple[tuple[str, int], int]] = set()  # (site, round) counted as a training epoch
        self.loader_epochs: dict[int, int] = {}  # loader probe id -> training iterations completed


def install(probe: Probe) -> None:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    state = _State()
    s = probe.settings

    # -- samplers
    def make_sampler_init(orig):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            probe.safely("sampler_created", _sampler_created, probe, self)

        return __init__

    for cls in (DistributedSampler, RandomSampler, SequentialSampler):
        probe.patcher.wrap(cls, "__init__", make_sampler_init)

    def make_set_epoch(orig):
        def set_epoch(self, epoch: int) -> None:
            orig(self, epoch)
            probe.safely("set_epoch", lambda: probe.emit(
                "set_epoch", sampler=probe.registry.id_of(self), epoch=_scalar_int(epoch), site=probe.site()))

        return set_epoch

    probe.patcher.wrap(DistributedSampler, "set_epoch", make_set_epoch)

    def make_dist_iter(orig):
        def __iter__(self):  # noqa: ANN001
            it = orig(self)
            if probe.ending:
                return it
            indices = list(it)  # DistributedSampler builds the whole list anyway; same values, same order
            probe.safely("sampler_iter", _sampler_iter, probe, state, self, indices)
            return iter(indices)

        return __iter__

    probe.patcher.wrap(DistributedSampler, "__iter__", make_dist_iter)

    # -- loaders
    def make_loader_init(orig):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            probe.safely("loader_created", _loader_created, probe, state, self)

        return __init__

    probe.patcher.wrap(DataLoader, "__init__", make_loader_init)

    def make_loader_iter(orig):
        def __iter__(self):  # noqa: ANN001
            site = probe.site()
            site_key = (site["file"], site["line"]) if site else ("?", 0)
            lid = probe.registry.id_of(self)
            probe.safely("loader close", _close_site, probe, state, site_key, lid)
            # an epoch is a training pass of this loop site (loaders re-created every epoch) or of this loader
            # (iterated from more than one place: `it = iter(loader)` before the loop, again on StopIteration)
            if (
                s.limited
                and not probe.ending
                and max(probe.training_site_epochs.get(site_key, 0), state.loader_epochs.get(lid, 0)) >= s.epochs
            ):
                probe.end_run("epochs observed")
            it = orig(self)
            probe.safely("loader_iter", _loader_iter, probe, state, self, it, site, site_key, torch.is_grad_enabled())
            return it

        return __iter__

    probe.patcher.wrap(DataLoader, "__iter__", make_loader_iter)

    def make_next(orig):
        def __next__(self):  # noqa: ANN001
            cur = state.iterations.get(id(self))
            if cur is not None and (cur.closed or cur.it_ref() is not self):
                cur = None
            if cur is not None and s.limited and not probe.ending:
                if _should_cut(probe, cur):
                    probe.safely("loader cut", _close, probe, state, cur, "cut")
                    raise StopIteration
            try:
                batch = orig(self)
            except StopIteration:
                if cur is not None:
                    probe.safely("loader end", _close, probe, state, cur, "exhausted")
                raise
            if cur is not None:
                probe.safely("loader batch", _batch, probe, cur, batch, torch.is_grad_enabled())
            return batch

        return __next__

    probe.patcher.wrap(_BaseDataLoaderIter, "__next__", make_next)

    def make_next_index(orig):
        def _next_index(self):  # noqa: ANN001
            index = orig(self)
            cur = state.iterations.get(id(self))
            if cur is not None and cur.indices_ok and not cur.closed:
                try:
                    if isinstance(index, int):
                        cur.indices.append(index)
                        cur.indices_count += 1
                    else:
                        cur.indices_count += len(index)
                        if len(cur.indices) < INDICES_CAP:
                            cur.indices.extend(index)
                except (TypeError, OverflowError):
                    cur.indices_ok = False
            return index

        return _next_index

    probe.patcher.wrap(_BaseDataLoaderIter, "_next_index", make_next_index)
    probe.end_hooks.append(lambda: _close_all(probe, state))


def _scalar_int(value: Any) -> Any:
    try:
        return int(value)
    except Exception:
        return repr(value)[:60]


def _sampler_created(probe: Probe, sampler: Any) -> None:
    kind = _kind(sampler)
    fields: dict[str, Any] = {
        "sampler": probe.registry.id_of(sampler),
        "cls": type(sampler).__name__,
        "sampler_kind": kind,
        "site": probe.site(),
    }
    if kind == "distributed":
        fields.update(
            len=_len(sampler.dataset),
            num_replicas=sampler.num_replicas,
            sampler_rank=sampler.rank,
            shuffle=bool(sampler.shuffle),
            seed=_scalar_int(sampler.seed),
            drop_last=bool(sampler.drop_last),
            num_samples=sampler.num_samples,
        )
    elif kind == "random":
        fields.update(
            len=_len(sampler.data_source),
            replacement=bool(sampler.replacement),
            num_samples=_scalar_int(sampler.num_samples),
            generator=sampler.generator is not None,
        )
    elif kind == "sequential":
        fields.update(len=_len(sampler.data_source))
    probe.emit("sampler_created", **fields)


def _sampler_iter(probe: Probe, state: _State, sampler: Any, indices: list[int]) -> None:
    sid = probe.registry.id_of(sampler)
    seq = state.sampler_seq.get(sid, 0)
    state.sampler_seq[sid] = seq + 1
    dataset_len = _len(sampler.dataset)
    smap = subset_map(sampler.dataset)
    mapped = smap.apply(indices)
    kept, k = consistent_sample(mapped, smap.base_len if smap.depth else dataset_len)
    raw = kept.numpy().tobytes()
    digest = hashlib.blake2b(mapped.numpy().tobytes() if k is not None else raw, digest_size=16).hexdigest()
    ref = probe.blob(raw, dtype="int64", count=int(kept.numel()))
    probe.emit(
        "sampler_iter",
        sampler=sid,
        iteration=seq,
        epoch=_scalar_int(sampler.epoch),
        count=len(indices),
        digest=digest,
        head=[int(i) for i in mapped[:HEAD].tolist()],
        order=ref,
        sample_mod=k,
        num_replicas=sampler.num_replicas,
        sampler_rank=sampler.rank,
        shuffle=bool(sampler.shuffle),
        seed=_scalar_int(sampler.seed),
        dataset_len=dataset_len,
        subset_depth=smap.depth,
        base_len=smap.base_len if smap.depth else dataset_len,
    )


def _loader_created(probe: Probe, state: _State, loader: Any) -> None:
    lid = probe.registry.id_of(loader)
    site = probe.site()
    state.loader_sites[id(loader)] = (weakref.ref(loader), site)
    sampler = index_sampler(loader)
    smap = subset_map(loader.dataset)
    subset = None
    if smap.depth:
        kept, k = consistent_sample(smap.base, smap.base_len)
        subset = {
            "depth": smap.depth,
            "base_len": smap.base_len,
            "len": int(smap.base.numel()),
            "indices": probe.blob(kept.numpy().tobytes(), dtype="int64", count=int(kept.numel())),
            "sample_mod": k,
        }
    probe.emit(
        "loader_created",
        loader=lid,
        site=site,
        subset=subset,
        batch_size=loader.batch_size,
        drop_last=bool(loader.drop_last),
        num_workers=int(loader.num_workers),
        sampler=probe.registry.id_of(sampler) if sampler is not None else None,
        sampler_cls=type(sampler).__name__ if sampler is not None else None,
        sampler_kind=_kind(sampler) if sampler is not None else None,
        dataset_cls=type(loader.dataset).__name__,
        dataset_len=_len(loader.dataset),
    )


def _loader_iter(
    probe: Probe, state: _State, loader: Any, it: Any, site: Any, site_key: tuple[str, int], grad: bool
) -> None:
    lid = probe.registry.id_of(loader)
    seq = state.loader_seq.get(lid, 0)
    state.loader_seq[lid] = seq + 1
    # loaders started together at one site (`zip(loader_a, loader_b)`) are one round of that loop
    together = [c for c in state.iterations.values() if not c.closed and c.site_key == site_key and c.batches == 0]
    if together:
        site_seq = together[0].site_seq
    else:
        site_seq = state.site_seq.get(site_key, 0)
        state.site_seq[site_key] = site_seq + 1
    it_id = probe.registry.new_id()
    cur = _Iteration(it, lid, it_id, site_key, site_seq, grad, probe.steps)
    cur.subset = subset_map(loader.dataset)
    if grad:
        cur.counted_open = True
        probe.open_training_iterations += 1
    state.iterations[id(it)] = cur
    state.by_loader[lid] = cur
    sampler = index_sampler(loader)
    batch_sampler = getattr(loader, "batch_sampler", None)
    probe.emit(
        "loader_iter",
        loader=lid,
        it=it_id,
        loader_seq=seq,
        site=site,
        site_seq=site_seq,
        dataset_cls=type(loader.dataset).__name__,
        dataset_len=_len(loader.dataset),
        batch_size=loader.batch_size,
        drop_last=bool(loader.drop_last),
        num_workers=int(loader.num_workers),
        sampler=probe.registry.id_of(sampler) if sampler is not None else None,
        sampler_cls=type(sampler).__name__ if sampler is not None else None,
        sampler_kind=_kind(sampler) if sampler is not None else None,
        batch_sampler_cls=type(batch_sampler).__name__ if batch_sampler is not None else None,
        sampler_len=_len(sampler) if sampler is not None else None,
        sampler_yields="batches" if sampler is not None and sampler is batch_sampler else "indices",
        grad_enabled=grad,
        created_site=(state.loader_sites.get(id(loader)) or (None, None))[1],
    )


def _should_cut(probe: Probe, cur: _Iteration) -> bool:
    import torch

    s = probe.settings
    steps = probe.steps - cur.steps_at_start
    if steps > 0:
        cur.training = True
        return steps >= s.steps
    evaluating = not torch.is_grad_enabled() or probe.registry.all_models_in_eval()
    if evaluating:
        return cur.batches >= s.steps
    # grad enabled but no optimizer step yet: gradient accumulation, or a loop without an optimizer
    return cur.batches >= max(64, 4 * s.steps)


def _batch(probe: Probe, cur: _Iteration, batch: Any, grad: bool) -> None:
    cur.batches += 1
    size = batch_size_of(batch)
    size = -1 if size is None else size
    if cur.sizes and cur.sizes[-1][0] == size:
        cur.sizes[-1][1] += 1
    else:
        cur.sizes.append([size, 1])
    if grad:
        cur.grad_batches += 1
        probe.counters["train_batches"] += 1
    if probe.steps > cur.steps_at_start:
        cur.training = True
    if cur.training or grad:
        probe.epoch = max(probe.epoch, cur.site_seq)


def _close(probe: Probe, state: _State, cur: _Iteration, reason: str) -> None:
    if cur.closed:
        return
    cur.closed = True
    steps = probe.steps - cur.steps_at_start
    if steps > 0:
        cur.training = True
    if cur.counted_open:
        probe.open_training_iterations = max(0, probe.open_training_iterations - 1)
    if cur.training:
        state.loader_epochs[cur.loader] = state.loader_epochs.get(cur.loader, 0) + 1
    if cur.training and (cur.site_key, cur.site_seq) not in state.counted_rounds:
        state.counted_rounds.add((cur.site_key, cur.site_seq))
        probe.training_site_epochs[cur.site_key] = probe.training_site_epochs.get(cur.site_key, 0) + 1
    if cur.training:
        probe.epochs_observed = max(
            probe.epochs_observed, state.loader_epochs[cur.loader], probe.training_site_epochs[cur.site_key]
        )
    ref = None
    depth = cur.subset.depth
    if cur.indices_ok and len(cur.indices):
        data = cur.indices.tobytes()
        if depth:
            data = probe.safely("subset indices", _map_drawn, cur.subset, data)
            if data is None:  # keep the positions rather than lose the iteration's record
                data, depth = cur.indices.tobytes(), 0
        ref = probe.blob(data, dtype="int64", count=len(cur.indices))
    probe.emit(
        "loader_iter_end",
        loader=cur.loader,
        it=cur.it,
        batches=cur.batches,
        sizes=cur.sizes,
        steps=steps,
        training=cur.training,
        grad_batches=cur.grad_batches,
        reason=reason,
        indices=ref,
        indices_count=cur.indices_count if cur.indices_ok else None,
        subset_depth=depth,
    )


def _map_drawn(subset: SubsetMap, data: bytes) -> bytes:
    import torch

    return subset.apply(torch.frombuffer(bytearray(data), dtype=torch.int64)).numpy().tobytes()


def _close_site(probe: Probe, state: _State, site_key: tuple[str, int], loader: int) -> None:
    """A new iteration of a loader, or a new round of a loop site, closes what the previous one left open
    (`break`); loaders started together at one site (zip) are not closed by each other."""
    for cur in list(state.iterations.values()):
        if not cur.closed and (cur.loader == loader or (cur.site_key == site_key and cur.batches > 0)):
            _close(probe, state, cur, "abandoned")
    for key in [k for k, cur in state.iterations.items() if cur.closed]:
        del state.iterations[key]


def _close_all(probe: Probe, state: _State) -> None:
    for cur in list(state.iterations.values()):
        _close(probe, state, cur, "open at end")
