"""Models of torch.distributed and of process creation: init_process_group, rank and world-size queries,
collectives, point-to-point ops, and the ways a script starts its own ranks (torch.multiprocessing.spawn,
start_processes, multiprocessing.Process), whose targets are entered with a per-process rank."""

from __future__ import annotations

import ast

from ddpdoctor import torchnames as N
from ddpdoctor.static.apis.registry import Call
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.support import Args
from ddpdoctor.static.semantic import EMPTY, Value

_INIT_PARAMS = (
    "backend",
    "init_method",
    "timeout",
    "world_size",
    "rank",
    "store",
    "group_name",
    "pg_options",
    "device_id",
)
_QUERIES = (
    "is_initialized",
    "is_available",
    "is_nccl_available",
    "is_gloo_available",
    "is_torchelastic_launched",
    "get_backend",
)


def _init_process_group(state: TorchState, c: Call) -> Value:
    params = {n: c.args.get(i, n) for i, n in enumerate(_INIT_PARAMS)}
    nodes = {n: c.args.node(i, n) for i, n in enumerate(_INIT_PARAMS)}
    state.emit("init_pg", c.node, params=params, nodes=nodes, args=c.args)
    return (state.const(None, c.node),)


def _rank(state: TorchState, c: Call) -> Value:
    return (
        state.new("value", c.node, tags=frozenset({"rank"}), label=f"dist.{c.last}()", props={"rank_direct": True}),
    )


def _local_rank(state: TorchState, c: Call) -> Value:
    return (
        state.new(
            "value", c.node, tags=frozenset({"local_rank"}), label=f"dist.{c.last}()", props={"rank_direct": True}
        ),
    )


def _world_size(state: TorchState, c: Call) -> Value:
    return (state.new("value", c.node, tags=frozenset({"world_size"}), label="dist.get_world_size()"),)


def _collective(state: TorchState, c: Call) -> Value:
    state.emit("collective", c.node, op=c.last, args=c.args)
    return (state.unknown(c.node, label=f"dist.{c.last}()"),)


def _p2p(state: TorchState, c: Call) -> Value:
    state.emit("p2p", c.node, op=c.last, args=c.args)
    return (state.unknown(c.node, label=f"dist.{c.last}()"),)


def _query(state: TorchState, c: Call) -> Value:
    return (state.new("value", c.node, label=f"dist.{c.last}()"),)


# torch.distributed.<anything>.<name>: the functions of the package, whichever submodule spells them
_BY_LAST = {
    **dict.fromkeys(("get_rank", "get_global_rank", "get_group_rank"), _rank),
    "get_node_local_rank": _local_rank,
    "get_world_size": _world_size,
    **dict.fromkeys(N.COLLECTIVES, _collective),
    **dict.fromkeys(N.POINT_TO_POINT, _p2p),
    **dict.fromkeys(_QUERIES, _query),
}


def _distributed(state: TorchState, c: Call) -> Value | None:
    handler = _BY_LAST.get(c.last)
    return handler(state, c) if handler is not None else None


# ---------------------------------------------------------------------- processes


def _spawn(state: TorchState, c: Call) -> Value:
    fn = c.args.get(0, "fn") or EMPTY
    state.emit(
        "spawn", c.node, fn=fn, nprocs=c.args.get(2, "nprocs"), nprocs_node=c.args.node(2, "nprocs"), qual=c.qual
    )
    enter_process_target(state, c.node, fn, c.args.get(1, "args"), rank_first=True)
    return (state.unknown(c.node, label="spawn()"),)


def _process(state: TorchState, c: Call) -> Value:
    target = c.args.get(None, "target") or EMPTY
    state.emit("process", c.node, target=target, qual=c.qual)
    enter_process_target(state, c.node, target, c.args.get(None, "args"), rank_first=False)
    return (state.unknown(c.node, label="Process"),)


def _get_context(state: TorchState, c: Call) -> Value:
    """`ctx = mp.get_context("spawn")`: `ctx.Process(...)` is multiprocessing's Process."""
    package = c.qual.rsplit(".", 1)[0]
    return (state.new("qual", c.node, qual=f"{package}.context", label="context"),)


def _join(state: TorchState, c: Call) -> Value:
    return (state.new("ctx", c.node, props={"ctx": "join"}),)


def enter_process_target(state: TorchState, node: ast.Call, fn: Value, extra: Value | None, rank_first: bool) -> None:
    pos: list[Value] = []
    opaque = False
    if rank_first:
        pos.append(
            (
                state.new(
                    "value",
                    node,
                    label="process index",
                    tags=frozenset({"rank", "local_rank", "spawn"}),
                    props={"rank_direct": True},
                ),
            )
        )
    if extra:
        tup = [o for o in extra if o.kind == "tuple" and o.items is not None]
        if len(extra) == 1 and tup:
            pos.extend(tup[0].items)
        else:
            opaque = True
    call_args = Args(pos=pos, pos_nodes=[node] * len(pos), opaque=opaque)
    for f in fn:
        if f.kind == "function":
            state.call_function(f, call_args, node)
        elif f.kind == "bound":
            state.call_function(f.props["func"], call_args, node, self_obj=f.props["self"])


CALLS = {
    N.INIT_PROCESS_GROUP: _init_process_group,
    N.SPAWN: _spawn,
    N.START_PROCESSES: _spawn,
    N.MP_GET_CONTEXT: _get_context,
    "torch.multiprocessing.get_context": _get_context,
    "torch.distributed.algorithms.join.Join": _join,
}

PATTERNS = (
    (lambda q, last: q.startswith("torch.distributed."), _distributed),
    (
        lambda q, last: (
            q in (N.MP_PROCESS, "torch.multiprocessing.Process") or (last == "Process" and "multiprocessing" in q)
        ),
        _process,
    ),
)
