"""Horovod's helper functions (`horovod.torch.functions`): broadcasting parameters, optimizer state and objects.

Kept from Horovod 0.28: `broadcast_parameters` takes a dict (a `state_dict()`, broadcast in sorted key order) or a
list (of `(name, tensor)` pairs or bare tensors) and refuses anything else (a generator such as
`model.named_parameters()` raises ValueError, as in Horovod); tensors are overwritten in place, so a
`state_dict()` (which shares storage with the parameters and buffers) updates the model.
`broadcast_optimizer_state` first initialises a fresh optimizer's state with one zero-gradient step (with weight
decay this step moves the weights, as in Horovod; the probe does not count it as a training step), then broadcasts
every state tensor and, through `broadcast_object`, every scalar and hyper-parameter of the root.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from typing import Any

import torch

from ddpdoctor.probe.session import is_user_file
from ddpdoctor.probe.standins import _common

from .mpi_ops import allgather, broadcast_, broadcast_async_, global_process_set, rank, size, synchronize

try:  # Horovod pickles with cloudpickle (lambdas, local classes); plain pickle where it is not installed
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Broadcast `params` (a dict such as `model.state_dict()`, or a list of tensors / (name, tensor) pairs) from
    `root_rank` to every process, in place."""
    what = type(params).__name__
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [broadcast_async_(p, root_rank, name) for name, p in params]
    for handle in handles:
        synchronize(handle)
    if not is_user_file(sys._getframe(1).f_code.co_filename):
        return  # broadcast_optimizer_state's own use
    _common.emit(
        "hvd_broadcast",
        what="parameters",
        argument=what,
        tensors=len(params),
        numel=int(sum(p.numel() for _, p in params if torch.is_tensor(p))),
        root_rank=root_rank,
        site=_common.user_frame_site(),
        standin=True,
    )


def broadcast_optimizer_state(optimizer: Any, root_rank: int, model: Any = None) -> None:
    """Broadcast the optimizer's state (and hyper-parameters) from `root_rank`."""
    from .optimizer import DistributedOptimizer

    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    sparse_params = []
    if model:
        for m in model.modules():
            if isinstance(m, torch.nn.modules.sparse.Embedding) and m.sparse:
                sparse_params.extend(id(p) for p in m.parameters())
    initialised = False
    if len(state_dict["state"]) == 0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in state_dict["state"]:
                    p.grad = p.data.new(p.size()).zero_()
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse_params
                    ):
                        p.grad = p.grad.to_sparse()
        with _common.not_a_training_step():
            if optimizer.__module__ == DistributedOptimizer.__module__:
                super(optimizer.__class__, optimizer).step()
            else:
                optimizer.step()
        initialised = True
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        _record_optimizer_broadcast(optimizer, root_rank, initialised, 0)
        return
    params = []
    scalars = {}
    callbacks = {}
    occurrences: dict[str, int] = collections.defaultdict(int)

    def _create_state_callback(pid: Any, name: Any):
        def _assign_state(v: Any) -> None:
            state_dict["state"][pid][name] = v

        return _assign_state

    def _create_option_callback(index: int, option_key: str):
        def _assign_option(v: Any) -> None:
            optimizer.param_groups[index][option_key] = v

        return _assign_option

    for index, group in enumerate(state_dict["param_groups"]):
        for option_key, option_value in group.items():
            if option_key == "params":
                continue
            key = f"{option_key}.{index}"
            scalars[key] = option_value
            callbacks[key] = _create_option_callback(index, option_key)
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                continue
            for name, p in state_dict["state"][pid].items():
                occurrences[name] += 1
                key = f"{name}.{occurrences[name]}"
                if torch.is_tensor(p):
                    params.append((key, p))
                else:
                    scalars[key] = p
                    callbacks[key] = _create_state_callback(pid, name)
    broadcast_parameters(params, root_rank)
    scalars = broadcast_object(scalars, root_rank)
    for key, p in scalars.items():
        callbacks[key](p)
    _record_optimizer_broadcast(optimizer, root_rank, initialised, len(params))


def _record_optimizer_broadcast(optimizer: Any, root_rank: int, initialised: bool, tensors: int) -> None:
    _common.emit(
        "hvd_broadcast",
        what="optimizer_state",
        argument=type(optimizer).__name__,
        opt=_common.optimizer_id(optimizer),
        tensors=tensors,
        root_rank=root_rank,
        initialised_state=initialised,
        site=_common.user_frame_site(),
        standin=True,
    )


def broadcast_object(obj: Any, root_rank: int = 0, name: Any = None, process_set: Any = global_process_set) -> Any:
    """Serialise `obj` on the root and return the root's object on every rank."""
    if name is None:
        name = type(obj).__name__
    if rank() == root_rank:
        b = io.BytesIO()
        _pickler.dump(obj, b)
        t = torch.ByteTensor(bytearray(b.getvalue()))
        sz = torch.IntTensor([t.shape[0]])
        broadcast_(sz, root_rank, name + ".sz", process_set)
    else:
        sz = torch.IntTensor([0])
        broadcast_(sz, root_rank, name + ".sz", process_set)
        t = torch.ByteTensor(sz.tolist()[0])
    broadcast_(t, root_rank, name + ".t", process_set)
    if rank() != root_rank:
        obj = _pickler.load(io.BytesIO(t.numpy().tobytes()))
    return obj


def allgather_object(obj: Any, name: Any = None, process_set: Any = global_process_set) -> list[Any]:
    """Every rank's object, in rank order."""
    if name is None:
        name = type(obj).__name__
    b = io.BytesIO()
    _pickler.dump(obj, b)
    t = torch.ByteTensor(bytearray(b.getvalue()))
    sz = torch.IntTensor([t.shape[0]])
    sizes = allgather(sz, name=name + ".sz", process_set=process_set).numpy()
    gathered = allgather(t, name=name + ".t", process_set=process_set).numpy()

    def select(i: int) -> Any:
        start = int(sum(sizes[:i]))
        return _pickler.load(io.BytesIO(gathered[start:start + int(sizes[i])].tobytes()))

    return [select(i) for i in range(process_set.size() or size())]
