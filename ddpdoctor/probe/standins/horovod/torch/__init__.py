"""ddpdoctor's stand-in for `horovod.torch` (see ddpdoctor.probe.standins): the public API of Horovod 0.28's
PyTorch binding, built on torch.distributed. What it keeps and where it differs: the docstrings of mpi_ops,
optimizer, functions and sync_batch_norm, and the README."""

from ddpdoctor.probe.standins import _common

from . import elastic
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min", "ProcessSet",
    "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
    "shutdown", "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]

DIFFERENCES = [
    "collectives run synchronously in call order (Horovod negotiates the order of named operations across ranks)",
    "DistributedOptimizer reduces all gradients at step()/synchronize() in one flat buffer per dtype, not in the "
    "background during backward (same values, no overlap)",
    "join() is a barrier; Adasum, elastic training and timelines are not reproduced",
]

_common.announce("horovod", __name__, DIFFERENCES)
