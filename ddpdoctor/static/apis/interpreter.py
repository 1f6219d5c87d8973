"""`TorchInterpreter`: the generic interpreter with the models of PyTorch, argparse and os.environ plugged in.

Each hook of `engine.hooks.Hooks` is answered here in a few lines, by the API module that owns the question
(ranks, nn, data, optim, distributed, environ, cli, tensors); library calls are dispatched through the
`ApiModels` built from those modules' tables.
"""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor import torchnames as N
from ddpdoctor.static.apis import (
    cli,
    data,
    distributed,
    environ,
    frameworks,
    horovod,
    nn,
    optim,
    paths,
    ranks,
    tensors,
)
from ddpdoctor.static.apis.registry import ApiModels, Call
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.support import Args, SourceFile
from ddpdoctor.static.project import Project
from ddpdoctor.static.semantic import EMPTY, PER_RANK_TAGS, WORLD_TAGS, Ctx, Family, Obj, Value

# The API modules, in the order their name patterns are tried (`ApiModels.call`).
API_MODULES = (nn, optim, data, distributed, horovod, frameworks, environ, cli, tensors, paths)
REGISTRY = ApiModels(API_MODULES)


class TorchInterpreter(TorchState):
    """Walks a training script and records what it does to models, data and process groups.

    `assume` tells the interpreter facts the source cannot (the launch plan passes them): "options" (dest → value
    of the script's command-line options as given), "device_count" (GPUs visible), "cuda_available".
    """

    PATH_KINDS = frozenset(
        {"wrapper", "module", "sampler", "loader", "optimizer", "dataset", "state_dict", "scheduler"}
    )
    PLAIN_KINDS = frozenset(
        {"value", "const", "unknown", "tensor", "tuple", "dict", "batch", "range", "device", "path"}
    )
    LABELLED_KINDS = frozenset(
        {
            "module",
            "wrapper",
            "optimizer",
            "sampler",
            "loader",
            "dataset",
            "scheduler",
            "instance",
            "iterable_dataset",
            "unknown",
            "state_dict",
            "dict",
            "params",
        }
    )
    ITEM_STORE_KINDS = frozenset({"dict", "unknown", "instance", "cli_args", "state_dict"})
    CALLABLE_KINDS = frozenset({"function", "bound", "class", "qual", "builtin", "partial", "loss"})
    CONDITION_TAGS = frozenset({"rank_cond"})
    # what a script makes only on some ranks (a checkpoint saver, a TensorBoard writer under `if rank == 0`)
    # (and what an unmodelled call returns there: see generic_call)
    MARKED_KINDS = frozenset({"instance", "wrapper", "module", "optimizer", "sampler", "loader"})

    def __init__(
        self, source: SourceFile, assume: dict[str, Any] | None = None, project: Project | None = None
    ) -> None:
        super().__init__(source, assume, REGISTRY, project)

    def mark_new(self, obj: Obj) -> None:
        ranks.mark_made_on(self, obj)

    def save_state(self) -> Any:
        return self._forward_depth

    def restore_state(self, saved: Any) -> None:
        self._forward_depth = saved

    # ------------------------------------------------------------------ names

    def unbound_name(self, name: str, node: ast.AST) -> Value | None:
        qual = N.UNIMPORTED_NAMES.get(name)
        if qual is None:
            return None
        return (self.new("qual", node, qual=qual, label=name, props={"heuristic": True}),)

    def named_unknown(self, node: ast.AST | None, name: str, **props: Any) -> Obj:
        tags, direct = ranks.name_facts(name)
        return self.unknown(node, label=name, tags=tags, **props, rank_direct=direct)

    def tag_binding(self, name: str, value: Value) -> Value:
        return ranks.tag_binding(name, value)

    def attribute_facts(self, base: Obj, ident: str | None) -> tuple[frozenset[str], dict[str, Any]]:
        tags = N.name_tags(ident)
        if ident is None:  # an item of a value computed from the world size is too (`lr_schedule[it]`)
            tags = tags | (base.tags & (WORLD_TAGS | {"rank_dep"}))
        props: dict[str, Any] = {"rank_direct": bool(tags & PER_RANK_TAGS)}
        tags = cli.attribute_facts(self, base, ident, tags, props)
        if base.props.get("loaded") or base.props.get("from_load"):
            props["from_load"] = True
        return tags, props

    def on_assign(self, ident: str, target: ast.AST, value: Value, st: ast.stmt) -> None:
        optim.on_assign(self, ident, target, value, st)
        nn.on_assign(self, ident, target, value, st)

    # ------------------------------------------------------------------ values flowing through operations

    def carried_props(self, value: Value) -> dict[str, Any]:
        return {"rank_direct": any(o.props.get("rank_direct") for o in value)}

    def depends_tags(self, value: Value) -> frozenset[str]:
        return ranks.depends(value)

    def call_result_facts(
        self, func: Obj | None, name: str | None, args: Args, props: dict[str, Any]
    ) -> frozenset[str]:
        return ranks.call_result_facts(func, name, args.all(), props)

    def binop_model(self, node: ast.AST, op: type, left: Value, right: Value) -> Obj | None:
        return paths.divide(self, node, left, right) if op is ast.Div else None

    # ------------------------------------------------------------------ branches, comparisons, contexts

    def classify_branch(self, test: Value, node: ast.expr) -> tuple[str, Any, Any, str | None]:
        return ranks.classify_branch(self, test, node)

    def narrowing(self, node: ast.expr) -> tuple[str, Any, bool] | None:
        return nn.wrapper_narrowing(self, node)

    def single_process_otherwise(self, node: ast.expr, test: Value) -> bool:
        return ranks.asks_distributed(self, node)

    def compare_value(self, node: ast.Compare, operands: list[Value]) -> Value | None:
        environ.membership(self, node, operands)
        return ranks.compare(self, node, operands)

    def boolop_value(self, node: ast.BoolOp, values: list[Value]) -> Value | None:
        return ranks.boolop(self, node, values)

    def negation_value(self, node: ast.UnaryOp, operand: Value) -> Value | None:
        return ranks.negation(self, node, operand)

    def context_of(self, obj: Obj) -> tuple[str, Any] | None:
        if obj.kind == "ctx":
            return obj.props["ctx"], obj.props.get("mode")
        if obj.kind == "qual" and N.canonical(obj.qual or "") in tensors.GRAD_OFF:
            return "grad", "off"  # `with torch.no_grad:` without the call
        return None

    def function_contexts(self, fobj: Obj, frame_id: int) -> list[Ctx]:
        fnode = fobj.props["node"]
        out: list[Ctx] = []
        for deco in fobj.props.get("decorators", []):
            for o in deco:
                if o.kind == "ctx" and o.props["ctx"] == "grad":
                    out.append(Ctx("grad", fnode, o.props.get("mode"), frame_id, file=fobj.file))
                    break
                if o.kind == "qual" and N.canonical(o.qual or "") in tensors.GRAD_OFF:
                    out.append(Ctx("grad", fnode, "off", frame_id, file=fobj.file))
                    break
        if any(N.is_rank_zero_decorator(n) for n in fobj.props.get("decorator_names", ())):
            out.append(Ctx("rank", fnode, "main", frame_id, 0, "global", file=fobj.file))
        return out

    def loop_info(self, node: ast.For | ast.AsyncFor | ast.While, iterable: Value | None) -> dict[str, Any]:
        return data.loop_info(self, node, iterable)

    def on_comprehension(self, node: ast.AST, gen: ast.comprehension, iterable: Value) -> None:
        data.on_comprehension(self, node, gen, iterable)

    # ------------------------------------------------------------------ items and attributes

    def load_item(self, base: Obj, key: Any, node: ast.Subscript) -> Value | None:
        return environ.load_item(self, base, key, node)

    def store_item(self, base: Obj, key: Any, value: Value, target: ast.Subscript) -> bool:
        return environ.store_item(self, base, key, value, target)

    def special_attr(self, obj: Obj, name: str, node: ast.AST | None) -> Value | None:
        kind = obj.kind
        if kind == "path":
            return paths.special_attr(self, obj, name, node)
        if kind == "wrapper" and name == "module":
            return obj.props.get("inner") or (self._derived(obj, name, node),)
        if kind == "cli_args":
            return cli.given_option(self, obj, name, node)
        if name in obj.fields:
            return None
        if kind == "loader":
            return data.special_attr(self, obj, name, node)
        if name == "grad" and kind in ("param", "unknown"):
            # a parameter's gradient; of an object the walk could not trace (`for p in group["params"]` over an
            # optimizer's param groups), a gradient whose model is not known
            grad = self.new(
                "grad",
                node,
                tags=frozenset({"grad"}),
                label=f"{obj.label}.grad" if obj.label else "grad",
                props={"owner": obj.props.get("owner", EMPTY) if kind == "param" else EMPTY},
            )
            obj.fields[name] = (grad,)
            return (grad,)
        if kind == "grad" and name == "data":
            return (obj,)
        return None

    # ------------------------------------------------------------------ calls

    def note_call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("detach", "detach_") and isinstance(func.value, ast.Call):
            self._detached_calls.add(id(func.value))

    def call_qual(self, qual: str, node: ast.Call, args: Args, heuristic: bool = False) -> Value:
        c = N.canonical(qual)
        last = c.rsplit(".", 1)[-1]
        result = self.registry.call(self, Call(c, last, node, args, heuristic))
        if result is not None:
            return result
        return self.generic_call(None, last, node, args, qual=c)

    def call_objects(self, func: Value, node: ast.Call, args: Args) -> tuple[Value, Value]:
        modules = tuple(o for o in func if o.is_module and o.kind not in ("class", "function", "bound"))
        if not modules:
            return EMPTY, EMPTY
        return nn.forward(self, modules, node, args), modules

    def call_other(self, obj: Obj, node: ast.Call, args: Args) -> Value | None:
        if obj.kind == "loss":
            return (self.new("tensor", node, props={"loss": True}),)
        return None

    def call_builtin_model(self, name: str, node: ast.Call, args: Args) -> Value | None:
        handler = self.registry.builtins.get(name)
        return handler(self, name, node, args) if handler is not None else None

    def is_callable_object(self, obj: Obj) -> bool:
        return obj.kind in self.CALLABLE_KINDS or obj.is_module

    def method_objects(self, receiver: Value, name: str, node: ast.Call, args: Args) -> tuple[Value, Value]:
        modules = tuple(o for o in receiver if o.is_module)
        if not modules:
            return EMPTY, EMPTY
        return nn.module_method(self, modules, name, node, args), modules

    def method_events(self, obj: Obj, name: str, node: ast.Call, args: Args) -> bool:
        return any(handler(self, obj, name, node, args) for handler in self.registry.method_events.get(name, ()))

    def method_model(self, obj: Obj, name: str, node: ast.Call, args: Args, late: bool) -> Value | None:
        reg = self.registry
        result = reg.method(reg.late_methods if late else reg.methods, self, obj, name, node, args)
        if result is not None or not late:
            return result
        for fallback in reg.late_fallbacks:
            result = fallback(self, obj, name, node, args)
            if result is not None:
                return result
        return None

    # ------------------------------------------------------------------ classes and instances

    def class_facts(self, bases: list[Value], st: ast.ClassDef) -> dict[str, Any]:
        """What instances of a class of the file are, from its bases: an nn.Module subclass is a module, a
        DistributedSampler subclass a distributed sampler, a DDP subclass a wrapper."""
        kind = "instance"
        out: dict[str, Any] = {}
        for base in bases:
            for b in base:
                if b.kind == "class":
                    if b.props.get("instance_kind", "instance") != "instance":
                        kind = b.props["instance_kind"]
                        for k in ("distributed_sampler", "wrapper_base", "framework"):
                            if k in b.props:
                                out[k] = b.props[k]
                    continue
                q = N.canonical(b.qual) if b.kind == "qual" and b.qual else (b.label or "")
                last = q.rsplit(".", 1)[-1]
                if q in (N.DDP, N.APEX_DDP):
                    kind = "wrapper"
                    out["wrapper_base"] = "ddp"
                elif q == N.DISTRIBUTED_SAMPLER or last == "DistributedSampler":
                    kind = "sampler"
                    out["distributed_sampler"] = True
                elif last in ("Sampler", "BatchSampler", "RandomSampler", "SequentialSampler"):
                    kind = "sampler"
                elif last == "IterableDataset":
                    kind = "iterable_dataset"
                elif last in ("Dataset", "TensorDataset", "ImageFolder", "DatasetFolder", "VisionDataset"):
                    kind = "dataset"
                elif q == "torch.optim.Optimizer" or last == "Optimizer":
                    kind = "optimizer"
                elif (
                    last == "Module"
                    or (q.startswith("torch.nn.") and last[:1].isupper() and q.count(".") == 2)
                    or last
                    in (
                        "LightningModule",
                        "PreTrainedModel",
                    )
                ):
                    kind = "module"
                    if last == "LightningModule":
                        out["framework"] = "lightning"  # frameworks.py: its hooks, self.log
        out["instance_kind"] = kind
        body_names = {n.name for n in st.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        out["overrides_iter"] = "__iter__" in body_names
        return out

    def make_instance(self, cls: Obj, node: ast.AST) -> Obj:
        kind = cls.props.get("instance_kind", "instance")
        inst = self.new(kind if kind != "wrapper" else "instance", node, label=cls.label, props={"class": cls})
        if kind == "module":
            inst.family = Family(
                mode="train" if self.reached else None,
                has_bn=nn.class_has_bn(self, cls.props["node"], cls.file),
                members=[inst],
            )
        elif kind == "sampler":
            inst.props.update(
                {
                    "distributed": bool(cls.props.get("distributed_sampler")),
                    "custom": True,
                    "overrides_iter": bool(cls.props.get("overrides_iter")),
                    "shuffle": None,
                }
            )
        return inst

    def instantiate_model(self, cls: Obj, node: ast.AST, args: Args) -> Value | None:
        if cls.props.get("instance_kind") == "wrapper":
            return nn.wrap(self, node, args, "ddp", cls.label or "DistributedDataParallel", heuristic=False)  # type: ignore[arg-type]
        return None

    def before_init(self, inst: Obj, cls: Obj, args: Args) -> None:
        kind = cls.props.get("instance_kind", "instance")
        if kind in ("dataset", "iterable_dataset"):
            inst.props["ctor_args"] = args
            inst.tags = (
                frozenset({"rank_dep"})
                if any(o.tags & (PER_RANK_TAGS | {"rank_dep"}) for o in args.all())
                else frozenset()
            )
        if kind == "optimizer":
            inst.props.update(
                {"cls": cls.label, "params": args.get(0, "params"), "lr": args.get(None, "lr"), "custom": True}
            )

    def after_init(self, inst: Obj, cls: Obj, node: ast.AST) -> None:
        kind = cls.props.get("instance_kind", "instance")
        if kind == "sampler":
            self.emit("sampler", node, obj=inst)
        elif kind == "optimizer":
            self.emit("optimizer", node, obj=inst)

    # ------------------------------------------------------------------ iteration

    def element_model(self, obj: Obj, node: ast.AST) -> Value | None:
        return data.element_model(self, obj, node)
