"""Models of torch.nn: modules and the model families they form, DDP/DataParallel wrappers, SyncBatchNorm, module
methods (moves, train/eval, parameters, state dicts, forward) and model factories (torchvision, timm, hub).

A *family* (`semantic.Family`) is one model whichever handle the script holds: the module and every wrapper around
it share train/eval mode, BatchNorm presence and SyncBN conversion.
"""

from __future__ import annotations

import ast

from ddpdoctor import torchnames as N
from ddpdoctor.static.apis.registry import Call, method
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.support import Args, dotted, first_const_str, walk
from ddpdoctor.static.semantic import EMPTY, Family, Obj, Value, union

CONVERT_NAMES = ("convert_sync_batchnorm", "convert_syncbn_model")


def family_of(state: TorchState, obj: Obj) -> Family:
    if obj.family is None:
        obj.family = Family(mode="train" if state.reached else None, members=[obj])
    return obj.family


def merge_families(state: TorchState, objs: list[Obj]) -> Family:
    fams: list[Family] = []
    for o in objs:
        f = family_of(state, o)
        if f not in fams:
            fams.append(f)
    main = fams[0]
    for other in fams[1:]:
        for m in other.members:
            m.family = main
            if m not in main.members:
                main.members.append(m)
        if main.has_bn is None or other.has_bn:
            main.has_bn = other.has_bn if main.has_bn is None else (main.has_bn or bool(other.has_bn))
        main.syncbn_line = main.syncbn_line or other.syncbn_line
        if main.mode != other.mode:
            main.mode = None
    return main


def new_module(state: TorchState, node: ast.AST, qual: str | None, label: str, has_bn: bool | None) -> Obj:
    m = state.new("module", node, qual=qual, label=label)
    m.family = Family(mode="train" if state.reached else None, has_bn=has_bn, members=[m])
    return m


# ---------------------------------------------------------------------- wrappers and SyncBN


def wrap(state: TorchState, node: ast.Call, args: Args, wrapper: str, qual: str, heuristic: bool = False) -> Value:
    inner = args.get(0, "module") or EMPTY
    obj = state.new(
        "wrapper",
        node,
        qual=qual,
        label="DDP" if wrapper == "ddp" else "DataParallel",
        props={
            "wrapper": wrapper,
            "inner": inner,
            "args": args,
            "arg_node": args.node(0, "module"),
            "heuristic": heuristic,
        },
    )
    objs = [o for o in inner if o.kind not in ("const",)]
    fam = merge_families(state, objs) if objs else Family(mode="train" if state.reached else None)
    obj.family = fam
    fam.members.append(obj)
    state.emit("wrap", node, wrapper=obj, inner=inner, wrapper_kind=wrapper, args=args, heuristic=heuristic)
    return (obj,)


def convert_syncbn(state: TorchState, node: ast.Call, args: Args, qual: str, heuristic: bool) -> Value:
    target = args.get(0, "module") or EMPTY
    for o in target:
        if o.kind in ("const", "qual"):
            continue
        fam = family_of(state, o)
        fam.has_bn = True if fam.has_bn is None else fam.has_bn or True
        fam.syncbn_line = fam.syncbn_line or node.lineno
    state.emit("convert_syncbn", node, target=target, arg_node=args.node(0, "module"), qual=qual, heuristic=heuristic)
    return tuple(o for o in target if o.kind not in ("const",)) or (state.unknown(node),)


def _ddp(state: TorchState, c: Call) -> Value:
    return wrap(state, c.node, c.args, "ddp", c.qual, c.heuristic)


def _data_parallel(state: TorchState, c: Call) -> Value:
    return wrap(state, c.node, c.args, "dp", c.qual, c.heuristic)


def _convert(state: TorchState, c: Call) -> Value:
    return convert_syncbn(state, c.node, c.args, c.qual, c.heuristic)


def _convert_by_name(state: TorchState, c: Call) -> Value:
    return convert_syncbn(state, c.node, c.args, c.qual, True)


def _syncbn_layer(state: TorchState, c: Call) -> Value:
    m = state.new("module", c.node, qual=c.qual, label="SyncBatchNorm")
    m.family = Family(mode="train" if state.reached else None, has_bn=True, syncbn_line=c.node.lineno, members=[m])
    state.emit("syncbn_layer", c.node, obj=m)
    return (m,)


def _nn_class(state: TorchState, c: Call) -> Value:
    if c.last.endswith("Loss"):
        return (state.new("loss", c.node, qual=c.qual, label=c.last),)
    has_bn: bool | None = "BatchNorm" in c.last
    if c.last in ("Sequential", "ModuleList", "ModuleDict"):
        members = [o for o in c.args.all() if o.family is not None]
        has_bn = any(bool(o.family and o.family.has_bn) for o in members) or (None if c.args.opaque else False)
    return (new_module(state, c.node, c.qual, c.last, has_bn),)


def _torchvision_model(state: TorchState, c: Call) -> Value:
    name = c.last if c.last != "get_model" else first_const_str(c.args) or ""
    return (new_module(state, c.node, c.qual, c.last, N.torchvision_model_has_bn(name)),)


def _model_factory(state: TorchState, c: Call) -> Value:
    return (new_module(state, c.node, c.qual, c.last, None),)


def _compile(state: TorchState, c: Call) -> Value:
    return c.args.get(0, "model") or (state.unknown(c.node),)


def _deepcopy(state: TorchState, c: Call) -> Value:
    out: list[Obj] = []
    for s in c.args.get(0, None) or EMPTY:
        if s.is_module:
            m = state.new("module", c.node, label=s.label, props={"copy_of": s, "class": s.props.get("class")})
            fam = family_of(state, s)
            m.family = Family(mode=fam.mode, has_bn=fam.has_bn, members=[m])
            out.append(m)
    return tuple(out) or (state.unknown(c.node),)


def _strip_prefix(state: TorchState, c: Call) -> Value:
    state.emit("strip_prefix", c.node)
    return (state.const(None, c.node),)


CALLS = {
    N.DDP: _ddp,
    N.APEX_DDP: _ddp,
    N.DATA_PARALLEL: _data_parallel,
    N.CONVERT_SYNC_BN: _convert,
    N.APEX_CONVERT_SYNC_BN: _convert,
    N.SYNC_BN: _syncbn_layer,
    N.APEX_SYNC_BN: _syncbn_layer,
    "timm.create_model": _model_factory,
    "timm.models.create_model": _model_factory,
    "torch.hub.load": _model_factory,
    "torch.compile": _compile,
    "copy.deepcopy": _deepcopy,
}

PATTERNS = (
    (lambda q, last: last in CONVERT_NAMES, _convert_by_name),
    (lambda q, last: q.startswith("torch.nn.") and q.count(".") == 2 and last[:1].isupper(), _nn_class),
    (
        lambda q, last: (
            q.startswith(("torchvision.models.", "models."))
            and last[:1].islower()
            and last not in ("get_model_weights", "list_models")
        ),
        _torchvision_model,
    ),
    (lambda q, last: last == "from_pretrained", _model_factory),
    (lambda q, last: last == "consume_prefix_in_state_dict_if_present", _strip_prefix),
)


# ---------------------------------------------------------------------- module methods


def _move(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
    state.emit("move", node, target=modules, method=name, args=args)
    return modules


def _mode(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
    mode: str | None = "eval" if name == "eval" else "train"
    if name == "train":
        flag = args.get(0, "mode")
        if flag is not None:
            vals = [o.value for o in flag if o.kind == "const"]
            mode = ("train" if vals[0] else "eval") if len(vals) == len(flag) == 1 else None
    for m in modules:
        family_of(state, m).mode = mode
    state.emit("mode", node, target=modules, mode=mode)
    return modules


def _parameters(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
    return (state.new("params", node, props={"owner": modules, "named": name == "named_parameters"}),)


def _state_dict(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
    return (state.new("state_dict", node, props={"owner": modules}),)


def emit_load(state: TorchState, target: Value, node: ast.Call, args: Args) -> None:
    state.emit(
        "load_state_dict",
        node,
        target=target,
        state=args.get(0, "state_dict") or EMPTY,
        strict=args.get(1, "strict"),
        strict_node=args.node(1, "strict"),
        result_used=id(node) not in state._bare_calls,
    )


def _load_state_dict(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
    emit_load(state, modules, node, args)
    return (state.unknown(node, label="load_state_dict()"),)


def _forward(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
    return forward(state, modules, node, args)


def _call_inner(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value | None:
    inner = union(*(m.props.get("inner", EMPTY) for m in modules if m.kind == "wrapper"))
    return state.call_value(inner, node, args) if inner else None


def _ctx(kind: str):
    def handler(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
        return (state.new("ctx", node, props={"ctx": kind, "owner": modules}),)

    return handler


def _same(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
    return modules


def _stats_reset(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    state.emit("bn_stats_reset", node, target=(o,), how=name)
    return (state.const(None, node),)


def _modules_stats_reset(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
    state.emit("bn_stats_reset", node, target=modules, how=name)
    return (state.const(None, node),)


def on_assign(state: TorchState, ident: str, target: ast.AST, value: Value, st: ast.stmt) -> None:
    """`m.momentum = None`: BatchNorm switches to a cumulative average of what it sees next; `m.momentum = 1.0`:
    its running statistics become the next batch's, which the caller collects (precise BN, pycls's way)."""
    if (
        ident == "momentum"
        and isinstance(target, ast.Attribute)
        and value
        and all(o.kind == "const" and (o.value is None or o.value == 1) for o in value)
    ):
        how = "momentum = None" if all(o.value is None for o in value) else "momentum = 1"
        state.emit("bn_stats_reset", st, target=state.eval(target.value), how=how)


MODULE_METHODS = {
    **dict.fromkeys(N.MODULE_MOVES, _move),
    "train": _mode,
    "eval": _mode,
    "parameters": _parameters,
    "named_parameters": _parameters,
    "state_dict": _state_dict,
    "load_state_dict": _load_state_dict,
    "forward": _forward,
    "module": _call_inner,
    "no_sync": _ctx("no_sync"),
    "join": _ctx("join"),
    "reset_running_stats": _modules_stats_reset,
    **dict.fromkeys(("zero_grad", "apply", "requires_grad_", "share_memory", "compile"), _same),
}


def module_method(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
    """A method called on objects that are models (`model.eval()`, `model.module.state_dict()`)."""
    handler = state.registry.module_methods.get(name)
    if handler is not None:
        result = handler(state, modules, name, node, args)
        if result is not None:
            return result
    out: list[Obj] = []
    rest: list[Obj] = []
    for m in modules:
        if m.props.get("class") is not None:
            found = state._attr_from_class(m, name)
            if found is not None:
                out.extend(state.call_value(found, node, args))
                continue
        if name in m.fields:
            out.extend(state.call_value(m.fields[name], node, args))
            continue
        rest.append(m)
    if rest:
        out.extend(state.generic_call(rest[0], name, node, args))
    return tuple(out)


def forward(state: TorchState, modules: Value, node: ast.Call, args: Args) -> Value:
    """Calling a model: a `forward` event with the modes its families are in, then the module's own forward."""
    modes = []
    for m in modules:
        fam = family_of(state, m)
        if fam.mode not in modes:
            modes.append(fam.mode)
    detached = id(node) in state._detached_calls
    nested = state._forward_depth > 0
    ev = state.emit(
        "forward",
        node,
        target=modules,
        modes=tuple(modes),
        args=args,
        detached=detached,
        inside_forward=nested,
    )
    out: list[Obj] = []
    state._forward_depth += 1
    try:
        for m in modules:
            inner = m.props.get("inner", EMPTY) if m.kind == "wrapper" else (m,)
            for im in inner:
                if im.props.get("class") is not None and im.kind == "module":
                    fwd = state._attr_from_class(im, "forward")
                    if fwd:
                        out.extend(
                            _own_forward(state, im, fwd, node, args) if nested else state.call_value(fwd, node, args)
                        )
    finally:
        state._forward_depth -= 1
    result = state.new("tensor", node, props={"forward": ev})
    return union(out, (result,)) if out else (result,)


def _own_forward(state: TorchState, module: Obj, fwd: Value, node: ast.Call, args: Args) -> Value:
    """A project module's forward called inside another model's forward. Layers of one class that the same call of
    the parent runs in the same context (a ResNet stage's blocks, a transformer's layers: `self.layer3(self.layer2(
    self.layer1(x)))`) run the same code for the same events at the same lines: the first is walked, the others
    reuse what it returned. A layer configured differently (a constant field or argument that differs: a stride, a
    flag its forward tests), in another mode, or called from another branch, loop or call of the parent is walked
    on its own."""
    try:
        key = _sibling_key(state, module, fwd, args)
        done = state._sibling_forwards.get(key)
    except TypeError:  # a literal that cannot be a key (a list built from literals): walk it
        return state.call_value(fwd, node, args)
    if done is None:
        done = state._sibling_forwards[key] = state.call_value(fwd, node, args)
    return done


def _sibling_key(state: TorchState, module: Obj, fwd: Value, args: Args) -> tuple:
    return (
        state.frames[-1].id,
        tuple(id(f.props["func"].props.get("node")) if f.kind == "bound" else id(f) for f in fwd),
        tuple((c.kind, id(c.node), c.frame, c.branch) for c in state.ctx),
        family_of(state, module).mode,
        tuple((name, _layer_shape(v)) for name, v in module.fields.items()),
        tuple(_argument_shape(v) for v in args.pos),
        tuple((k, _argument_shape(v)) for k, v in args.kw.items()),
        args.opaque,
    )


def _layer_shape(value: Value) -> frozenset:
    """What of a layer's field can change which way its forward goes: the literals it may be (a stride, a flag,
    None for an absent downsample), and what the rest are (a project class's module runs its own forward)."""
    return frozenset((o.kind, o.value) if o.const else (o.kind, o.qual, id(o.props.get("class"))) for o in value)


def _argument_shape(value: Value) -> frozenset:
    """What of an argument can: the literals it may be, and whether it may be something else (the activations
    passed from layer to layer are tensors or unknowns, which the walk treats alike)."""
    return frozenset(o.value if o.const else _COMPUTED for o in value)


_COMPUTED = object()  # an argument that may be something other than a literal


# ---------------------------------------------------------------------- "is it the wrapper?" tests


def _wrapper_classes(value: Value, depth: int = 0) -> bool:
    """A class argument naming DDP or DataParallel (or a tuple holding one, or a DDP subclass of the project)."""
    for o in value:
        if o.kind == "qual" and N.canonical(o.qual or "") in (N.DDP, N.DATA_PARALLEL, N.APEX_DDP):
            return True
        if o.kind == "class" and o.props.get("instance_kind") == "wrapper":
            return True
        if o.kind == "tuple" and depth < 2 and any(_wrapper_classes(v, depth + 1) for v in o.items or ()):
            return True
    return False


def _named_wrapper_kinds(value: Value, depth: int = 0) -> frozenset[str] | None:
    """The wrapper kinds ("ddp", "dp") an isinstance class argument admits; None when it may admit any (a class
    of the project, something unknown). DistributedDataParallel is not a DataParallel subclass: SimCLR's
    `isinstance(model, DataParallel)` unwraps the DataParallel wrapper, never the DDP one."""
    kinds: set[str] = set()
    for o in value:
        qual = N.canonical(o.qual or "") if o.kind == "qual" else None
        if qual in (N.DDP, N.APEX_DDP):
            kinds.add("ddp")
        elif qual == N.DATA_PARALLEL:
            kinds.add("dp")
        elif o.kind == "tuple" and depth < 2:
            for v in o.items or ():
                inner = _named_wrapper_kinds(v, depth + 1)
                if inner is None:
                    return None
                kinds |= inner
        elif o.kind != "qual" or qual is None:
            return None
    return frozenset(kinds)


def _wrapper_check(state: TorchState, name: str, node: ast.Call, args: Args) -> Value | None:
    """`isinstance(model, DDP)`, `hasattr(model, "module")`: a test of whether a variable holds the wrapper, which
    the branches it decides narrow (`model.module if wrapped else model`, pycls's and timm's unwrap helpers)."""
    if len(node.args) != 2 or not isinstance(node.args[0], ast.Name) or len(args.pos) != 2:
        return None
    if name == "isinstance" and not _wrapper_classes(args.pos[1]):
        return None
    if name == "hasattr" and not (isinstance(node.args[1], ast.Constant) and node.args[1].value == "module"):
        return None
    kinds = _named_wrapper_kinds(args.pos[1]) if name == "isinstance" else None
    test = state.new("value", node, props={"builtin": name, "wrapper_test": (state.frame.id, node.args[0].id, kinds)})
    state._wrapper_tests[id(node)] = test.props["wrapper_test"]
    return (test,)


BUILTINS = {"isinstance": _wrapper_check, "hasattr": _wrapper_check}


def wrapper_narrowing(state: TorchState, node: ast.expr) -> tuple[str, object, bool] | None:
    """(variable, "is a wrapper", whether that holds when the test is true) for a test of the current frame that
    asks whether a local variable holds the DDP/DataParallel wrapper — the call itself, `not` of it, or a name
    bound to its result (`wrapped = isinstance(model, DDP)`)."""
    positive = True
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        node, positive = node.operand, not positive
    found = None
    if isinstance(node, ast.Call):
        found = state._wrapper_tests.get(id(node))
    elif isinstance(node, ast.Name):
        marks = {o.props.get("wrapper_test") for o in state.frame.locals.get(node.id, ())}
        found = marks.pop() if len(marks) == 1 else None
    if found is None or found[0] != state.frame.id:
        return None
    kinds = found[2] if len(found) > 2 else None
    if kinds is None:
        return found[1], _is_wrapper, positive
    return found[1], lambda o: _is_wrapper(o, kinds), positive


def _is_wrapper(o: Obj, kinds: frozenset[str] | None = None) -> bool | None:
    """True for a DDP/DataParallel wrapper (of one of `kinds` when the test names them), False for what is known
    not to be one, None when it cannot be told."""
    if o.kind == "wrapper":
        return kinds is None or o.props.get("wrapper") in kinds
    if o.kind in ("module", "const", "optimizer", "loader", "dataset", "sampler", "tensor"):
        return False
    return None


# ---------------------------------------------------------------------- methods on other objects


def _convert_method(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    return convert_syncbn(state, node, args, name, True)


def _ctx_of(kind: str):
    def handler(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
        return (state.new("ctx", node, props={"ctx": kind, "owner": (o,)}),)

    return handler


def _obj_state_dict(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    return (state.new("state_dict", node, props={"owner": (o,)}),)


def _obj_load_state_dict(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    emit_load(state, (o,), node, args)
    return (state.unknown(node),)


def _unresolved_mode(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    state.emit("mode", node, target=(o,), mode="eval" if name == "eval" else None, unresolved=True)
    return (o,)


METHODS = {name: method(_convert_method) for name in CONVERT_NAMES}
LATE_METHODS = {
    "no_sync": method(_ctx_of("no_sync")),
    "accumulate": method(_ctx_of("accumulate")),
    "state_dict": method(_obj_state_dict),
    "load_state_dict": method(_obj_load_state_dict),
    "eval": method(_unresolved_mode, "unknown"),
    "train": method(_unresolved_mode, "unknown"),
    "reset_running_stats": method(_stats_reset),
}


# ---------------------------------------------------------------------- classes of the file


def class_has_bn(state: TorchState, cls_node: ast.AST, file: str) -> bool:
    """Whether an nn.Module class of this file builds BatchNorm layers (directly, or through its own helpers)."""
    memo = state._has_bn_memo
    if cls_node in memo:
        return memo[cls_node]
    memo[cls_node] = False
    defs = state.index_of(file).defs_by_name
    found = False
    for n in walk(cls_node):
        ident = n.id if isinstance(n, ast.Name) else (n.attr if isinstance(n, ast.Attribute) else None)
        if ident is None:
            continue
        if "BatchNorm" in ident or ident in CONVERT_NAMES:
            found = True
        elif isinstance(n, ast.Attribute) and dotted(n).startswith(("models.", "torchvision.models.")):
            found = N.torchvision_model_has_bn(ident)
        elif ident in defs and isinstance(n, ast.Name):
            found = any(class_has_bn(state, d, file) for d in defs[ident] if d is not cls_node)
        if found:
            break
    memo[cls_node] = found
    return found
