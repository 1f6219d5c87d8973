"""Models of the rest of torch a training script touches: checkpoints (torch.save/load), CUDA devices, autograd
and autocast contexts, tensor factories, tensor methods (`.to()`, `.item()`), and reporting (print, logging,
TensorBoard writers), plus functools.partial."""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor import torchnames as N
from ddpdoctor.static.apis.ranks import CALL_DROPS
from ddpdoctor.static.apis.registry import Call, method
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.support import Args
from ddpdoctor.static.semantic import EMPTY, Obj, Value, is_constant, tags_of, union

REPORT_METHODS = frozenset(
    {
        "info",
        "warning",
        "warn",
        "debug",
        "log",
        "add_scalar",
        "add_scalars",
        "log_metrics",
        "log_dict",
        "print",
        "set_postfix",
        "update_metrics",
    }
)
TENSOR_FACTORIES = frozenset(
    {"randn", "rand", "zeros", "ones", "empty", "full", "randint", "arange", "normal", "tensor", "linspace"}
)
GRAD_OFF = ("torch.no_grad", "torch.inference_mode")


def _save(state: TorchState, c: Call) -> Value:
    state.emit(
        "save",
        c.node,
        obj=c.args.get(0, "obj") or EMPTY,
        path=c.args.get(1, "f") or EMPTY,
        path_node=c.args.node(1, "f"),
    )
    return (state.const(None, c.node),)


def _load(state: TorchState, c: Call) -> Value:
    return (state.unknown(c.node, label="torch.load()", loaded=True),)


def _set_device(state: TorchState, c: Call) -> Value:
    state.emit("set_device", c.node, arg=c.args.get(0, "device") or EMPTY, arg_node=c.args.node(0, "device"))
    return (state.const(None, c.node),)


def _device_count(state: TorchState, c: Call) -> Value:
    nproc = state.assume.get("device_count")
    if nproc is not None:
        return (
            state.new(
                "value",
                c.node,
                tags=frozenset({"device_count"}),
                label="torch.cuda.device_count()",
                const=True,
                value=nproc,
            ),
        )
    return (state.new("value", c.node, tags=frozenset({"device_count"}), label="torch.cuda.device_count()"),)


def _cuda_query(state: TorchState, c: Call) -> Value:
    if c.qual == "torch.cuda.is_available" and "cuda_available" in state.assume:
        return (state.const(state.assume["cuda_available"], c.node),)
    return (state.new("value", c.node, label=c.qual),)


def _device(state: TorchState, c: Call) -> Value:
    parts = c.args.all()
    text = ":".join(str(o.value) for o in parts if o.kind == "const")
    tags = tags_of(parts) - {"rank_cond"}
    return (
        state.new("device", c.node, tags=tags, const=is_constant(parts) or not parts, value=text, props={"text": text}),
    )


def _grad_ctx(mode: str):
    def handler(state: TorchState, c: Call) -> Value:
        return (state.new("ctx", c.node, props={"ctx": "grad", "mode": mode}),)

    return handler


def _set_grad_enabled(state: TorchState, c: Call) -> Value:
    flag = c.args.get(0, "mode") or EMPTY
    vals = [o.value for o in flag if o.kind == "const"]
    mode = ("on" if vals[0] else "off") if len(vals) == len(flag) == 1 else None
    return (state.new("ctx", c.node, props={"ctx": "grad", "mode": mode}),)


def _autocast(state: TorchState, c: Call) -> Value:
    return (state.new("ctx", c.node, props={"ctx": "autocast"}),)


def _partial(state: TorchState, c: Call) -> Value:
    args = c.args
    bound = Args(args.pos[1:], args.pos_nodes[1:], args.kw, args.kw_nodes, args.opaque)
    return (state.new("partial", c.node, props={"func": args.pos[0] if args.pos else EMPTY, "args": bound}),)


def _logging(state: TorchState, c: Call) -> Value:
    state.emit("report", c.node, args=c.args, name=c.last)
    return (state.const(None, c.node),)


def _tensor_factory(state: TorchState, c: Call) -> Value:
    args, last = c.args, c.last
    rows = None
    shape = args.get(None, "size")
    if shape is None and args.pos:
        shape = (
            args.pos[2]
            if last == "randint" and len(args.pos) >= 3
            else (args.pos[0] if last not in ("randint", "full", "tensor", "arange", "normal", "linspace") else None)
        )
        if last == "full" and args.pos:
            shape = args.pos[0]
    if shape:
        o = shape[0]
        if o.kind == "const" and isinstance(o.value, int):
            rows = o.value
        elif o.kind == "tuple" and o.const and o.value:
            rows = o.value[0] if isinstance(o.value[0], int) else None
    if last == "arange" and args.pos and len(args.pos) == 1:
        vals = [o.value for o in args.pos[0] if o.kind == "const"]
        rows = vals[0] if vals and isinstance(vals[0], int) else None
    tags = tags_of(args.all()) - CALL_DROPS
    return (state.new("tensor", c.node, tags=tags, props={"rows": rows}),)


CALLS = {
    N.TORCH_SAVE: _save,
    N.TORCH_LOAD: _load,
    N.SET_DEVICE: _set_device,
    N.DEVICE_COUNT: _device_count,
    **dict.fromkeys(("torch.cuda.current_device", "torch.cuda.is_available", "torch.cuda.is_initialized"), _cuda_query),
    "torch.device": _device,
    **{q: _grad_ctx("off") for q in GRAD_OFF},
    "torch.enable_grad": _grad_ctx("on"),
    "torch.set_grad_enabled": _set_grad_enabled,
    "functools.partial": _partial,
    "torch.cuda.amp.autocast": _autocast,
    "torch.cpu.amp.autocast": _autocast,
}

PATTERNS = (
    (lambda q, last: q.startswith("logging.") and last in REPORT_METHODS, _logging),
    (lambda q, last: q.startswith("torch.autocast"), _autocast),
    (lambda q, last: q.startswith("torch.") and last in TENSOR_FACTORIES, _tensor_factory),
)


# ---------------------------------------------------------------------- builtins and methods


def _print(state: TorchState, name: str, node: ast.Call, args: Args) -> Value:
    state.emit("report", node, args=args, name="print")
    return (state.const(None, node),)


BUILTINS = {"print": _print}


def _report(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    state.emit("report", node, args=args, name=name)
    return (state.const(None, node),)


def _tensor_move(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    derived = state.new(
        "tensor" if o.kind in ("tensor", "grad") else "unknown",
        node,
        label=o.label,
        tags=o.tags - {"rank_cond"},
        props={
            "detached": name == "detach" or o.props.get("detached", False),
            "rank_direct": o.props.get("rank_direct", False),
            "base": o,
        },
    )
    return (derived,)


_KEEPS_RANK = ("item", "strip", "lower", "upper", "__int__", "tolist", "split")


def _value_method(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value | None:
    """Methods on numbers and tensors keep where the value came from (`rank_t.item()` is still a rank)."""
    if o.kind not in ("value", "unknown", "const", "tensor", "grad"):
        return None
    result = state.generic_call(o, name, node, args)
    for r in result:
        r.tags = r.tags | (o.tags - {"rank_cond"})
        if "grad" in o.tags:
            r.props["owner"] = union(r.props.get("owner", EMPTY), o.props.get("owner", EMPTY))
        if o.props.get("rank_direct") and name in _KEEPS_RANK:
            r.props["rank_direct"] = True
    return result


LATE_METHODS: dict[str, Any] = {
    **{name: method(_report) for name in REPORT_METHODS},
    **{
        name: method(_tensor_move)
        for name in ("to", "cuda", "cpu", "detach", "clone", "contiguous", "half", "float", "double")
    },
}
LATE_FALLBACKS = (_value_method,)
