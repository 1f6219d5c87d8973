"""Models of optimisation: optimizers and lr schedulers (torch.optim, apex, transformers), backward passes, optimizer
steps, and the assignments that set a learning rate or scale a loss."""

from __future__ import annotations

import ast

from ddpdoctor import torchnames as N
from ddpdoctor.static.apis.registry import Call, method
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.support import Args
from ddpdoctor.static.semantic import EMPTY, WORLD_TAGS, Obj, Value, tags_of


def _scheduler(state: TorchState, c: Call) -> Value:
    s = state.new("scheduler", c.node, qual=c.qual, label=c.last, props={"cls": c.last, "args": c.args})
    state.emit("scheduler", c.node, obj=s)
    return (s,)


def _optimizer(state: TorchState, c: Call) -> Value:
    positional_lr = 1 if c.qual.startswith("torch.optim.") else None
    o = state.new(
        "optimizer",
        c.node,
        qual=c.qual,
        label=c.last,
        props={
            "cls": c.last,
            "params": c.args.get(0, "params") or EMPTY,
            "lr": c.args.get(positional_lr, "lr"),
            "lr_node": c.args.node(positional_lr, "lr"),
        },
    )
    state.emit("optimizer", c.node, obj=o)
    return (o,)


def _is_scheduler(q: str, last: str) -> bool:
    return (
        q.startswith("torch.optim.lr_scheduler.")
        or (q.startswith("transformers.") and "schedule" in last)
        or (last.startswith("get_") and "schedule" in last)
    )


def _is_optimizer(q: str, last: str) -> bool:
    return (
        q.startswith("torch.optim.") and last[:1].isupper() and last != "Optimizer" and q.count(".") == 2
    ) or q.startswith("apex.optimizers.")


PATTERNS = ((_is_scheduler, _scheduler), (_is_optimizer, _optimizer))


# ---------------------------------------------------------------------- methods


def _backward_event(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> bool:
    if o.kind == "class":
        return False
    if o.props.get("engine") == "accelerate":  # accelerator.backward(loss): the loss's backward
        state.emit("backward", node, target=args.get(0, "loss") or (state.unknown(node, label="loss"),))
        return True
    state.emit("backward", node, target=(o,))
    return True


def _step_event(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> bool:
    if o.kind != "optimizer":
        return False
    state.emit("opt_step", node, target=(o,))
    return True


METHOD_EVENTS = {"backward": _backward_event, "step": _step_event}


def _zero_grad(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    return (state.const(None, node),)


def _optimizer_state(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    return (state.new("state_dict", node, props={"owner": (o,), "optimizer": True}),)


def _scheduler_step(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    state.emit("sched_step", node, target=(o,))
    return (state.const(None, node),)


def _step_by_argument_or_name(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value | None:
    """`scaler.step(optimizer)` steps the optimizer it is given; `self.optim.step()` on an object we cannot see
    into is an optimizer step by its name."""
    optimizers = tuple(x for x in args.all() if x.kind == "optimizer")
    if optimizers:
        state.emit("opt_step", node, target=optimizers)
        return (state.unknown(node),)
    if o.kind == "unknown" and named_like_optimizer(o):
        state.emit("opt_step", node, target=(o,), heuristic=True)
        return (state.unknown(node),)
    return None


def named_like_optimizer(o: Obj) -> bool:
    """An object we cannot see into, named like an optimizer (`self.optim`, `opt`, an optimizer a factory built)."""
    label = (o.props.get("bound_name") or o.label or "").lower()
    return "optim" in label or label.split(".")[-1] in ("opt", "optimizer")


def optimizer_like(o: Obj) -> bool:
    return o.kind == "optimizer" or (o.kind == "unknown" and named_like_optimizer(o))


METHODS = {
    "zero_grad": method(_zero_grad, "optimizer"),
    "state_dict": method(_optimizer_state, "optimizer"),
    "step": [method(_scheduler_step, "scheduler"), method(_step_by_argument_or_name)],
}


# ---------------------------------------------------------------------- assignments


def on_assign(state: TorchState, ident: str, target: ast.AST, value: Value, st: ast.stmt) -> None:
    tags = tags_of(value)
    if N.is_lr_name(ident):
        state.emit("lr_assign", st, target=state.text(target), value=value, tags=tags)
    elif N.is_loss_name(ident) and any(multiplied_by_world(o) for o in value):
        state.emit("loss_scaled", st, target=state.text(target), tags=tags)


def multiplied_by_world(obj: Obj, depth: int = 0) -> bool:
    """A loss multiplied by a number that grows with the world size (`loss * world_size`, `loss *= ws / accum`),
    not one merely computed from something that mentions it (SwAV's Sinkhorn targets are normalised with
    `B = n * world_size`: `Q /= B; ...; Q *= B` leaves them summing to one, and the loss built from them is not
    scaled)."""
    if depth > 8:
        return False
    op = obj.props.get("op")
    left, right = obj.props.get("left", EMPTY), obj.props.get("right", EMPTY)
    if op == "Mult":
        return any(scaled_up_by_world(o) or multiplied_by_world(o, depth + 1) for o in left + right)
    if op in ("Div", "FloorDiv"):
        return any(multiplied_by_world(o, depth + 1) for o in left)
    return False


def scaled_up_by_world(obj: Obj, depth: int = 0) -> bool:
    """Whether a computed number grows with the world size: `lr * world_size`, `base * total_batch / 256`,
    `math.sqrt(world_size) * lr` — but not `lr / world_size` (that keeps the global step size)."""
    if depth > 8:
        return False
    op = obj.props.get("op")
    if op is None:
        return bool(obj.tags & WORLD_TAGS)
    left, right = obj.props.get("left", EMPTY), obj.props.get("right", EMPTY)
    if op == "Mult":
        return any(scaled_up_by_world(o, depth + 1) for o in left + right)
    if op in ("Div", "FloorDiv"):
        return any(scaled_up_by_world(o, depth + 1) for o in left)
    if op in ("Add", "Sub"):
        return any(scaled_up_by_world(o, depth + 1) for o in left + right)
    if op == "Pow":
        return any(scaled_up_by_world(o, depth + 1) for o in left)
    return False
