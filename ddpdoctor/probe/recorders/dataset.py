"""Dataset recorder: what a few fixed indices of each loader's dataset contain on each rank (DD305), and how many
batches of what size each rank's loader will yield per epoch (DD306).

Item digests. At the first iteration of each map-style dataset, items at fixed indices (0, 1, len//2, len-1: the
same on every rank) are read through the dataset's own `__getitem__` in the main process and digested (dtype,
shape and bytes of every tensor/array/image; text and numbers by value). Random augmentation would make the
same sample differ from rank to rank, so every read runs with torch's, numpy's and `random`'s global generators
(and the device generators) seeded to the same constant on every rank, and all their states are restored
afterwards: the script's own random streams are exactly as if nothing had happened. The first index is read three
times (seed A, seed A again, seed B) to learn whether the item is deterministic under a fixed seed (if not, the
dataset draws from a private generator and its digests cannot be compared) and whether it depends on the seed
(the dataset draws randomness: DD304 needs to know), and which global generators `__getitem__` advanced.

Loader plans. At every `iter(loader)`: `len(loader)` (batches this epoch), `len(sampler)`, batch size and
drop_last, as the loader itself reports them: the probe cuts epochs short, so per-rank epoch lengths cannot be
observed by running them out.
"""

from __future__ import annotations

import hashlib
import random
import sys
import time
from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "dataset"
SEED_A = 0x5EED
SEED_B = 0x0DD
SLOW_ITEM_SECONDS = 2.0  # an item slower than this is read once only
PLANS_RECORDED = 64  # loader_plan events per process


def fixed_indices(n: int) -> list[int]:
    return sorted({i for i in (0, 1, n // 2, n - 1) if 0 <= i < n})


# ------------------------------------------------------------------------------------------------ digests


def _update(h: Any, obj: Any, depth: int, counts: dict[str, int]) -> None:
    import torch

    if depth > 6:
        counts["opaque"] += 1
        h.update(b"<deep>")
        return
    if torch.is_tensor(obj):
        t = obj.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.contiguous().cpu()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        counts["tensors"] += 1
        return
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
        counts["tensors"] += 1
        return
    if np is not None and isinstance(obj, np.generic):
        h.update(repr(obj.item()).encode())
        return
    if isinstance(obj, (str, bytes, int, float, bool, complex)) or obj is None:
        h.update(f"{type(obj).__name__}:{obj!r}".encode())
        return
    if isinstance(obj, dict):
        h.update(b"{")
        for k in obj:
            h.update(repr(k).encode())
            _update(h, obj[k], depth + 1, counts)
        h.update(b"}")
        return
    if isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _update(h, v, depth + 1, counts)
        h.update(b"]")
        return
    tobytes = getattr(obj, "tobytes", None)  # PIL images and other buffers
    if callable(tobytes) and hasattr(obj, "size"):
        h.update(f"I{type(obj).__name__}{getattr(obj, 'mode', '')}{obj.size}".encode())
        h.update(tobytes())
        counts["tensors"] += 1
        return
    # An object we cannot read by value: its type only (a repr could hold a memory address, different per rank).
    h.update(f"<{type(obj).__qualname__}>".encode())
    counts["opaque"] += 1


def digest_item(item: Any) -> dict[str, Any]:
    """{digest, parts: digest of each top-level element, tensors, opaque, first: shape/dtype of the first tensor}."""
    counts = {"tensors": 0, "opaque": 0}
    h = hashlib.blake2b(digest_size=12)
    _update(h, item, 0, counts)
    parts = None
    elements = (
        list(item.values()) if isinstance(item, dict) else list(item) if isinstance(item, (list, tuple)) else None
    )
    if elements is not None and 1 < len(elements) <= 8:
        parts = []
        for v in elements:
            ph = hashlib.blake2b(digest_size=12)
            _update(ph, v, 1, {"tensors": 0, "opaque": 0})
            parts.append(ph.hexdigest())
    return {"digest": h.hexdigest(), "parts": parts, **counts, "first": _describe_first(item)}


def _describe_first(item: Any) -> dict[str, Any] | None:
    import torch

    for _ in range(4):
        if torch.is_tensor(item):
            t = item.detach()
            out: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
            if t.numel() and t.dtype.is_floating_point:
                out["mean"] = round(float(t.double().mean()), 6)
            return out
        if isinstance(item, (list, tuple)) and item:
            item = item[0]
        elif isinstance(item, dict) and item:
            item = next(iter(item.values()))
        else:
            return None
    return None


# ------------------------------------------------------------------------------------------------ generators


class GlobalRandomState:
    """Save, seed and restore every global generator a dataset can draw from."""

    def __init__(self) -> None:
        import torch

        from ddpdoctor.probe.recorders.rng import device_generator

        self.torch = torch.default_generator.get_state()
        self.python = random.getstate()
        self.np = sys.modules.get("numpy")
        self.numpy = self.np.random.get_state() if self.np is not None else None
        self.devices: list[tuple[Any, Any]] = []
        if device_generator() is not None:
            try:
                self.devices = [(g, g.get_state()) for g in torch.cuda.default_generators]
            except Exception:
                self.devices = []

    def seed(self, seed: int) -> None:
        import torch

        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        if self.np is not None:
            self.np.random.seed(seed)
        for g, _ in self.devices:
            g.manual_seed(seed)

    def fingerprint(self) -> dict[str, bytes]:
        import torch

        out = {
            "torch": torch.default_generator.get_state().numpy().tobytes(),
            "random": repr(random.getstate()).encode(),
        }
        if self.np is not None:
            out["numpy"] = self.np.random.get_state()[1].tobytes() + repr(self.np.random.get_state()[2:]).encode()
        if self.devices:
            out["device"] = b"".join(g.get_state().numpy().tobytes() for g, _ in self.devices)
        return out

    def restore(self) -> None:
        import torch

        torch.default_generator.set_state(self.torch)
        random.setstate(self.python)
        if self.np is not None and self.numpy is not None:
            self.np.random.set_state(self.numpy)
        for g, s in self.devices:
            g.set_state(s)


# ------------------------------------------------------------------------------------------------ install


def is_index_sharded(sampler: Any) -> bool:
    """A sampler that splits dataset *indices* across ranks (DistributedSampler or a look-alike): it assumes that
    index i is the same sample on every rank."""
    from torch.utils.data import DistributedSampler

    if sampler is None:
        return False
    if isinstance(sampler, DistributedSampler):
        return True
    return hasattr(sampler, "num_replicas") and hasattr(sampler, "rank")


def _index_sampler(loader: Any) -> Any:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if is_index_sharded(sampler):
        return sampler
    inner = getattr(batch_sampler, "sampler", None)
    if is_index_sharded(inner):
        return inner
    if is_index_sharded(batch_sampler):
        return batch_sampler
    return sampler


def _len(obj: Any) -> int | None:
    try:
        return int(len(obj))
    except Exception:
        return None


def install(probe: Probe) -> None:
    import torch
    from torch.utils.data import DataLoader

    state: dict[str, Any] = {"datasets": set(), "loader_seq": {}, "plans": 0}

    def make_iter(orig):
        def __iter__(self):  # noqa: ANN001
            it = orig(self)
            if not probe.ending:
                grad = torch.is_grad_enabled()
                probe.safely("loader_plan", _plan, probe, state, self, grad)
                probe.safely("dataset_items", _items, probe, state, self)
            return it

        return __iter__

    probe.patcher.wrap(DataLoader, "__iter__", make_iter)


def _plan(probe: Probe, state: dict[str, Any], loader: Any, grad: bool) -> None:
    from torch.utils.data import IterableDataset

    lid = probe.registry.id_of(loader)
    seq = state["loader_seq"].get(lid, 0)
    state["loader_seq"][lid] = seq + 1
    if state["plans"] >= PLANS_RECORDED:
        return
    state["plans"] += 1
    iterable = isinstance(loader.dataset, IterableDataset)
    sampler = _index_sampler(loader)
    probe.emit(
        "loader_plan",
        loader=lid,
        iteration=seq,
        site=probe.site(),
        grad_enabled=grad,
        iterable=iterable,
        batches=None if iterable else _len(loader),
        sampler_len=None if iterable else _len(getattr(loader, "sampler", None)),
        dataset_len=_len(loader.dataset),
        batch_size=loader.batch_size,
        drop_last=bool(loader.drop_last),
        sampler_cls=type(sampler).__name__ if sampler is not None else None,
        sharded=is_index_sharded(sampler),
    )


def _subset_chain(dataset: Any) -> list[dict[str, Any]]:
    """Digests of the index lists of nested Subsets (random_split): differing per rank means the split differs."""
    from torch.utils.data import Subset

    chain = []
    while isinstance(dataset, Subset) and len(chain) < 4:
        idx = [int(i) for i in dataset.indices]
        chain.append({"len": len(idx), "digest": hashlib.blake2b(repr(idx).encode(), digest_size=12).hexdigest(),
                      "head": idx[:5]})
        dataset = dataset.dataset
    return chain


def _innermost(dataset: Any) -> Any:
    """The dataset under Subset wrappers (what the user calls their dataset)."""
    from torch.utils.data import Subset

    for _ in range(8):
        if not isinstance(dataset, Subset):
            break
        dataset = dataset.dataset
    return dataset


def _items(probe: Probe, state: dict[str, Any], loader: Any) -> None:
    from torch.utils.data import IterableDataset

    dataset = loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return
    key = probe.registry.id_of(dataset)
    if key in state["datasets"]:
        return
    state["datasets"].add(key)
    n = _len(dataset)
    if not n:
        return
    sampler = _index_sampler(loader)
    fields: dict[str, Any] = {
        "loader": probe.registry.id_of(loader),
        "dataset": key,
        "dataset_cls": type(dataset).__name__,
        "base_cls": type(_innermost(dataset)).__name__,
        "site": probe.site(),
        "len": n,
        "sampler_cls": type(sampler).__name__ if sampler is not None else None,
        "sharded": is_index_sharded(sampler),
        "subsets": _subset_chain(dataset),
    }
    fields.update(read_items(dataset, fixed_indices(n)))
    probe.emit("dataset_items", **fields)


def read_items(dataset: Any, indices: list[int]) -> dict[str, Any]:
    """Digest `dataset[i]` for each index under identically seeded global generators, restoring them afterwards."""
    saved = GlobalRandomState()
    items: list[dict[str, Any]] = []
    info: dict[str, Any] = {"indices": indices, "items": items, "deterministic": None, "seed_dependent": None,
                            "draws_from": [], "error": None}
    t0 = time.perf_counter()
    try:
        for k, i in enumerate(indices):
            saved.seed(SEED_A)
            if k == 0:
                seeded = saved.fingerprint()
            t_item = time.perf_counter()
            first = digest_item(dataset[i])
            slow = time.perf_counter() - t_item > SLOW_ITEM_SECONDS
            if k == 0:
                after = saved.fingerprint()
                info["draws_from"] = sorted(name for name in seeded if seeded[name] != after.get(name))
                if not slow:
                    saved.seed(SEED_A)
                    again = digest_item(dataset[i])
                    saved.seed(SEED_B)
                    other = digest_item(dataset[i])
                    info["deterministic"] = again["digest"] == first["digest"]
                    info["seed_dependent"] = other["digest"] != first["digest"]
            items.append({"index": i, **first})
            if slow:
                break
    except Exception as exc:  # the dataset's own error: record it, never raise it into the script here
        info["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        saved.restore()
    info["seconds"] = round(time.perf_counter() - t0, 4)
    return info
