"""Models of Horovod's PyTorch API (`import horovod.torch as hvd`), so the rules read a Horovod script as they read
a torch.distributed one:

    hvd.init()                         the process group of the job (an `init_pg` event, `via` horovod.torch.init)
    hvd.size() / hvd.rank()            the world size / the rank; hvd.local_rank() the rank on the node
    hvd.DistributedOptimizer(opt, ...) the optimizer it wraps (lr, schedulers and steps follow it) that averages the
                                       gradients across ranks (`grad_averaging`)
    hvd.allreduce(t) / allgather / broadcast ...
                                       collectives (`collective`, op `hvd.<name>`): the ones without a trailing
                                       underscore return a new tensor, so a call whose result is thrown away
                                       (`discarded`) reduced nothing the script uses
    hvd.broadcast_parameters / broadcast_optimizer_state
                                       rank 0's weights or optimizer state sent to every rank (`hvd_broadcast`)
    hvd.SyncBatchNorm(...)             a SyncBatchNorm layer
"""

from __future__ import annotations

from ddpdoctor.static.apis import nn
from ddpdoctor.static.apis.distributed import _INIT_PARAMS
from ddpdoctor.static.apis.registry import Call
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.semantic import Value

HVD = "horovod.torch."
# collectives that return a new tensor (their `_` twins work in place)
RETURNING = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "grouped_allreduce",
             "grouped_allgather", "grouped_reducescatter")
IN_PLACE = ("allreduce_", "broadcast_", "grouped_allreduce_")
ASYNC = ("allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_",
         "grouped_allreduce_async", "grouped_allreduce_async_", "alltoall_async", "reducescatter_async")
OTHER = ("barrier", "join", "broadcast_object", "allgather_object")


def _init(state: TorchState, c: Call) -> Value:
    state.emit("init_pg", c.node, params=dict.fromkeys(_INIT_PARAMS), nodes=dict.fromkeys(_INIT_PARAMS), args=c.args,
           via="horovod.torch.init")
    return (state.const(None, c.node),)


def _value(tag: str | None, label: str, direct: bool = False):  # noqa: ANN202
    def handler(state: TorchState, c: Call) -> Value:
        tags = frozenset({tag}) if tag else frozenset()
        return (state.new("value", c.node, tags=tags, label=label, props={"rank_direct": True} if direct else {}),)

    return handler


def _distributed_optimizer(state: TorchState, c: Call) -> Value:
    optimizer = c.args.get(0, "optimizer") or ()
    state.emit("grad_averaging", c.node, optimizer=optimizer, args=c.args, wrapper="horovod.torch.DistributedOptimizer")
    return optimizer or (state.unknown(c.node, label="hvd.DistributedOptimizer()"),)


def _collective(state: TorchState, c: Call) -> Value:
    name = c.qual[len(HVD):]
    state.emit("collective", c.node, op=f"hvd.{name}", args=c.args, library="horovod",
           discarded=name in RETURNING and id(c.node) in state._bare_calls)
    return (state.unknown(c.node, label=f"hvd.{name}()"),)


def _broadcast(what: str):  # noqa: ANN202
    def handler(state: TorchState, c: Call) -> Value:
        state.emit("hvd_broadcast", c.node, what=what, args=c.args)
        return (state.const(None, c.node),)

    return handler


CALLS = {
    HVD + "init": _init,
    HVD + "size": _value("world_size", "hvd.size()"),
    HVD + "rank": _value("rank", "hvd.rank()", direct=True),
    HVD + "local_rank": _value("local_rank", "hvd.local_rank()", direct=True),
    HVD + "local_size": _value(None, "hvd.local_size()"),
    HVD + "cross_rank": _value(None, "hvd.cross_rank()"),
    HVD + "cross_size": _value(None, "hvd.cross_size()"),
    HVD + "DistributedOptimizer": _distributed_optimizer,
    HVD + "broadcast_parameters": _broadcast("parameters"),
    HVD + "broadcast_optimizer_state": _broadcast("optimizer_state"),
    HVD + "SyncBatchNorm": nn._syncbn_layer,
    **{HVD + name: _collective for name in RETURNING + IN_PLACE + ASYNC + OTHER},
}
