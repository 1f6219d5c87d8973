"""Horovod's collective operations (`horovod.torch.mpi_ops`) on torch.distributed.

Semantics kept from Horovod 0.28 (horovod/torch/mpi_ops.py):
- `allreduce`, `allgather`, `broadcast`, `alltoall`, `reducescatter` return a new tensor and never modify their
  input; the `_` variants (`allreduce_`, `broadcast_`) work in place. A script that calls `hvd.allreduce(t)` and
  ignores the result keeps its local `t`.
- `op` defaults to Average (sum, then divided by the number of processes); the deprecated `average=` still works,
  and passing both raises. `prescale_factor` multiplies before the sum, `postscale_factor` after it. Integer
  tensors are scaled in floating point and truncated back, as Horovod's CPU scaling does.
- The autograd rules: the gradient of `allreduce` is the allreduce (same op) of the gradient; of `allgather` and
  `broadcast`, the *average* of the gradients (broadcast: zero except on the root), as Horovod defines them.
- `allgather` accepts a different first dimension on each rank; other dimensions must match.
- Tensors must be contiguous; bool tensors are refused, as Horovod refuses them.
- Asynchronous calls return a handle; `synchronize(handle)` returns the output, `poll(handle)` is True.

Differences (also in the README): every operation runs synchronously when called, in call order — Horovod
negotiates the order of named operations across ranks, so a script whose ranks submit them in different orders
runs under Horovod and hangs here; `join()` is a barrier (it does not feed zeros for ranks that ran out of data);
Adasum and elastic training are not reproduced; timelines are not written.

Size: one module, as Horovod's own mpi_ops.py is one module: scripts import its names from `horovod.torch.mpi_ops`,
and the operations share the job state, the handle table, the per-site recording and the reduction helpers.
"""

from __future__ import annotations

import itertools
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpdoctor.probe.session import is_user_file
from ddpdoctor.probe.standins import _common

from .compression import Compression

# ReduceOp values as Horovod numbers them (horovod/common/message.h)
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
_DIST_OPS = {Average: "SUM", Sum: "SUM", Min: "MIN", Max: "MAX", Product: "PRODUCT"}

OPS_RECORDED_PER_SITE = 8  # hvd_op events per call site and process


class HorovodInternalError(RuntimeError):
    """Internal error raised when a Horovod collective operation (e.g., allreduce) fails."""


# --------------------------------------------------------------------------------------------- the job


class _State:
    def __init__(self) -> None:
        self.initialized = False
        self.rank = -1
        self.size = -1
        self.local_rank = -1
        self.local_size = -1
        self.cross_rank = -1
        self.cross_size = -1
        self.source = ""
        self.owns_group = False


_state = _State()


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return None


def _slot() -> tuple[dict[str, int], str]:
    """This process's slot, from the launcher that started it: horovodrun (HOROVOD_*), mpirun (Open MPI / PMI),
    torchrun; without any launcher, a job of one process (as Horovod runs without horovodrun)."""
    for source, keys in (
        ("horovodrun", ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                        "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")),
        ("mpirun", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE", "", "")),
        ("pmi", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "", "")),
        ("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "")),
    ):
        rank, size = _env_int(keys[0]), _env_int(keys[1])
        if rank is None or size is None:
            continue
        local_rank = _env_int(keys[2]) if keys[2] else None
        local_size = _env_int(keys[3]) if keys[3] else None
        local_rank = rank if local_rank is None else local_rank
        local_size = size if local_size is None else local_size
        cross_rank = _env_int(keys[4]) if keys[4] else None
        cross_size = _env_int(keys[5]) if keys[5] else None
        if cross_rank is None:
            cross_rank = rank // max(1, local_size)
        if cross_size is None:
            cross_size = max(1, size // max(1, local_size))
        return {"rank": rank, "size": size, "local_rank": local_rank, "local_size": local_size,
                "cross_rank": cross_rank, "cross_size": cross_size}, source
    return {"rank": 0, "size": 1, "local_rank": 0, "local_size": 1, "cross_rank": 0, "cross_size": 1}, "none"


def _rendezvous(size: int) -> dict[str, Any]:
    """How the processes of this job meet: the port the probe chose for the script's own rendezvous, else the
    launcher's MASTER_ADDR/MASTER_PORT; a job of one process needs no peer."""
    if size == 1:
        return {"store": dist.HashStore()}
    try:
        from ddpdoctor.probe.settings import ProbeSettings

        settings = ProbeSettings.from_env()
    except Exception:
        settings = None
    port = settings.rendezvous_port if settings is not None else 0
    if port:
        return {"init_method": f"tcp://127.0.0.1:{port}"}
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return {"init_method": "env://"}
    raise HorovodInternalError(
        "ddpdoctor's Horovod stand-in found no rendezvous for a job of several processes: run it under "
        "`ddpdoctor check`, or give it MASTER_ADDR and MASTER_PORT"
    )


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Initialise the job: one process per slot, as the launcher placed them."""
    if comm is not None and not (isinstance(comm, (list, tuple)) and len(comm) == 0):
        raise NotImplementedError("ddpdoctor's Horovod stand-in supports hvd.init() over all ranks only (no comm=)")
    if _state.initialized:
        return
    slot, source = _slot()
    if dist.is_available() and dist.is_initialized():
        slot["rank"], slot["size"] = dist.get_rank(), dist.get_world_size()
        _state.owns_group = False
    else:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if slot["size"] == 1:
            backend = "gloo"
        dist.init_process_group(
            backend=backend, rank=slot["rank"], world_size=slot["size"], **_rendezvous(slot["size"])
        )
        _state.owns_group = True
    for key, value in slot.items():
        setattr(_state, key, value)
    _state.source = source
    _state.initialized = True
    global_process_set._bind(list(range(_state.size)), None)
    if isinstance(process_sets, str) and process_sets.lower() == "dynamic":
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    elif process_sets:
        for ps in process_sets:
            add_process_set(ps)
    if _state.owns_group:
        _watch_default_group()
    _common.emit(
        "hvd_init",
        site=_common.user_frame_site(),
        launcher=source,
        backend=str(dist.get_backend()),
        size=_state.size,
        local_rank=_state.local_rank,
        local_size=_state.local_size,
        cross_rank=_state.cross_rank,
        cross_size=_state.cross_size,
        standin=True,
    )


_DEFAULT_GROUP_SITES = 4  # hvd_torch_distributed events per process


def _watch_default_group() -> None:
    """Horovod never initialises torch.distributed; the stand-in does (the probe needs a process group). Record
    where the script itself uses torch.distributed's default group (DistributedSampler(ds) without num_replicas,
    dist.get_rank(), dist.all_reduce...): under horovodrun those lines raise "Default process group has not been
    initialized". torch.distributed reaches the default group through `_get_default_group`; the uses counted are
    those whose nearest non-torch caller is user code (not the stand-in, not the probe)."""
    p = _common.probe()
    if p is None:
        return
    c10d = dist.distributed_c10d
    original = c10d._get_default_group
    seen: set[tuple[str, int]] = set()

    def _get_default_group():  # noqa: ANN202
        site = None if p.recording else _nearest_caller()
        if site is not None and len(seen) < _DEFAULT_GROUP_SITES and (site["file"], site["line"]) not in seen:
            seen.add((site["file"], site["line"]))
            _common.emit("hvd_torch_distributed", site=site, standin=True)
        return original()

    p.patcher.setattr(c10d, "_get_default_group", _get_default_group)


_STANDINS_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _nearest_caller() -> dict[str, Any] | None:
    """The user line that needs the default group: user code that called a torch.distributed function or built a
    DistributedSampler (looking through the probe's patch wrappers). Torch's own uses that first check
    `dist.is_initialized()` (the DataLoader) are not counted: under Horovod they simply do not happen."""
    f = sys._getframe(2)
    entry = None  # the outermost torch frame so far: the API the caller called
    while f is not None:
        name = f.f_code.co_filename
        if is_user_file(name):
            if entry is None:
                return None
            api = entry.replace(os.sep, "/")
            if "/torch/distributed/" in api or api.endswith("/torch/utils/data/distributed.py"):
                return {"file": name, "line": f.f_lineno, "function": f.f_code.co_name}
            return None
        if os.path.abspath(name).startswith(_STANDINS_DIR + os.sep):
            return None
        if f"{os.sep}torch{os.sep}" in name:
            entry = name
        elif f"{os.sep}ddpdoctor{os.sep}" not in name:
            return None
        f = f.f_back
    return None


def shutdown() -> None:
    """Horovod can be shut down and initialised again; the process group stays (the probe still needs it)."""
    _state.initialized = False


def is_initialized() -> bool:
    return _state.initialized


def _require() -> None:
    if not _state.initialized:
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def size() -> int:
    _require()
    return _state.size


def local_size() -> int:
    _require()
    return _state.local_size


def cross_size() -> int:
    _require()
    return _state.cross_size


def rank() -> int:
    _require()
    return _state.rank


def local_rank() -> int:
    _require()
    return _state.local_rank


def cross_rank() -> int:
    _require()
    return _state.cross_rank


def is_homogeneous() -> bool:
    _require()
    return True


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return True


def nccl_built() -> int:
    """Horovod answers with the NCCL version it was built against; a GPU build is what a CUDA script expects."""
    return 21800 if torch.cuda.is_available() else 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return bool(torch.cuda.is_available())


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Timelines are not written by the stand-in."""


def stop_timeline() -> None:
    """Timelines are not written by the stand-in."""


# --------------------------------------------------------------------------------------------- process sets


class ProcessSet:
    """A subset of the ranks that collectives can be limited to (`hvd.ProcessSet(ranks)`)."""

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        if not isinstance(ranks_or_comm, (list, tuple, range)):
            raise NotImplementedError("ddpdoctor's Horovod stand-in builds process sets from rank lists only")
        self.ranks = sorted(int(r) for r in ranks_or_comm)
        self.process_set_id: int | None = None
        self._group: Any = None

    def _bind(self, ranks: list[int], group: Any) -> None:
        self.ranks = ranks
        self._group = group
        self.process_set_id = 0 if group is None else id(group)

    @property
    def group(self) -> Any:
        return self._group  # None = the default (global) group

    def size(self) -> int | None:
        return len(self.ranks) if self.process_set_id is not None else None

    def rank(self) -> int | None:
        if self.process_set_id is None:
            return None
        me = rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        if self.process_set_id is None:
            return None
        return rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every rank (a collective call, as with Horovod's dynamic process sets)."""
    _require()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    ps._bind(ps.ranks, dist.new_group(ranks=ps.ranks))
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    if process_set is global_process_set or process_set.process_set_id is None:
        return False
    process_set.process_set_id = None
    return True


def _global(ps: ProcessSet, local_root: int) -> int:
    return ps.ranks[local_root] if ps.group is not None else local_root


# --------------------------------------------------------------------------------------------- helpers


def handle_average_backwards_compatibility(op: Any, average: Any) -> int:
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _resolved(op: Any, average: Any) -> int:
    """The reduce op a call uses (as handle_average_backwards_compatibility decides, without its warning)."""
    if op is not None:
        return op
    return Sum if average is not None and not average else Average


def _check_tensor(tensor: Any) -> None:
    if not torch.is_tensor(tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(f"Tensor type {tensor.type()} is not supported.")
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")


def _scale(buf: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if buf.dtype.is_floating_point:
        buf.mul_(factor)
    else:  # Horovod scales integers in floating point and stores the truncated result
        buf.copy_((buf.double() * factor).to(buf.dtype))


def _reduce_into(src: torch.Tensor, out: torch.Tensor, op: int, prescale: float, postscale: float,
                 ps: ProcessSet) -> torch.Tensor:
    """out = op over ranks of (prescale * src), times postscale (/ size for Average). `out` may be `src`."""
    _require()
    _check_tensor(src)
    if op == Adasum:
        raise NotImplementedError("ddpdoctor's Horovod stand-in does not implement the Adasum reduction")
    if op not in _DIST_OPS:
        raise ValueError(f"unknown Horovod reduce op {op!r}")
    with torch.no_grad():
        buf = out.detach()
        if buf.data_ptr() != src.data_ptr() or buf.shape != src.shape:
            buf.copy_(src.detach())
        _scale(buf, prescale)
        if ps.included() is not False:
            dist.all_reduce(buf, op=getattr(dist.ReduceOp, _DIST_OPS[op]), group=ps.group)
        post = postscale / (ps.size() or 1) if op == Average else postscale
        _scale(buf, post)
    return out


_handles: dict[int, Any] = {}
_handle_ids = itertools.count(1)


def _handle(output: Any) -> int:
    h = next(_handle_ids)
    _handles[h] = output
    return h


def poll(handle: int) -> bool:
    """Operations complete when called: always True."""
    return True


def synchronize(handle: int) -> Any:
    if handle not in _handles:
        return None
    return _handles.pop(handle)


# --------------------------------------------------------------------------------------------- recording


_per_site: dict[tuple[str, str, int], int] = {}


def _summary(t: Any) -> float | None:
    try:
        if torch.is_tensor(t) and t.numel() > 0:
            return float(t.detach().double().mean().item())
    except Exception:
        return None
    return None


def _record(op: str, tensor: Any, result: Any, *, in_place: bool, name: Any, reduce_op: Any = None) -> None:
    """An hvd operation called straight from user code: where, what, and whether the caller kept the result."""
    if _common.probe() is None:
        return
    caller = sys._getframe(2)
    if not is_user_file(caller.f_code.co_filename):
        return  # the stand-in's own use (broadcast_parameters, the optimizer)
    key = (op, caller.f_code.co_filename, caller.f_lineno)
    n = _per_site.get(key, 0) + 1
    _per_site[key] = n
    if n > OPS_RECORDED_PER_SITE:
        return
    _common.emit(
        "hvd_op",
        op=op,
        site={"file": caller.f_code.co_filename, "line": caller.f_lineno, "function": caller.f_code.co_name},
        call=n,
        name=None if name is None else str(name),
        in_place=in_place,
        result_discarded=None if in_place else _common.result_discarded(),
        reduce_op=_OP_NAMES.get(reduce_op) if reduce_op is not None else None,
        numel=int(tensor.numel()) if torch.is_tensor(tensor) else None,
        dtype=str(tensor.dtype).replace("torch.", "") if torch.is_tensor(tensor) else None,
        input_mean=_summary(tensor),
        result_mean=_summary(result),
        standin=True,
    )


# --------------------------------------------------------------------------------------------- allreduce


def allreduce_async(tensor: Any, average: Any = None, name: Any = None, op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    op = handle_average_backwards_compatibility(op, average)
    _check_tensor(tensor)
    output = tensor.new(tensor.shape)
    return _handle(_reduce_into(tensor, output, op, prescale_factor, postscale_factor, process_set))


class HorovodAllreduce(torch.autograd.Function):
    """An autograd function that performs allreduce on a tensor."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.average = average
        ctx.op = op
        ctx.prescale_factor = prescale_factor
        ctx.postscale_factor = postscale_factor
        ctx.process_set = process_set
        handle = allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        return (allreduce(grad_output, average=ctx.average, op=ctx.op, prescale_factor=ctx.prescale_factor,
                          postscale_factor=ctx.postscale_factor, process_set=ctx.process_set),
                None, None, None, None, None, None)


def allreduce(tensor: Any, average: Any = None, name: Any = None, compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Average (by default) or sum `tensor` over all processes; returns a NEW tensor, `tensor` is not modified."""
    compressed, ctx = compression.compress(tensor)
    summed = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    result = compression.decompress(summed, ctx)
    _record("allreduce", tensor, result, in_place=False, name=name, reduce_op=_resolved(op, average))
    return result


def allreduce_async_(tensor: Any, average: Any = None, name: Any = None, op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    op = handle_average_backwards_compatibility(op, average)
    return _handle(_reduce_into(tensor, tensor, op, prescale_factor, postscale_factor, process_set))


def allreduce_(tensor: Any, average: Any = None, name: Any = None, op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Any:
    """In-place allreduce: `tensor` holds the result."""
    before = _summary(tensor) if _common.probe() is not None else None
    result = synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))
    if _common.probe() is not None:
        _record_in_place("allreduce_", tensor, before, name, _resolved(op, average))
    return result


def _record_in_place(op_name: str, tensor: Any, before: float | None, name: Any, reduce_op: Any) -> None:
    caller = sys._getframe(2)
    if not is_user_file(caller.f_code.co_filename):
        return
    key = (op_name, caller.f_code.co_filename, caller.f_lineno)
    n = _per_site.get(key, 0) + 1
    _per_site[key] = n
    if n > OPS_RECORDED_PER_SITE:
        return
    _common.emit(
        "hvd_op",
        op=op_name,
        site={"file": caller.f_code.co_filename, "line": caller.f_lineno, "function": caller.f_code.co_name},
        call=n,
        name=None if name is None else str(name),
        in_place=True,
        result_discarded=None,
        reduce_op=_OP_NAMES.get(reduce_op),
        numel=int(tensor.numel()),
        dtype=str(tensor.dtype).replace("torch.", ""),
        input_mean=before,
        result_mean=_summary(tensor),
        standin=True,
    )


def grouped_allreduce_async(tensors: Sequence[Any], average: Any = None, name: Any = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    op = handle_average_backwards_compatibility(op, average)
    outputs = [_reduce_into(t, t.new(t.shape), op, prescale_factor, postscale_factor, process_set) for t in tensors]
    return _handle(outputs)


def grouped_allreduce(tensors: Sequence[Any], average: Any = None, name: Any = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[Any]:
    return [allreduce(t, average=average, name=name, compression=compression, op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, process_set=process_set) for t in tensors]


def grouped_allreduce_async_(tensors: Sequence[Any], average: Any = None, name: Any = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    op = handle_average_backwards_compatibility(op, average)
    return _handle([_reduce_into(t, t, op, prescale_factor, postscale_factor, process_set) for t in tensors])


def grouped_allreduce_(tensors: Sequence[Any], average: Any = None, name: Any = None, op: Any = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[Any]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor: Any, name: Any, op: Any, process_set: ProcessSet = global_process_set) -> Any:
    """Sparse gradients: reduced as dense values and returned sparse (Horovod gathers indices and values; the
    reduced values are the same)."""
    dense = tensor.to_dense().contiguous()
    _reduce_into(dense, dense, op, 1.0, 1.0, process_set)
    result = dense.to_sparse()
    return lambda: result


# --------------------------------------------------------------------------------------------- allgather


def _gather_parts(t: torch.Tensor, ps: ProcessSet) -> tuple[list[torch.Tensor], list[int]]:
    """Every rank's tensor (first dimensions may differ; the others must match), and their first dimensions."""
    world = ps.size() or 1
    shape = torch.zeros(9, dtype=torch.int64, device=t.device)
    shape[0] = t.dim()
    shape[1:1 + t.dim()] = torch.tensor(list(t.shape), dtype=torch.int64)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=ps.group)
    dims = [s.tolist() for s in shapes]
    if any(d[0] != dims[0][0] or d[2:1 + d[0]] != dims[0][2:1 + dims[0][0]] for d in dims):
        raise HorovodInternalError(
            "Mismatched allgather tensor shapes: " + ", ".join(str(d[1:1 + d[0]]) for d in dims)
        )
    firsts = [int(d[1]) if d[0] > 0 else 1 for d in dims]
    rows = max(firsts) if firsts else 0
    padded = t.reshape(1) if t.dim() == 0 else t
    if padded.shape[0] < rows:
        pad = padded.new_zeros((rows - padded.shape[0], *padded.shape[1:]))
        padded = torch.cat([padded, pad])
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=ps.group)
    return [p[:n] for p, n in zip(parts, firsts, strict=True)], firsts


def allgather_async(tensor: Any, name: Any = None, process_set: ProcessSet = global_process_set) -> int:
    _require()
    _check_tensor(tensor)
    with torch.no_grad():
        parts, _ = _gather_parts(tensor.detach(), process_set)
    return _handle(torch.cat(parts))


class HorovodAllgather(torch.autograd.Function):
    """An autograd function that performs allgather on a tensor."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.process_set = process_set
        _require()
        _check_tensor(tensor)
        with torch.no_grad():
            parts, firsts = _gather_parts(tensor.detach(), process_set)
        ctx.firsts = firsts
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = allreduce(grad_output.contiguous(), average=True, process_set=ctx.process_set)
        r = ctx.process_set.rank()
        offset = sum(ctx.firsts[:r])
        return grad_reduced.narrow(0, offset, ctx.dim), None, None


def allgather(tensor: Any, name: Any = None, process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's tensor along the first dimension (sizes may differ); a new tensor."""
    result = HorovodAllgather.apply(tensor, name, process_set)
    _record("allgather", tensor, result, in_place=False, name=name)
    return result


def grouped_allgather_async(tensors: Sequence[Any], name: Any = None,
                            process_set: ProcessSet = global_process_set) -> int:
    return _handle([synchronize(allgather_async(t, name, process_set)) for t in tensors])


def grouped_allgather(tensors: Sequence[Any], name: Any = None,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    return [HorovodAllgather.apply(t, name, process_set) for t in tensors]


# --------------------------------------------------------------------------------------------- broadcast


def _broadcast_into(src: Any, out: Any, root_rank: int, ps: ProcessSet) -> Any:
    _require()
    _check_tensor(src)
    with torch.no_grad():
        buf = out.detach()
        if buf.data_ptr() != src.data_ptr():
            buf.copy_(src.detach())
        if ps.included() is not False:
            dist.broadcast(buf, src=_global(ps, root_rank), group=ps.group)
    return out


def broadcast_async(tensor: Any, root_rank: int, name: Any = None, process_set: ProcessSet = global_process_set) -> int:
    return _handle(_broadcast_into(tensor, tensor.new(tensor.shape), root_rank, process_set))


class HorovodBroadcast(torch.autograd.Function):
    """An autograd function that broadcasts a tensor."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = allreduce(grad_output.contiguous(), average=True, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            grad_reduced *= 0
        return grad_reduced, None, None, None


def broadcast(tensor: Any, root_rank: int, name: Any = None, process_set: ProcessSet = global_process_set) -> Any:
    """Root's tensor on every rank; a new tensor, `tensor` is not modified."""
    result = HorovodBroadcast.apply(tensor, root_rank, name, process_set)
    _record("broadcast", tensor, result, in_place=False, name=name)
    return result


def broadcast_async_(tensor: Any, root_rank: int, name: Any = None,
                     process_set: ProcessSet = global_process_set) -> int:
    return _handle(_broadcast_into(tensor, tensor, root_rank, process_set))


def broadcast_(tensor: Any, root_rank: int, name: Any = None, process_set: ProcessSet = global_process_set) -> Any:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# --------------------------------------------------------------------------------------------- alltoall, reducescatter


def _split_sizes(n: int, world: int) -> list[int]:
    base, extra = divmod(n, world)
    return [base + (1 if i < extra else 0) for i in range(world)]


def _alltoall(tensor: torch.Tensor, splits: Any, ps: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
    _require()
    _check_tensor(tensor)
    world = ps.size() or 1
    me = ps.rank() or 0
    if splits is None:
        if tensor.shape[0] % world:
            raise ValueError("alltoall without splits needs the first dimension divisible by the number of processes")
        sizes = [tensor.shape[0] // world] * world
    else:
        sizes = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    with torch.no_grad():
        split_t = torch.tensor(sizes, dtype=torch.int64, device=tensor.device)
        all_splits = [torch.empty_like(split_t) for _ in range(world)]
        dist.all_gather(all_splits, split_t, group=ps.group)
        parts, _ = _gather_parts(tensor.detach(), ps)
        received = []
        for r in range(world):
            s = all_splits[r].tolist()
            start = sum(s[:me])
            received.append(parts[r][start:start + s[me]])
        out = torch.cat(received) if received else tensor.new_empty((0, *tensor.shape[1:]))
    return out, torch.tensor([int(all_splits[r][me]) for r in range(world)], dtype=torch.int32)


def alltoall_async(tensor: Any, splits: Any = None, name: Any = None,
                   process_set: ProcessSet = global_process_set) -> int:
    return _handle(_alltoall(tensor, splits, process_set))


def alltoall(tensor: Any, splits: Any = None, name: Any = None, process_set: ProcessSet = global_process_set) -> Any:
    """Scatter slices of the first dimension to every rank and gather theirs: (output, received splits) when
    `splits` is given, else the output."""
    out, received = _alltoall(tensor, splits, process_set)
    return (out, received) if splits is not None else out


def reducescatter_async(tensor: Any, name: Any = None, op: Any = Average, process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    return _handle(_reducescatter(tensor, op, process_set, prescale_factor, postscale_factor))


def _reducescatter(tensor: Any, op: Any, ps: ProcessSet, prescale: float, postscale: float) -> Any:
    full = _reduce_into(tensor, tensor.new(tensor.shape), op, prescale, postscale, ps)
    sizes = _split_sizes(tensor.shape[0], ps.size() or 1)
    me = ps.rank() or 0
    return full[sum(sizes[:me]):sum(sizes[:me + 1])].clone()


def reducescatter(tensor: Any, name: Any = None, compression: Any = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce over all processes, then keep this rank's slice of the first dimension (the first ranks get one
    more row when it does not divide evenly)."""
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(_reducescatter(compressed, op, process_set, prescale_factor, postscale_factor), ctx)


def grouped_reducescatter(tensors: Sequence[Any], name: Any = None, compression: Any = Compression.none,
                          op: Any = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[Any]:
    return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor) for t in tensors]


def grouped_reducescatter_async(tensors: Sequence[Any], name: Any = None, op: Any = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    return _handle([_reducescatter(t, op, process_set, prescale_factor, postscale_factor) for t in tensors])


# --------------------------------------------------------------------------------------------- synchronisation


def join(device: int = -1) -> int:
    """A barrier over all ranks; returns the highest rank. (Horovod's join also keeps serving the collectives of
    ranks that are still training, with zeros: not reproduced.)"""
    _require()
    dist.barrier()
    return _state.size - 1


def barrier(process_set: ProcessSet = global_process_set) -> None:
    _require()
    dist.barrier(group=process_set.group)
