"""One rank of `ddpdoctor compare-bn` (run as `python -m ddpdoctor.bn._worker JOB.json RANK`).

Every rank builds the model and the dataset from the factories, agrees with its peers on the initial state
(rank 0's, as DDP does) and on the data (same samples at the same indices), then runs the same plan of train-mode
forwards three times:

- `local`: plain per-rank BN with DDP's default buffer broadcast emulated exactly (rank 0's buffers are
  broadcast at the start of each forward, then each rank applies its own update);
- `local_no_broadcast`: plain per-rank BN, nothing shared (`broadcast_buffers=False`);
- `sync`: `sync_batch_norm_forward` (exact global-batch statistics), recording each BN layer's per-rank input
  moments for the non-i.i.d. test.

Rank 0 then runs the exact reference: one process, plain BN, the concatenated global batch of every step.
Only BN layers are in training mode (dropout and friends are in eval mode) so every mode computes the same
function and the comparison isolates the statistics; nothing steps an optimizer.

Results go to files in the job's directory (npz + json per rank); a failure becomes one line in
`rank{R}.error.json` ("usage" for problems with the user's model/data, "internal" for ours). The process leaves
with `os._exit` after flushing: gloo sometimes aborts at interpreter exit otherwise
(docs/facts.md#launching-and-instrumenting-a-script).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import random
import sys
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import numpy as np


class WorkerUsageError(Exception):
    """The user's model, data or options cannot be compared; the message is the one line the user sees."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# --------------------------------------------------------------------------------------------- factories


def load_factory(spec: str, option: str) -> Callable[[], Any]:
    """`MODULE:FACTORY` where MODULE is a dotted module (importable from the current directory) or a .py path."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise WorkerUsageError(f"{option} {spec!r}: expected MODULE:FACTORY (a dotted module or a .py file)")
    try:
        if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
            path = Path(module_part).resolve()
            if not path.is_file():
                raise WorkerUsageError(f"{option} {spec!r}: {module_part}: no such file")
            name = f"_ddpdoctor_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
            mod_spec = importlib.util.spec_from_file_location(name, path)
            if mod_spec is None or mod_spec.loader is None:
                raise WorkerUsageError(f"{option} {spec!r}: cannot load {module_part} as Python")
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module
            sys.path.insert(0, str(path.parent))  # the file's sibling imports work as when run as a script
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_part)
    except WorkerUsageError:
        raise
    except ModuleNotFoundError as exc:
        raise WorkerUsageError(f"{option} {spec!r}: cannot import {module_part}: {_first_line(exc)}") from None
    except BaseException as exc:  # the user's module raised while importing (SyntaxError included)
        raise WorkerUsageError(f"{option} {spec!r}: importing {module_part} raised {_first_line(exc)}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise WorkerUsageError(f"{option} {spec!r}: {module_part} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise WorkerUsageError(f"{option} {spec!r}: {attr} is not callable")
    return obj


def _call_factory(factory: Callable[[], Any], spec: str, option: str) -> Any:
    try:
        return factory()
    except BaseException as exc:
        raise WorkerUsageError(f"{option} {spec!r}: the factory raised {_first_line(exc)}") from None


# ------------------------------------------------------------------------------------------------- data


class Samples:
    """Indexing the user's dataset reproducibly: every item is loaded under a seed derived from (step, index),
    so a random augmentation gives the same sample to every mode and to the reference."""

    def __init__(self, dataset: Any, seed: int, torch_mod: Any) -> None:
        self.dataset = dataset
        self.seed = seed
        self.torch = torch_mod

    def item(self, index: int, step: int) -> Any:
        s = (self.seed * 1_000_003 + (step + 1) * 7_919 + index * 104_729) % (2**31 - 1)
        random.seed(s)
        np.random.seed(s)
        self.torch.manual_seed(s)
        try:
            return self.dataset[index]
        except BaseException as exc:
            raise WorkerUsageError(f"the dataset raised on item {index}: {_first_line(exc)}") from None

    @staticmethod
    def split(item: Any) -> tuple[Any, Any]:
        if isinstance(item, (tuple, list)):
            return item[0], (item[1] if len(item) > 1 else None)
        return item, None

    def inputs(self, indices: tuple[int, ...], step: int) -> Any:
        from torch.utils.data import default_collate

        xs = [self.split(self.item(i, step))[0] for i in indices]
        try:
            return default_collate(xs)
        except BaseException as exc:
            raise WorkerUsageError(f"cannot batch the dataset's samples: {_first_line(exc)}") from None

    def labels(self) -> list[Any]:
        n = len(self.dataset)
        for attr in ("targets", "labels"):
            values = getattr(self.dataset, attr, None)
            if values is not None:
                try:
                    if len(values) == n:
                        return [_scalar(v) for v in values]
                except TypeError:
                    pass
        out = []
        for i in range(n):
            _, y = self.split(self.item(i, -1))
            if y is None:
                raise WorkerUsageError(
                    "--shard sorted needs labels: the dataset's items are x, not (x, y), and it has no `targets`"
                )
            out.append(_scalar(y))
        return out


def _scalar(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        return v.item()
    if isinstance(v, np.ndarray) and v.size == 1:
        return v.item()
    return v if isinstance(v, (int, float, str)) else str(v)


def _to_device(batch: Any, device: Any) -> Any:
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


# ------------------------------------------------------------------------------------ model, data, device


def build_dataset(spec: str | None, seed: int) -> tuple[Any, int]:
    """The user's map-style dataset (or the demo's) and its length; WorkerUsageError with one line otherwise."""
    import torch

    if spec:
        dataset = _call_factory(load_factory(spec, "--data"), spec, "--data")
    else:
        from ddpdoctor.bn.demo import demo_data

        dataset = demo_data(seed)
    if isinstance(dataset, torch.utils.data.IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    ):
        raise WorkerUsageError(
            f"--data {spec!r}: the factory returned {type(dataset).__name__}; compare-bn needs a map-style "
            "Dataset (len() and indexing)"
        )
    try:
        n_items = int(len(dataset))
    except BaseException as exc:
        raise WorkerUsageError(f"--data {spec!r}: len(dataset) raised {_first_line(exc)}") from None
    return dataset, n_items


def build_model(spec: str | None, seed: int) -> tuple[Any, list[tuple[str, Any]]]:
    """The user's model (or the demo's), seeded, and its BN layers; WorkerUsageError with one line otherwise."""
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    torch.manual_seed(seed)
    if spec:
        model = _call_factory(load_factory(spec, "--model"), spec, "--model")
    else:
        from ddpdoctor.bn.demo import demo_model

        model = demo_model()
    if not isinstance(model, torch.nn.Module):
        raise WorkerUsageError(
            f"--model {spec!r}: the factory returned {type(model).__name__}, not a torch.nn.Module"
        )
    bn_layers = [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if not bn_layers:
        raise WorkerUsageError(f"--model {spec!r}: the model has no batch-norm layers (nothing to compare)")
    return model, bn_layers


def resolve_device(requested: str, world: int, rank: int) -> tuple[Any, str]:
    """auto: one GPU per rank with NCCL when enough are visible, else CPU with gloo. cuda without enough GPUs is
    a usage error, not a silent fallback."""
    import torch

    gpus = torch.cuda.device_count() if requested != "cpu" else 0
    if requested == "cuda":
        if gpus == 0:
            raise WorkerUsageError("--device cuda: no CUDA GPU is visible here (use --device cpu or auto)")
        if gpus < world:
            raise WorkerUsageError(
                f"--device cuda: {world} ranks need {world} GPUs, {gpus} visible (lower --nproc or use --device cpu)"
            )
    if requested == "cuda" or (requested == "auto" and gpus >= world):
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


# ------------------------------------------------------------------------------------------------ ranks


class Rank:
    def __init__(self, job: dict[str, Any], rank: int) -> None:
        self.job = job
        self.rank = rank
        self.world = int(job["nproc"])
        self.out = Path(job["out_dir"])
        self.timings: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def phase(self, text: str) -> None:
        try:
            (self.out / f"rank{self.rank}.phase").write_text(text, encoding="utf-8")
        except OSError:
            pass

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self._t0, 4)
        self._t0 = now

    def run(self) -> None:
        self.phase("importing torch")
        import torch
        import torch.distributed as dist

        from ddpdoctor.bn.plan import build_plan
        from ddpdoctor.bn.syncbn import local_batch_norm_forward, sync_batch_norm_forward

        self.lap("import")
        job = self.job
        torch.set_num_threads(max(1, int(job.get("threads", 1))))

        device, backend = resolve_device(job["device"], self.world, self.rank)

        self.phase("building the dataset")
        dataset, n_items = build_dataset(job.get("data"), int(job["seed"]))
        samples = Samples(dataset, int(job["seed"]), torch)
        if job["shard"] == "sorted":
            self.phase("reading labels for --shard sorted")
        labels = samples.labels() if job["shard"] == "sorted" else None
        try:
            plan = build_plan(
                job["shard"],
                n_items=n_items,
                nproc=self.world,
                batch_size=int(job["batch_size"]),
                steps=int(job["steps"]),
                seed=int(job["seed"]),
                labels=labels,
                rank_lists=job.get("rank_lists"),
            )
        except ValueError as exc:
            raise WorkerUsageError(str(exc)) from None

        self.phase("building the model")
        model, bn_layers = build_model(job.get("model"), int(job["seed"]))
        model.to(device)
        batches = [_to_device(samples.inputs(plan.rank_batch(s, self.rank), s), device) for s in range(len(plan.steps))]
        if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in model.parameters()):
            model.eval()
            with torch.no_grad():
                forward_or_usage_error(model, batches[0])
        self.lap("setup")

        self.phase("joining the process group")
        dist.init_process_group(
            backend,
            init_method=job["init_method"],
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=max(30.0, float(job["timeout"]))),
        )
        self.lap("rendezvous")
        self._check_same_data(samples, n_items, dist)
        with torch.no_grad():
            self._broadcast(list(model.state_dict().values()), dist)  # rank 0's initial state, as DDP does
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        results: dict[str, np.ndarray] = {}
        self._save_buffers(results, "initial", bn_layers)

        def set_mode(fn: Callable[..., Any]) -> None:
            model.eval()  # dropout & co. deterministic: every mode computes the same function
            for _, m in bn_layers:
                m.train()
                m.forward = types.MethodType(fn, m)
            model.load_state_dict(initial)

        local_fn = lambda m, x: local_batch_norm_forward(m, x)  # noqa: E731
        sync_fn = lambda m, x: sync_batch_norm_forward(m, x)  # noqa: E731
        buffers = [b for b in model.buffers()]

        for mode, fn, broadcast in (
            ("local", local_fn, True),
            ("local_no_broadcast", local_fn, False),
            ("local_reduce", local_fn, False),
            ("sync", sync_fn, False),
        ):
            set_mode(fn)
            moments: dict[str, list[tuple[float, np.ndarray, np.ndarray]]] = {name: [] for name, _ in bn_layers}
            handles = []
            if mode == "sync":
                handles = [m.register_forward_pre_hook(_moment_hook(moments[name], torch)) for name, m in bn_layers]
            with torch.no_grad():
                for step, batch in enumerate(batches):
                    self.phase(f"mode {mode}, step {step + 1}/{len(batches)}")
                    if broadcast:
                        self._broadcast(buffers, dist)
                    forward_or_usage_error(model, batch)
            for h in handles:
                h.remove()
            if mode == "local_reduce":
                # timm's `--dist-bn reduce` (distribute_bn(reduce=True)) at the end of the epoch: every rank's
                # running_mean and running_var all-reduced and divided by the world size
                with torch.no_grad():
                    for _, m in bn_layers:
                        for buf in (m.running_mean, m.running_var):
                            if buf is not None:
                                dist.all_reduce(buf)
                                buf /= dist.get_world_size()
            self._save_buffers(results, mode, bn_layers)
            if mode == "sync":
                for name, recs in moments.items():
                    results[f"moments|{name}|count"] = np.array([r[0] for r in recs], dtype=np.float64)
                    results[f"moments|{name}|mean"] = np.array([r[1] for r in recs], dtype=np.float64).reshape(len(recs), -1)
                    results[f"moments|{name}|var"] = np.array([r[2] for r in recs], dtype=np.float64).reshape(len(recs), -1)
            self.lap(mode)
        dist.barrier()
        self.lap("barrier")

        if self.rank == 0:
            self.phase("exact reference")
            torch.set_num_threads(max(1, int(job.get("reference_threads", 1))))
            set_mode(local_fn)
            with torch.no_grad():
                for step in range(len(plan.steps)):
                    batch = _to_device(samples.inputs(plan.global_batch(step), step), device)
                    forward_or_usage_error(model, batch)
            self._save_buffers(results, "reference", bn_layers)
            self.lap("reference")

        meta = {
            "rank": self.rank,
            "device": str(device),
            "backend": backend,
            "torch": torch.__version__,
            "n_items": n_items,
            "plan_sizes": plan.rank_sizes,
            "layers": [
                {
                    "layer": name,
                    "features": int(m.num_features),
                    "kind": type(m).__name__,
                    "momentum": m.momentum,
                    "eps": m.eps,
                    "track_running_stats": bool(m.track_running_stats),
                    "calls": len(results.get(f"moments|{name}|count", ())),
                }
                for name, m in bn_layers
            ],
            "timings": self.timings,
        }
        np.savez(self.out / f"rank{self.rank}.npz", **results)
        (self.out / f"rank{self.rank}.json").write_text(json.dumps(meta), encoding="utf-8")
        self.phase("done")

    # ---------------------------------------------------------------------------------------- helpers

    def _broadcast(self, tensors: list[Any], dist: Any) -> None:
        """Broadcast from rank 0, coalesced per dtype (one collective per dtype, like DDP's buffer sync)."""
        import torch

        by_dtype: dict[Any, list[Any]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            dist.broadcast(flat, src=0)
            offset = 0
            for t in group:
                n = t.numel()
                t.detach().copy_(flat[offset : offset + n].view_as(t))
                offset += n

    def _check_same_data(self, samples: Samples, n_items: int, dist: Any) -> None:
        """Every rank must see the same sample at the same index, or the comparison compares different data."""
        import torch

        probes = sorted({0, n_items // 2, n_items - 1})
        digest = []
        for i in probes:
            x = samples.inputs((i,), -2)
            t = x if isinstance(x, torch.Tensor) else torch.as_tensor(0.0)
            t = t.detach().to(torch.float64)
            digest.append([float(t.sum()), float((t * t).sum()), list(t.shape)])
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, [n_items, digest])
        for r, (n, d) in enumerate(gathered):
            if n != n_items:
                raise WorkerUsageError(f"the data factory gives {n_items} samples on rank 0 and {n} on rank {r}")
            for i, (a, b) in enumerate(zip(gathered[0][1], d)):
                if a != b:
                    raise WorkerUsageError(
                        f"the data factory builds different data on different ranks (sample {probes[i]} differs "
                        f"between rank 0 and rank {r}): seed it so every rank builds the same dataset"
                    )

    @staticmethod
    def _save_buffers(results: dict[str, np.ndarray], mode: str, bn_layers: list[tuple[str, Any]]) -> None:
        for name, m in bn_layers:
            if m.running_mean is not None:
                results[f"{mode}|{name}|running_mean"] = _np(m.running_mean)
                results[f"{mode}|{name}|running_var"] = _np(m.running_var)
            if m.num_batches_tracked is not None:
                results[f"{mode}|{name}|num_batches_tracked"] = np.array(int(m.num_batches_tracked))


def forward_or_usage_error(model: Any, batch: Any) -> None:
    """Run the user's forward; its own failures (shapes, dtypes) become one-line usage errors, while failures in
    a collective (a peer died, a timeout) keep their kind."""
    try:
        model(batch)
    except WorkerUsageError:
        raise
    except (ValueError, RuntimeError, TypeError, IndexError, KeyError, AttributeError) as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        if any("torch/distributed" in f.filename.replace(os.sep, "/") for f in frames):
            raise
        raise WorkerUsageError(f"the model's forward failed on the data: {_first_line(exc)}") from None


def _np(t: Any) -> np.ndarray | None:
    if t is None:
        return None
    return t.detach().to("cpu").double().numpy().copy()


def _moment_hook(sink: list, torch: Any) -> Callable[..., None]:
    def hook(module: Any, args: tuple) -> None:
        if not args or not hasattr(args[0], "detach"):
            return
        x = args[0].detach()
        dims = [0, *range(2, x.dim())]
        channels = x.size(1)
        count = x.numel() // channels if channels else 0
        if count == 0:
            sink.append((0.0, np.full(channels, np.nan), np.full(channels, np.nan)))
            return
        xa = x.double() if x.dtype == torch.float64 else x.float()
        var, mean = torch.var_mean(xa, dim=dims, correction=0)
        sink.append((float(count), _np(mean), _np(var)))

    return hook


def main(argv: list[str]) -> None:
    job_path, rank_text = argv
    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    rank = int(rank_text)
    out = Path(job["out_dir"])
    code = 0
    try:
        Rank(job, rank).run()
    except WorkerUsageError as exc:
        _write_error(out, rank, "usage", str(exc))
        code = 2
    except BaseException as exc:  # noqa: BLE001 - reported as one line; the traceback goes to the rank's log
        traceback.print_exc()
        _write_error(out, rank, "internal", _first_line(exc))
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _write_error(out: Path, rank: int, kind: str, message: str) -> None:
    try:
        (out / f"rank{rank}.error.json").write_text(
            json.dumps({"rank": rank, "kind": kind, "message": message}), encoding="utf-8"
        )
    except OSError:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
