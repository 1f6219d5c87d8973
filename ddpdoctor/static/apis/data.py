"""Models of torch.utils.data and torchvision datasets: loaders, samplers, datasets, and iterating over them
(`for batch in loader`, `iter(loader)`, `sampler.set_epoch(epoch)`)."""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor import torchnames as N
from ddpdoctor.static.apis.registry import Call
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.support import Args
from ddpdoctor.static.semantic import EMPTY, PER_RANK_TAGS, Obj, Value, union


def _loader(state: TorchState, c: Call) -> Value:
    names = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers")
    values = {n: c.args.get(i, n) for i, n in enumerate(names)}
    loader = state.new("loader", c.node, qual=N.DATA_LOADER, label="DataLoader", props={"args": c.args})
    for n in ("dataset", "sampler", "batch_sampler"):
        loader.fields[n] = values[n] or EMPTY
    loader.props["batch_size"] = values["batch_size"]
    loader.props["batch_size_node"] = c.args.node(1, "batch_size")
    loader.props["shuffle"] = values["shuffle"]
    loader.props["drop_last"] = c.args.get(None, "drop_last")
    state.emit("loader", c.node, obj=loader)
    return (loader,)


def sampler(state: TorchState, node: ast.Call, args: Args, distributed: bool, qual: str) -> Obj:
    obj = state.new(
        "sampler",
        node,
        qual=qual,
        label=qual.rsplit(".", 1)[-1],
        props={
            "distributed": distributed,
            "custom": False,
            "shuffle": args.get(3, "shuffle") if distributed else None,
            "drop_last": args.get(5, "drop_last") if distributed else None,
            "num_replicas": args.get(1, "num_replicas") if distributed else None,
            "dataset": args.get(0, "dataset") or EMPTY,
            "args": args,
        },
    )
    state.emit("sampler", node, obj=obj)
    return obj


def _distributed_sampler(state: TorchState, c: Call) -> Value:
    return (sampler(state, c.node, c.args, distributed=True, qual=c.qual),)


def _other_sampler(state: TorchState, c: Call) -> Value:
    return (sampler(state, c.node, c.args, distributed=False, qual=c.qual),)


def dataset(state: TorchState, node: ast.Call, args: Args, qual: str) -> Obj:
    last = qual.rsplit(".", 1)[-1]
    ds = state.new("dataset", node, qual=qual, label=last, props={"ctor_args": args})
    if any(o.tags & (PER_RANK_TAGS | {"rank_dep"}) for o in args.all()):
        ds.tags = frozenset({"rank_dep"})
    if last == "TensorDataset" and args.pos:
        rows = {o.props.get("rows") for o in args.pos[0]}
        if len(rows) == 1:
            ds.props["length"] = rows.pop()
    if last == "Subset":
        inner = args.get(0, "dataset") or EMPTY
        if any(o.kind == "iterable_dataset" for o in inner):
            ds.kind = "iterable_dataset"
    return ds


def _dataset(state: TorchState, c: Call) -> Value:
    return (dataset(state, c.node, c.args, c.qual),)


def _random_split(state: TorchState, c: Call) -> Value:
    ds = dataset(state, c.node, c.args, c.qual)
    return (state.new("tuple", c.node, props={"elem": (ds,)}),)


CALLS = {
    N.DATA_LOADER: _loader,
    N.DISTRIBUTED_SAMPLER: _distributed_sampler,
    "torch.utils.data.TensorDataset": _dataset,
    "torch.utils.data.Subset": _dataset,
    "torch.utils.data.ConcatDataset": _dataset,
    "torch.utils.data.random_split": _random_split,
}

PATTERNS = (
    (lambda q, last: q.startswith("torch.utils.data.") and last.endswith("Sampler"), _other_sampler),
    (lambda q, last: q.startswith("torchvision.datasets."), _dataset),
)


def _set_epoch(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> bool:
    state.emit("set_epoch", node, target=(o,), arg=args.get(0, "epoch") or EMPTY, arg_node=args.node(0, "epoch"))
    return True


METHOD_EVENTS = {"set_epoch": _set_epoch}


# ---------------------------------------------------------------------- iteration


def loaders_in(state: TorchState, value: Value, depth: int = 0) -> tuple[Obj, ...]:
    out: list[Obj] = []
    for o in value:
        if o.kind == "loader":
            out.append(o)
        elif depth < 3:
            if o.kind == "loader_iter":
                out.extend(o.props.get("loaders", ()))
            elif o.kind == "enumerate":
                out.extend(loaders_in(state, o.props.get("inner", EMPTY), depth + 1))
            elif o.kind == "zip":
                for inner in o.props.get("inner", []):
                    out.extend(loaders_in(state, inner, depth + 1))
            elif o.kind == "unknown" and "call_args" in o.props:
                out.extend(loaders_in(state, o.props["call_args"].all(), depth + 1))
            elif o.kind == "instance" and o.props.get("class") is not None:
                # a prefetcher / device-loader class of the file wrapping the DataLoader it holds
                out.extend(loaders_in(state, union(*o.fields.values()), depth + 1))
    return tuple(union(out))


def loop_info(state: TorchState, node: ast.For | ast.AsyncFor | ast.While, iterable: Value | None) -> dict[str, Any]:
    if isinstance(node, ast.While):
        return {"loaders": (), "iter": state.text(node.test), "target": "", "kind": "while"}
    loaders = loaders_in(state, iterable or EMPTY)
    if loaders:
        state.emit("iterate", node, loaders=loaders, loop=node, iterable=state.text(node.iter))
    if loaders:
        kind = "loader"
    elif any(o.kind == "range" for o in iterable or EMPTY):
        kind = "range"
    else:
        kind = "other"
    return {"loaders": loaders, "iter": state.text(node.iter), "target": state.text(node.target), "kind": kind}


def on_comprehension(state: TorchState, node: ast.AST, gen: ast.comprehension, iterable: Value) -> None:
    loaders = loaders_in(state, iterable)
    if loaders:
        state.emit("iterate", node, loaders=loaders, loop=node, iterable=state.text(gen.iter))


def _iter(state: TorchState, name: str, node: ast.Call, args: Args) -> Value | None:
    loaders = loaders_in(state, args.get(0, None) or EMPTY)
    if not loaders:
        return None
    state.emit("iterate", node, loaders=loaders, loop=None, iterable=state.text(node.args[0]) if node.args else "?")
    return (state.new("loader_iter", node, props={"loaders": loaders}),)


BUILTINS = {"iter": _iter}


def element_model(state: TorchState, o: Obj, node: ast.AST) -> Value | None:
    """One element of what a loop iterates: a batch of a loader, a parameter of `model.parameters()`."""
    kind = o.kind
    if kind in ("loader", "loader_iter"):
        return (state.new("batch", node, props={"loaders": loaders_in(state, (o,))}),)
    if kind == "params":
        param = state.new("param", node, label="param", props={"owner": o.props.get("owner", EMPTY)})
        if o.props.get("named"):
            return (state.new("tuple", node, items=((state.unknown(node),), (param,))),)
        return (param,)
    if kind in ("unknown", "instance") and loaders_in(state, (o,)):
        return (state.new("batch", node, props={"loaders": loaders_in(state, (o,))}),)
    return None


def special_attr(state: TorchState, obj: Obj, name: str, node: ast.AST | None) -> Value | None:
    """`loader.sampler`, `loader.dataset`: the objects the loader was built with (its fields), else a derived one."""
    if name in ("sampler", "dataset", "batch_sampler") and name not in obj.fields:
        return (state._derived(obj, name, node),)
    return None
