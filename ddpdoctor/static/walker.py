"""Walk a training script in execution order and record what it does to models, data and process groups.

Why an interpreter rather than pattern matching: the bugs ddpdoctor looks for live in the relation between
statements — a model built in one function, wrapped in another and trained in a method of a class; a sampler
reached through `loader.sampler`; a save inside a helper that only rank 0 calls. So the walker follows the script
the way it runs: the module body first; calls to functions, classes and methods of the same file entered at their
call sites with arguments bound to parameters; `mp.spawn` targets entered with a per-process rank; both sides of
every branch taken (and the variables merged afterwards); loop bodies walked once. Values are tuples of abstract
objects (`semantic.Obj`); what happens to them becomes an ordered list of `Event`s, each with the context it
happened in (rank-conditional branches, no_grad blocks, loops, the call stack). Rules read only events and objects.

Functions the walk never reaches (a Trainer used from another file, a callback handed to a library) are walked
afterwards on their own with unknown arguments; their events carry `reached=False`.

The walk never executes user code and never imports anything (in particular not torch).
"""

from __future__ import annotations

import ast
import builtins
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

from ddpdoctor.static import names as N
from ddpdoctor.static.semantic import (
    EMPTY,
    PER_RANK_TAGS,
    WORLD_TAGS,
    Ctx,
    Event,
    Family,
    Frame,
    Obj,
    Value,
    is_constant,
    tags_of,
    union,
)

MAX_DEPTH = 24
# A helper called from many call sites is entered at each of the first few, then summarised by what it returned:
# training scripts call their helpers a handful of times, while library-style code can fan out exponentially.
MAX_INLINE_PER_FUNCTION = 16
# A safety net for pathological inputs (deep mutual calls in a huge file): past this many visited nodes, calls are
# no longer entered and the model says it was truncated. Real scripts of a few thousand lines use a few percent.
VISIT_BUDGET = 400_000

_BUILTINS = frozenset(dir(builtins))
_PASSTHROUGH_BUILTINS = frozenset({"int", "float", "str", "bool", "round", "abs", "max", "min", "sum", "pow", "divmod", "format"})
_EXIT_CALLS = frozenset({"sys.exit", "exit", "quit", "os._exit", "os.abort"})
_REPORT_METHODS = frozenset(
    {"info", "warning", "warn", "debug", "log", "add_scalar", "add_scalars", "log_metrics", "log_dict", "print", "set_postfix", "update_metrics"}
)
_TENSOR_FACTORIES = frozenset({"randn", "rand", "zeros", "ones", "empty", "full", "randint", "arange", "normal", "tensor", "linspace"})
_CMP_OPS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: lambda a, b: a is b,
    ast.IsNot: lambda a, b: a is not b,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_BIN_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
# objects whose creation records which side of which `if` they were made on (see Walker._on_path)
_PATH_KINDS = frozenset({"wrapper", "module", "sampler", "loader", "optimizer", "dataset", "state_dict", "scheduler"})
_PLAIN_KINDS = frozenset({"value", "const", "unknown", "tensor", "tuple", "dict", "batch", "range", "device"})
_VALUE_CAP = 12
_CALLABLE_KINDS = frozenset({"function", "bound", "class", "qual", "builtin", "partial", "loss"})
# tags that do not survive a function call on the value (a device built from local_rank is not itself a rank)
_CALL_DROPS = frozenset({"rank_cond", "rank", "local_rank", "named"})


@dataclass
class Args:
    """The arguments of one call, evaluated."""

    pos: list[Value] = field(default_factory=list)
    pos_nodes: list[ast.AST] = field(default_factory=list)
    kw: dict[str, Value] = field(default_factory=dict)
    kw_nodes: dict[str, ast.AST] = field(default_factory=dict)
    opaque: bool = False  # *args / **kwargs whose content is not known

    def get(self, index: int | None, name: str | None) -> Value | None:
        if name is not None and name in self.kw:
            return self.kw[name]
        if index is not None and index < len(self.pos):
            return self.pos[index]
        return None

    def node(self, index: int | None, name: str | None) -> ast.AST | None:
        if name is not None and name in self.kw_nodes:
            return self.kw_nodes[name]
        if index is not None and index < len(self.pos_nodes):
            return self.pos_nodes[index]
        return None

    def all(self) -> Value:
        return union(*self.pos, *self.kw.values())


@dataclass
class CliArg:
    """One `parser.add_argument(...)` of the script."""

    flags: tuple[str, ...]
    dest: str
    default: Value | None
    line: int
    node: ast.AST


class Walker:
    """Builds the events and objects of one parsed script (see the module docstring)."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.events: list[Event] = []
        self.ctx: list[Ctx] = []
        self.frames: list[Frame] = []
        self.errors: list[str] = []
        self.cli_args: dict[str, CliArg] = {}
        self.truncated = False
        self.reached = True
        self._seq = itertools.count()
        self._frame_ids = itertools.count(1)
        self._visits = 0
        self._active: list[ast.AST] = []
        self._walked: set[ast.AST] = set()
        self._function_objs: dict[ast.AST, Obj] = {}
        self._classes: dict[ast.AST, Obj] = {}
        self._instances: dict[ast.AST, list[Obj]] = {}
        self._placeholders: dict[str, Obj] = {}
        self._guard: tuple[str, Any, int, str | None] | None = None  # (kind, info, branch, scope) after an early exit
        self._forward_depth = 0
        self._has_bn_memo: dict[ast.AST, bool] = {}
        self._cond_keys: dict[int, tuple[str, int]] = {}
        self._texts: dict[int, str] = {}
        self._inlined: dict[ast.AST, int] = {}
        self._summaries: dict[ast.AST, Value] = {}
        self._defs_by_name: dict[str, list[ast.AST]] = {}
        self._bound_names: set[str] = set()
        self._functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
        self._method_class: dict[ast.AST, ast.ClassDef] = {}
        self._bare_calls: set[int] = set()  # calls whose result is thrown away (`model.load_state_dict(sd)`)
        self._detached_calls: set[int] = set()  # calls whose result is `.detach()`ed right away
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self._defs_by_name.setdefault(node.name, []).append(node)
                self._bound_names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            self._method_class[item] = node
                else:
                    self._functions.append(node)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self._bound_names.add(node.id)
            elif isinstance(node, ast.alias):
                self._bound_names.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.arg):
                self._bound_names.add(node.arg)
        self.module_frame = Frame(id=next(self._frame_ids), name="<module>", locals={}, lexical=None, node=tree)

    # ------------------------------------------------------------------ driver

    def run(self) -> None:
        self.frames.append(self.module_frame)
        try:
            self.block(self.tree.body)
        finally:
            self.frames.pop()
        self.reached = False
        self._walk_unreached()

    def _walk_unreached(self) -> None:
        """Walk what the module body never called, callers before callees: a helper that the file calls
        (`self._save_snapshot(epoch)` under `if self.local_rank == 0` in a Trainer used from another file) is then
        entered at its call sites, with their rank guards and arguments, rather than on its own with neither."""
        called = self._called_names()
        defs = sorted(self._functions, key=lambda n: (n.name in called, n.lineno, n.col_offset))
        self.frames.append(self.module_frame)
        try:
            for d in defs:
                if d in self._walked:
                    continue
                if self._visits > VISIT_BUDGET:
                    self.truncated = True
                    break
                depth = (len(self.ctx), len(self.frames), len(self._active))
                try:
                    self._walk_entry(d)
                except RecursionError:
                    self.errors.append(f"line {d.lineno}: nesting too deep")
                except Exception as exc:  # a bug here must not cost the user the rest of the analysis
                    self.errors.append(f"line {d.lineno}: {type(exc).__name__}: {exc}")
                finally:
                    del self.ctx[depth[0] :]
                    del self.frames[depth[1] :]
                    del self._active[depth[2] :]
        finally:
            self.frames.pop()

    def _called_names(self) -> set[str]:
        """Names the file calls (`f(...)`, `obj.f(...)`): functions with these names may have a caller here."""
        out: set[str] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                if isinstance(node.func, ast.Name):
                    out.add(node.func.id)
                elif isinstance(node.func, ast.Attribute):
                    out.add(node.func.attr)
        return out

    def _walk_entry(self, d: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        parent = self._method_class.get(d)
        self_obj: Value | None = None
        fobj = self._function_objs.get(d)
        if parent is not None:
            cls = self._classes.get(parent)
            if cls is None:
                self.stmt(parent)
                cls = self._classes.get(parent)
            if cls is None:
                return
            fobj = fobj or self._lookup_class_attr_objs(cls, d.name)
            instances = self._instances.get(parent)
            if not instances:
                inst = self._make_instance(cls, d)
                self._instances.setdefault(parent, []).append(inst)
                init = self._lookup_class_attr_objs(cls, "__init__")
                if init is not None and init.props["node"] not in self._walked and d.name != "__init__":
                    self.call_function(init, Args(), init.props["node"], self_obj=(inst,))
                instances = [inst]
            self_obj = tuple(instances)
        if fobj is None or fobj.kind != "function":
            fobj = self._define_function(d, self.module_frame, cls=None, evaluate_defaults=True)
        if fobj.props.get("staticmethod"):
            self_obj = None
        self.call_function(fobj, Args(), d, self_obj=self_obj)

    # ------------------------------------------------------------------ infrastructure

    @property
    def frame(self) -> Frame:
        return self.frames[-1]

    def new(self, kind: str, node: ast.AST | None, **kw: Any) -> Obj:
        obj = Obj(kind=kind, line=getattr(node, "lineno", 0) or 0, node=node, **kw)
        if self.ctx and kind in _PATH_KINDS:
            path = self._path()
            if path:
                obj.props["path"] = path
        return obj

    def _cond_key(self, c: Ctx) -> tuple[str, int] | None:
        """(test text, side) of a branch, `not x` folded into x: the same test seen twice is one condition."""
        test = getattr(c.node, "test", None)
        if c.kind != "cond" or test is None:
            return None
        key = self._cond_keys.get(id(test))
        if key is None:
            negated, inner = 0, test
            while isinstance(inner, ast.UnaryOp) and isinstance(inner.op, ast.Not):
                inner, negated = inner.operand, negated ^ 1
            key = (ast.unparse(inner), negated)
            self._cond_keys[id(test)] = key
        return (key[0], c.branch ^ key[1])

    def _path(self) -> tuple[tuple[str, int], ...]:
        return tuple(k for k in (self._cond_key(c) for c in self.ctx) if k is not None)

    def _on_path(self, value: Value) -> Value:
        """Drop objects created on the other side of a test the current code is on: with
        `if ddp: model = DDP(model)`, `raw = model.module if ddp else model` sees only the plain model in `else`."""
        if not self.ctx or len(value) < 2:
            return value
        here = set(self._path())
        if not here:
            return value
        kept = tuple(o for o in value if not any((t, 1 - b) in here for t, b in o.props.get("path", ())))
        return kept or value

    def const(self, value: Any, node: ast.AST | None = None) -> Obj:
        return self.new("const", node, const=True, value=value)

    def unknown(self, node: ast.AST | None, label: str | None = None, tags: frozenset[str] = frozenset(), **props: Any) -> Obj:
        return self.new("unknown", node, label=label, tags=tags, props=props)

    def emit(self, kind: str, node: ast.AST, **data: Any) -> Event:
        ev = Event(
            kind=kind,
            node=node,
            line=getattr(node, "lineno", 0) or 0,
            seq=next(self._seq),
            ctx=tuple(self.ctx),
            frames=tuple(f.id for f in self.frames),
            func=self.frame.name,
            reached=self.reached,
            data=data,
        )
        self.events.append(ev)
        return ev

    def family_of(self, obj: Obj) -> Family:
        if obj.family is None:
            obj.family = Family(mode="train" if self.reached else None, members=[obj])
        return obj.family

    def _merge_families(self, objs: list[Obj]) -> Family:
        fams: list[Family] = []
        for o in objs:
            f = self.family_of(o)
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

    def text(self, node: ast.AST | None, limit: int = 60) -> str:
        if node is None:
            return "?"
        cached = self._texts.get(id(node))
        if cached is None:
            try:
                cached = ast.unparse(node)
            except Exception:  # pragma: no cover - unparse handles every node the parser makes
                cached = "?"
            self._texts[id(node)] = cached
        return cached if len(cached) <= limit else cached[: limit - 1] + "…"

    def _conditional_here(self) -> bool:
        return any(c.kind in ("cond", "rank", "loop", "try") for c in self.ctx[self.frame.ctx_base :])

    # ------------------------------------------------------------------ statements

    def block(self, stmts: list[ast.stmt]) -> bool:
        """Walk statements in order; True when the block always ends in return/raise/break/continue/exit."""
        pushed = 0
        try:
            for st in stmts:
                self._guard = None
                if self.stmt(st):
                    return True
                guard, self._guard = self._guard, None
                if guard is not None:
                    self.ctx.append(Ctx(guard[0], st, guard[1], self.frame.id, guard[2], guard[3]))
                    pushed += 1
            return False
        finally:
            if pushed:
                del self.ctx[len(self.ctx) - pushed :]

    def stmt(self, st: ast.stmt) -> bool:
        self._visits += 1
        handler = getattr(self, "st_" + type(st).__name__, None)
        if handler is None:
            return False
        depth = (len(self.ctx), len(self.frames), len(self._active), self._forward_depth)
        try:
            return bool(handler(st))
        except RecursionError:
            self.errors.append(f"line {getattr(st, 'lineno', 0)}: nesting too deep")
        except Exception as exc:  # one statement the walker does not understand must not end the analysis
            self.errors.append(f"line {getattr(st, 'lineno', 0)}: {type(exc).__name__}: {exc}")
        del self.ctx[depth[0] :]
        del self.frames[depth[1] :]
        del self._active[depth[2] :]
        self._forward_depth = depth[3]
        return False

    def st_Expr(self, st: ast.Expr) -> bool:
        if isinstance(st.value, ast.Call):
            self._bare_calls.add(id(st.value))
        self.eval(st.value)
        return isinstance(st.value, ast.Call) and self.text(st.value.func) in _EXIT_CALLS

    def st_Assign(self, st: ast.Assign) -> None:
        value = self.eval(st.value)
        for target in st.targets:
            self.bind(target, value)
            self._note_assignment(target, value, st)

    def st_AnnAssign(self, st: ast.AnnAssign) -> None:
        if st.value is not None:
            value = self.eval(st.value)
            self.bind(st.target, value)
            self._note_assignment(st.target, value, st)

    def st_AugAssign(self, st: ast.AugAssign) -> None:
        current = self.eval(st.target)
        rhs = self.eval(st.value)
        value = (self._binop_value(st, type(st.op), current, rhs),)
        self.bind(st.target, value)
        self._note_assignment(st.target, value, st)

    def _note_assignment(self, target: ast.AST, value: Value, st: ast.stmt) -> None:
        ident = _target_ident(target)
        if ident is None:
            return
        tags = tags_of(value)
        if N.is_lr_name(ident):
            self.emit("lr_assign", st, target=self.text(target), value=value, tags=tags)
        elif N.is_loss_name(ident) and any(scaled_up_by_world(o) for o in value):
            self.emit("loss_scaled", st, target=self.text(target), tags=tags)

    def st_Return(self, st: ast.Return) -> bool:
        value = self.eval(st.value) if st.value is not None else (self.const(None, st),)
        self.frame.returns.append(value)
        return True

    def st_Raise(self, st: ast.Raise) -> bool:
        return True

    def st_Continue(self, st: ast.Continue) -> bool:
        return True

    def st_Break(self, st: ast.Break) -> bool:
        return True

    def st_Global(self, st: ast.Global) -> None:
        self.frame.globals_declared.update(st.names)

    def st_Nonlocal(self, st: ast.Nonlocal) -> None:
        self.frame.nonlocal_declared.update(st.names)

    def st_Import(self, st: ast.Import) -> None:
        for alias in st.names:
            if alias.asname:
                self.bind_name(alias.asname, (self.new("qual", st, qual=alias.name, label=alias.asname),))
            else:
                top = alias.name.split(".")[0]
                self.bind_name(top, (self.new("qual", st, qual=top, label=top),))

    def st_ImportFrom(self, st: ast.ImportFrom) -> None:
        module = "." * (st.level or 0) + (st.module or "")
        for alias in st.names:
            if alias.name == "*":
                continue
            q = f"{module}.{alias.name}" if module and not module.endswith(".") else f"{module}{alias.name}"
            name = alias.asname or alias.name
            self.bind_name(name, (self.new("qual", st, qual=q, label=name),))

    def st_FunctionDef(self, st: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        frame = self.frame
        cls = frame.cls if frame.is_class_body else None
        closure = frame.lexical if frame.is_class_body else frame
        fobj = self._define_function(st, closure or self.module_frame, cls=cls, evaluate_defaults=True)
        self.bind_name(st.name, (fobj,))

    st_AsyncFunctionDef = st_FunctionDef

    def _define_function(self, st: ast.FunctionDef | ast.AsyncFunctionDef, closure: Frame, cls: Obj | None, evaluate_defaults: bool) -> Obj:
        decorators = [self.eval(d) for d in st.decorator_list] if evaluate_defaults else []
        defaults = [self.eval(d) for d in st.args.defaults] if evaluate_defaults else []
        kw_defaults = {
            a.arg: self.eval(d) for a, d in zip(st.args.kwonlyargs, st.args.kw_defaults) if d is not None and evaluate_defaults
        }
        parent = self.frames[-1] if self.frames else None
        if cls is not None:
            qualname = f"{cls.label}.{st.name}"
        elif parent is not None and parent.name != "<module>" and not parent.is_class_body:
            qualname = f"{parent.name}.{st.name}"
        else:
            qualname = st.name
        deco_names = {_dotted_last(d) for d in st.decorator_list}
        fobj = self.new(
            "function",
            st,
            label=st.name,
            props={
                "node": st,
                "closure": closure,
                "cls": cls,
                "qualname": qualname,
                "defaults": defaults,
                "kw_defaults": kw_defaults,
                "decorators": decorators,
                "decorator_names": deco_names,
                "staticmethod": "staticmethod" in deco_names,
                "classmethod": "classmethod" in deco_names,
                "property": "property" in deco_names or "cached_property" in deco_names,
            },
        )
        self._function_objs[st] = fobj
        return fobj

    def st_ClassDef(self, st: ast.ClassDef) -> None:
        bases = [self.eval(b) for b in st.bases]
        cls = self.new("class", st, label=st.name, props={"node": st, "bases": bases})
        cls.props.update(self._class_kind(bases, st))
        self._classes[st] = cls
        frame = Frame(
            id=next(self._frame_ids),
            name=st.name,
            locals={},
            lexical=self.frame,
            node=st,
            cls=cls,
            is_class_body=True,
            ctx_base=len(self.ctx),
        )
        self.frames.append(frame)
        try:
            self.block(st.body)
        finally:
            self.frames.pop()
        cls.fields = dict(frame.locals)
        self.bind_name(st.name, (cls,))

    def _class_kind(self, bases: list[Value], st: ast.ClassDef) -> dict[str, Any]:
        kind = "instance"
        out: dict[str, Any] = {}
        for base in bases:
            for b in base:
                if b.kind == "class":
                    if b.props.get("instance_kind", "instance") != "instance":
                        kind = b.props["instance_kind"]
                        for k in ("distributed_sampler", "wrapper_base"):
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
                elif last == "Module" or (q.startswith("torch.nn.") and last[:1].isupper() and q.count(".") == 2) or last in (
                    "LightningModule",
                    "PreTrainedModel",
                ):
                    kind = "module"
        out["instance_kind"] = kind
        body_names = {n.name for n in st.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        out["overrides_iter"] = "__iter__" in body_names
        return out

    def st_If(self, st: ast.If) -> bool:
        test = self.eval(st.test)
        scope = None
        if _is_main_guard(st.test):
            kind, info, else_info = None, None, None
        else:
            polarity = self.rank_condition(test, st.test)
            if polarity is not None:
                kind, info, else_info = "rank", polarity, _flip(polarity)
                scope = self.rank_scope(test)
            else:
                kind, info, else_info = "cond", self.text(st.test), "not " + self.text(st.test)
        frame = self.frame
        before = dict(frame.locals)
        if kind:
            self.ctx.append(Ctx(kind, st, info, frame.id, 0, scope))
        try:
            ended_body = self.block(st.body)
        finally:
            if kind:
                self.ctx.pop()
        after_body = frame.locals
        frame.locals = dict(before)
        if kind:
            self.ctx.append(Ctx(kind, st, else_info, frame.id, 1, scope))
        try:
            ended_else = self.block(st.orelse)
        finally:
            if kind:
                self.ctx.pop()
        after_else = frame.locals
        if ended_body and ended_else:
            frame.locals = _merge_env(after_body, after_else)
            return True
        if ended_body:
            frame.locals = after_else
            if kind and not st.orelse:
                self._guard = (kind, else_info, 1, scope)
        elif ended_else:
            frame.locals = after_body
            if kind:
                self._guard = (kind, info, 0, scope)
        else:
            frame.locals = _merge_env(after_body, after_else)
        return False

    def st_For(self, st: ast.For | ast.AsyncFor) -> None:
        iterable = self.eval(st.iter)
        loaders = self.loaders_in(iterable)
        if loaders:
            self.emit("iterate", st, loaders=loaders, loop=st, iterable=self.text(st.iter))
        element = self.element_of(iterable, st)
        frame = self.frame
        before = dict(frame.locals)
        info = {"loaders": loaders, "iter": self.text(st.iter), "target": self.text(st.target), "kind": self._loop_kind(st, iterable, loaders)}
        self.ctx.append(Ctx("loop", st, info, frame.id))
        try:
            self.bind(st.target, element)
            self.block(st.body)
        finally:
            self.ctx.pop()
        frame.locals = _merge_env(before, frame.locals)
        self.block(st.orelse)

    st_AsyncFor = st_For

    def _loop_kind(self, st: ast.For | ast.AsyncFor, iterable: Value, loaders: tuple[Obj, ...]) -> str:
        if loaders:
            return "loader"
        if any(o.kind == "range" for o in iterable):
            return "range"
        return "other"

    def st_While(self, st: ast.While) -> None:
        self.eval(st.test)
        frame = self.frame
        before = dict(frame.locals)
        self.ctx.append(Ctx("loop", st, {"loaders": (), "iter": self.text(st.test), "target": "", "kind": "while"}, frame.id))
        try:
            self.block(st.body)
        finally:
            self.ctx.pop()
        frame.locals = _merge_env(before, frame.locals)
        self.block(st.orelse)

    def st_With(self, st: ast.With | ast.AsyncWith) -> bool:
        pushed = 0
        try:
            for item in st.items:
                value = self.eval(item.context_expr)
                kinds_here: set[str] = set()
                for o in value:
                    if o.kind == "ctx" and o.props["ctx"] not in kinds_here:
                        kinds_here.add(o.props["ctx"])
                        self.ctx.append(Ctx(o.props["ctx"], st, o.props.get("mode"), self.frame.id))
                        pushed += 1
                    elif o.kind == "qual" and N.canonical(o.qual or "") in ("torch.no_grad", "torch.inference_mode"):
                        self.ctx.append(Ctx("grad", st, "off", self.frame.id))
                        pushed += 1
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, (self.unknown(item.optional_vars, label=self.text(item.optional_vars)),))
            return self.block(st.body)
        finally:
            if pushed:
                del self.ctx[len(self.ctx) - pushed :]

    st_AsyncWith = st_With

    def st_Try(self, st: ast.Try) -> bool:
        frame = self.frame
        self.ctx.append(Ctx("try", st, None, frame.id))
        try:
            self.block(st.body)
        finally:
            self.ctx.pop()
        after_body = frame.locals
        for handler in st.handlers:
            frame.locals = dict(after_body)
            if handler.name:
                self.bind_name(handler.name, (self.unknown(handler, label=handler.name),))
            self.ctx.append(Ctx("try", handler, None, frame.id))
            try:
                self.block(handler.body)
            finally:
                self.ctx.pop()
            after_body = _merge_env(after_body, frame.locals)
        frame.locals = after_body
        self.block(st.orelse)
        return self.block(st.finalbody)

    st_TryStar = st_Try

    def st_Match(self, st: ast.Match) -> None:
        self.eval(st.subject)
        frame = self.frame
        before = dict(frame.locals)
        merged = dict(before)
        for i, case in enumerate(st.cases):
            frame.locals = dict(before)
            self.ctx.append(Ctx("cond", st, self.text(case.pattern), frame.id, i))
            try:
                self.block(case.body)
            finally:
                self.ctx.pop()
            merged = _merge_env(merged, frame.locals)
        frame.locals = merged

    # ------------------------------------------------------------------ names and binding

    def lookup(self, name: str, node: ast.AST) -> Value:
        frame = self.frame
        if name in frame.globals_declared:
            chain: list[Frame] = [self.module_frame]
        else:
            chain = []
            f: Frame | None = frame
            while f is not None:
                if not (f.is_class_body and f is not frame):
                    chain.append(f)
                f = f.lexical
            if self.module_frame not in chain:
                chain.append(self.module_frame)
        for f in chain:
            if name in f.locals:
                return f.locals[name]
        if name in N.UNIMPORTED_NAMES and name not in self._bound_names:
            return (self.new("qual", node, qual=N.UNIMPORTED_NAMES[name], label=name, props={"heuristic": True}),)
        if name in _BUILTINS:
            return (self.new("builtin", node, label=name),)
        ph = self._placeholders.get(name)
        if ph is None:
            tags = N.name_tags(name)
            ph = self.unknown(node, label=name, tags=tags, free=True, rank_direct=bool(tags & PER_RANK_TAGS))
            self._placeholders[name] = ph
        return (ph,)

    def bind_name(self, name: str, value: Value) -> None:
        frame = self.frame
        if name in frame.globals_declared:
            self.module_frame.locals[name] = value
            return
        if name in frame.nonlocal_declared:
            f = frame.lexical
            while f is not None:
                if name in f.locals:
                    f.locals[name] = value
                    return
                f = f.lexical
        frame.locals[name] = self._tag_by_name(name, value)
        self._label(value, name)

    def _tag_by_name(self, name: str, value: Value) -> Value:
        """A literal stored under a world-size name (`world_size = 2`) is a world size: `lr * world_size` scales."""
        if "world_size" not in N.name_tags(name) or not value:
            return value
        out: list[Obj] = []
        for o in value:
            if o.kind == "const" and isinstance(o.value, int) and not (o.tags & WORLD_TAGS):
                o = Obj(kind="const", line=o.line, node=o.node, label=name, tags=o.tags | {"world_size", "named"}, const=True, value=o.value)
            out.append(o)
        return tuple(out)

    def _label(self, value: Value, text: str) -> None:
        for o in value:
            if o.kind in ("module", "wrapper", "optimizer", "sampler", "loader", "dataset", "scheduler", "instance", "iterable_dataset", "unknown", "state_dict", "dict", "params"):
                o.props.setdefault("bound_name", text)

    def bind(self, target: ast.AST, value: Value) -> None:
        if isinstance(target, ast.Name):
            self.bind_name(target.id, value)
        elif isinstance(target, ast.Attribute):
            bases = self.eval(target.value)
            text = self.text(target)
            self._label(value, text)
            real = [b for b in bases if b.kind not in ("qual", "const", "builtin")]
            strong = len(real) == 1 and not self._conditional_here()
            for b in real:
                self._set_field(b, target.attr, value, strong)
        elif isinstance(target, ast.Subscript):
            bases = self.eval(target.value)
            key = self._const_key(target.slice)
            for b in bases:
                if b.kind == "qual" and N.canonical(b.qual or "") == "os.environ":
                    self.emit("env_write", target, var=key, value=value)
                elif b.kind in ("dict", "unknown", "instance", "cli_args", "state_dict") and isinstance(key, (str, int)):
                    self._set_field(b, f"[{key}]" if b.kind != "dict" else str(key), value, strong=False)
        elif isinstance(target, (ast.Tuple, ast.List)):
            self._unpack(target.elts, value, target)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, (self.new("tuple", target, props={"elem": self.element_of(value, target)}),))

    def _set_field(self, obj: Obj, name: str, value: Value, strong: bool) -> None:
        if strong or name not in obj.fields:
            obj.fields[name] = value
        else:
            obj.fields[name] = _capped(union(obj.fields[name], value))

    def _unpack(self, elts: list[ast.expr], value: Value, node: ast.AST) -> None:
        n = len(elts)
        star = next((i for i, e in enumerate(elts) if isinstance(e, ast.Starred)), None)
        per_target: list[list[Value]] = [[] for _ in range(n)]
        for o in value:
            if o.kind == "tuple" and o.items is not None and star is None and len(o.items) == n:
                for i in range(n):
                    per_target[i].append(o.items[i])
            elif o.kind == "tuple" and o.items is None and "elem" in o.props:
                for i in range(n):
                    per_target[i].append(o.props["elem"])
            else:
                for i in range(n):
                    per_target[i].append((self._derived(o, f"[{i}]", node),))
        for i, e in enumerate(elts):
            self.bind(e, union(*per_target[i]))

    def _const_key(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, int)):
            return node.value
        return None

    # ------------------------------------------------------------------ expressions

    def eval(self, node: ast.AST | None) -> Value:
        if node is None:
            return EMPTY
        self._visits += 1
        handler = getattr(self, "ex_" + type(node).__name__, None)
        if handler is None:
            return (self.unknown(node),)
        return handler(node)

    def ex_Constant(self, node: ast.Constant) -> Value:
        return (self.const(node.value, node),)

    def ex_Name(self, node: ast.Name) -> Value:
        return self._on_path(self.lookup(node.id, node))

    def ex_Attribute(self, node: ast.Attribute) -> Value:
        out: list[Obj] = []
        for b in self.eval(node.value):
            out.extend(self.get_attr(b, node.attr, node))
        return self._on_path(union(out))

    def ex_Subscript(self, node: ast.Subscript) -> Value:
        bases = self.eval(node.value)
        self.eval(node.slice)  # a subscript can call things too (`x[f(y)]`)
        key = self._const_key(node.slice)
        out: list[Obj] = []
        for b in bases:
            if b.kind == "qual" and N.canonical(b.qual or "") == "os.environ":
                out.append(self._env_read(node, key, None))
            elif b.kind == "tuple":
                if b.items is not None and isinstance(key, int) and -len(b.items) <= key < len(b.items):
                    out.extend(b.items[key])
                elif b.items is not None:
                    out.extend(union(*b.items) if not isinstance(node.slice, ast.Slice) else (b,))
                else:
                    out.extend(b.props.get("elem") or (self._derived(b, "[]", node),))
            elif b.kind == "dict":
                if isinstance(key, str) and key in b.fields:
                    out.extend(b.fields[key])
                elif key is None:
                    out.extend(union(*b.fields.values()) or (self._derived(b, "[]", node),))
                else:
                    out.append(self._derived(b, f"[{key}]", node))
            else:
                out.append(self._derived(b, f"[{key}]" if key is not None else "[]", node, key_name=key if isinstance(key, str) else None))
        return union(out)

    def ex_Starred(self, node: ast.Starred) -> Value:
        return self.eval(node.value)

    def _sequence(self, node: ast.List | ast.Tuple | ast.Set) -> Value:
        items: list[Value] = []
        open_ended = False
        for e in node.elts:
            if isinstance(e, ast.Starred):
                v = self.eval(e.value)
                tup = [o for o in v if o.kind == "tuple" and o.items is not None]
                if len(v) == 1 and tup:
                    items.extend(tup[0].items)
                else:
                    open_ended = True
                    items.append(self.element_of(v, e))
            else:
                items.append(self.eval(e))
        const = all(is_constant(i) for i in items) and not open_ended
        value = tuple(o.value for i in items for o in i[:1]) if const and all(len(i) == 1 for i in items) else None
        obj = self.new("tuple", node, items=None if open_ended else tuple(items), const=const, value=value)
        if open_ended:
            obj.props["elem"] = union(*items)
        obj.tags = tags_of(union(*items)) - {"rank_cond"}
        return (obj,)

    ex_List = _sequence
    ex_Tuple = _sequence
    ex_Set = _sequence

    def ex_Dict(self, node: ast.Dict) -> Value:
        obj = self.new("dict", node)
        for k, v in zip(node.keys, node.values):
            value = self.eval(v)
            if k is None:
                for o in value:
                    if o.kind == "dict":
                        for fk, fv in o.fields.items():
                            obj.fields[fk] = union(obj.fields.get(fk, ()), fv)
                continue
            self.eval(k)
            key = self._const_key(k)
            name = str(key) if key is not None else "*"
            obj.fields[name] = union(obj.fields.get(name, ()), value)
        return (obj,)

    def ex_JoinedStr(self, node: ast.JoinedStr) -> Value:
        parts = [self.eval(v) for v in node.values]
        const = all(is_constant(p) for p in parts)
        text = "".join(str(p[0].value) if p and p[0].kind == "const" else "{}" for p in parts)
        tags = frozenset().union(*(tags_of(p) for p in parts)) - {"rank_cond"}
        return (self.new("value", node, tags=tags, const=const, value=text if const else None, props={"text": text}),)

    def ex_FormattedValue(self, node: ast.FormattedValue) -> Value:
        return self.eval(node.value)

    def ex_BinOp(self, node: ast.BinOp) -> Value:
        left = self.eval(node.left)
        right = self.eval(node.right)
        return (self._binop_value(node, type(node.op), left, right),)

    def _binop_value(self, node: ast.AST, op: type, left: Value, right: Value) -> Obj:
        const = is_constant(left) and is_constant(right)
        value = None
        if const and len(left) == 1 and len(right) == 1 and op in _BIN_OPS:
            a, b = left[0].value, right[0].value
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
                try:
                    value = _BIN_OPS[op](a, b)
                except (ArithmeticError, ValueError):
                    value = None
        tags = (tags_of(left) | tags_of(right)) - {"rank_cond"}
        direct = any(o.props.get("rank_direct") for o in union(left, right))
        return self.new(
            "value",
            node,
            tags=tags,
            const=const,
            value=value,
            props={"op": op.__name__, "left": left, "right": right, "rank_direct": direct},
        )

    def ex_UnaryOp(self, node: ast.UnaryOp) -> Value:
        operand = self.eval(node.operand)
        if isinstance(node.op, ast.Not):
            polarity = self.rank_condition(operand, node.operand)
            if polarity is not None:
                props = {"polarity": _flip(polarity), "scope": self.rank_scope(operand)}
                return (self.new("value", node, tags=frozenset({"rank_cond"}), props=props),)
            return (self.new("value", node),)
        const = is_constant(operand)
        value = None
        if const and len(operand) == 1 and isinstance(operand[0].value, (int, float)) and isinstance(node.op, ast.USub):
            value = -operand[0].value
        direct = any(o.props.get("rank_direct") for o in operand)
        return (self.new("value", node, tags=tags_of(operand) - {"rank_cond"}, const=const, value=value, props={"rank_direct": direct}),)

    def ex_BoolOp(self, node: ast.BoolOp) -> Value:
        values = [self.eval(v) for v in node.values]
        polarities = [self.rank_condition(v, n) for v, n in zip(values, node.values)]
        present = [p for p in polarities if p is not None]
        if present:
            scopes = [self.rank_scope(v) for v, p in zip(values, polarities) if p is not None]
            if isinstance(node.op, ast.And):
                polarity = "main" if "main" in present else ("nonmain" if "nonmain" in present else "other")
                # `local_rank == 0 and rank == 0` holds on the global main process only
                main_scopes = [s for s, p in zip(scopes, present) if p == polarity] or scopes
                scope = "global" if "global" in main_scopes else _narrowest_local(main_scopes)
            else:
                polarity = present[0] if all(p == present[0] for p in present) else "other"
                # `not distributed or local_rank == 0`: local rank 0 of every node passes
                local = [s for s in scopes if s != "global"]
                scope = _narrowest_local(local) if local else "global"
            return (self.new("value", node, tags=frozenset({"rank_cond"}), props={"polarity": polarity, "scope": scope}),)
        return union(*values)

    def ex_Compare(self, node: ast.Compare) -> Value:
        operands = [self.eval(node.left)] + [self.eval(c) for c in node.comparators]
        ranked = [i for i, v in enumerate(operands) if self._is_rank_value(v)]
        if not ranked:
            return (self.new("value", node),)
        results: list[str | None] = []
        for i, op in enumerate(node.ops):
            left, right = operands[i], operands[i + 1]
            lr, rr = i in ranked, (i + 1) in ranked
            if not lr and not rr:
                continue
            if lr and rr:
                results.append("other")
                continue
            other = right if lr else left
            consts = [o.value for o in other if o.const]
            if not consts or len(consts) != len(other):
                results.append("other")
                continue
            results.append(_rank_polarity(type(op), consts[0], rank_on_left=lr))
        present = [r for r in results if r is not None]
        if not present:
            return (self.new("value", node),)
        polarity = present[0] if all(p == present[0] for p in present) else "other"
        scope = _combine_scopes([_value_scope(operands[i]) for i in ranked])
        return (self.new("value", node, tags=frozenset({"rank_cond"}), props={"polarity": polarity, "scope": scope}),)

    def _is_rank_value(self, value: Value) -> bool:
        return any((o.tags & PER_RANK_TAGS) and (o.props.get("rank_direct") or o.kind in ("value", "unknown")) and not o.const for o in value)

    def rank_condition(self, value: Value, node: ast.AST | None = None) -> str | None:
        """"main" | "nonmain" | "other" when a test is true on a subset of ranks; None when it is uniform."""
        polarities = [o.props.get("polarity", "main") for o in value if "rank_cond" in o.tags]
        if polarities:
            return polarities[0] if all(p == polarities[0] for p in polarities) else "other"
        if any((o.tags & PER_RANK_TAGS) and o.props.get("rank_direct") and not o.const for o in value):
            return "nonmain"  # `if rank:` is true on every rank but 0
        return None

    def rank_scope(self, value: Value) -> str:
        """Which rank a rank condition reads (see `Ctx.scope`): "global" unless every way the test can be
        computed reads a node-local rank."""
        conds = [o for o in value if "rank_cond" in o.tags]
        if conds:
            return _combine_scopes([o.props.get("scope") or N.main_predicate_scope(o.label) for o in conds])
        return _value_scope(value)

    def ex_IfExp(self, node: ast.IfExp) -> Value:
        self.eval(node.test)
        frame_id = self.frame.id
        sides: list[Value] = []
        for branch, part in ((0, node.body), (1, node.orelse)):
            self.ctx.append(Ctx("cond", node, self.text(node.test), frame_id, branch))
            try:
                sides.append(self.eval(part))
            finally:
                self.ctx.pop()
        return union(*sides)

    def ex_Lambda(self, node: ast.Lambda) -> Value:
        frame = self.frame
        closure = frame.lexical if frame.is_class_body else frame
        defaults = [self.eval(d) for d in node.args.defaults]
        return (
            self.new(
                "function",
                node,
                label="<lambda>",
                props={
                    "node": node,
                    "closure": closure,
                    "cls": None,
                    "qualname": f"{frame.name}.<lambda>",
                    "defaults": defaults,
                    "kw_defaults": {},
                    "decorators": [],
                    "decorator_names": set(),
                    "staticmethod": False,
                    "classmethod": False,
                    "property": False,
                },
            ),
        )

    def _comprehension(self, node: ast.AST, generators: list[ast.comprehension], elts: list[ast.expr]) -> list[Value]:
        frame = self.frame
        saved = dict(frame.locals)
        try:
            for gen in generators:
                iterable = self.eval(gen.iter)
                loaders = self.loaders_in(iterable)
                if loaders:
                    self.emit("iterate", node, loaders=loaders, loop=node, iterable=self.text(gen.iter))
                self.bind(gen.target, self.element_of(iterable, gen))
                for cond in gen.ifs:
                    self.eval(cond)
            return [self.eval(e) for e in elts]
        finally:
            frame.locals = saved

    def ex_ListComp(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp) -> Value:
        (elem,) = self._comprehension(node, node.generators, [node.elt])
        return (self.new("tuple", node, props={"elem": elem}, tags=tags_of(elem) - {"rank_cond"}),)

    ex_SetComp = ex_ListComp
    ex_GeneratorExp = ex_ListComp

    def ex_DictComp(self, node: ast.DictComp) -> Value:
        _, value = self._comprehension(node, node.generators, [node.key, node.value])
        obj = self.new("dict", node)
        obj.fields["*"] = value
        return (obj,)

    def ex_NamedExpr(self, node: ast.NamedExpr) -> Value:
        value = self.eval(node.value)
        self.bind(node.target, value)
        return value

    def ex_Await(self, node: ast.Await) -> Value:
        return self.eval(node.value)

    def ex_Yield(self, node: ast.Yield | ast.YieldFrom) -> Value:
        if node.value is not None:
            self.eval(node.value)
        return (self.unknown(node),)

    ex_YieldFrom = ex_Yield

    def ex_Slice(self, node: ast.Slice) -> Value:
        for part in (node.lower, node.upper, node.step):
            self.eval(part)
        return (self.unknown(node),)

    # ------------------------------------------------------------------ attributes

    def _derived(self, base: Obj, name: str, node: ast.AST | None, key_name: str | None = None) -> Obj:
        """`base.name` (or `base[key]`) for an object whose attribute is not modelled; cached so it has one identity."""
        cached = base.fields.get(name)
        if cached:
            return cached[0] if len(cached) == 1 else self.new("unknown", node, props={"alternatives": cached})
        ident = key_name if key_name is not None else (name if not name.startswith("[") else None)
        tags = N.name_tags(ident)
        base_label = base.props.get("bound_name") or base.label
        label = f"{base_label}.{name}" if base_label and not name.startswith("[") else (f"{base_label}{name}" if base_label else name)
        props: dict[str, Any] = {"base": base, "attr": name, "rank_direct": bool(tags & PER_RANK_TAGS)}
        if base.kind == "cli_args" and ident in self.cli_args:
            default = self.cli_args[ident].default
            props["cli_arg"] = self.cli_args[ident]
            if default is not None:
                tags = tags | (tags_of(default) - {"rank_cond"})
                props["rank_direct"] = props["rank_direct"] or any(o.props.get("rank_direct") for o in default)
        if base.props.get("loaded") or base.props.get("from_load"):
            props["from_load"] = True
        obj = self.new("unknown", node, label=label, tags=tags, props=props)
        if base.kind not in ("const", "qual", "builtin", "value"):
            base.fields[name] = (obj,)
        return obj

    def get_attr(self, obj: Obj, name: str, node: ast.AST | None) -> Value:
        kind = obj.kind
        if kind == "qual":
            return (self.new("qual", node, qual=f"{obj.qual}.{name}", label=name, props=dict(heuristic=obj.props.get("heuristic", False))),)
        if kind == "wrapper" and name == "module":
            return obj.props.get("inner") or (self._derived(obj, name, node),)
        if name in obj.fields:
            return obj.fields[name]
        if kind == "loader" and name in ("sampler", "dataset", "batch_sampler"):
            return (self._derived(obj, name, node),)
        if kind == "param" and name == "grad":
            grad = self.new("grad", node, tags=frozenset({"grad"}), label=f"{obj.label}.grad", props={"owner": obj.props.get("owner", EMPTY)})
            obj.fields[name] = (grad,)
            return (grad,)
        if kind == "grad" and name == "data":
            return (obj,)
        cls = obj.props.get("class")
        if cls is not None or kind in ("class", "super"):
            found = self._attr_from_class(obj, name)
            if found is not None:
                return found
        return (self._derived(obj, name, node),)

    def _attr_from_class(self, obj: Obj, name: str) -> Value | None:
        if obj.kind == "class":
            attr = self._lookup_class_attr(obj, name)
            return attr
        if obj.kind == "super":
            start = obj.props.get("cls")
            if start is None:
                return None
            for base in start.props.get("bases", []):
                for b in base:
                    if b.kind == "class":
                        attr = self._lookup_class_attr(b, name)
                        if attr is not None:
                            return self._bind_methods(attr, obj.props.get("self") or EMPTY)
            return None
        attr = self._lookup_class_attr(obj.props["class"], name)
        if attr is None:
            return None
        return self._bind_methods(attr, (obj,))

    def _bind_methods(self, attr: Value, self_value: Value) -> Value:
        out: list[Obj] = []
        for a in attr:
            if a.kind == "function" and not a.props.get("staticmethod"):
                if a.props.get("property"):
                    out.extend(self.call_function(a, Args(), a.node, self_obj=self_value))
                else:
                    out.append(self.new("bound", a.node, label=a.label, props={"func": a, "self": self_value}))
            else:
                out.append(a)
        return tuple(out)

    def _lookup_class_attr(self, cls: Obj, name: str, seen: set[int] | None = None) -> Value | None:
        seen = seen or set()
        if id(cls) in seen:
            return None
        seen.add(id(cls))
        if name in cls.fields:
            return cls.fields[name]
        for base in cls.props.get("bases", []):
            for b in base:
                if b.kind == "class":
                    found = self._lookup_class_attr(b, name, seen)
                    if found is not None:
                        return found
        return None

    def _lookup_class_attr_objs(self, cls: Obj, name: str) -> Obj | None:
        found = self._lookup_class_attr(cls, name)
        if not found:
            return None
        for f in found:
            if f.kind == "function":
                return f
        return None

    # ------------------------------------------------------------------ calls

    def build_args(self, node: ast.Call) -> Args:
        args = Args()
        for a in node.args:
            if isinstance(a, ast.Starred):
                v = self.eval(a.value)
                tup = [o for o in v if o.kind == "tuple" and o.items is not None]
                if len(v) == 1 and tup:
                    args.pos.extend(tup[0].items)
                    args.pos_nodes.extend([a] * len(tup[0].items))
                else:
                    args.opaque = True
            else:
                args.pos.append(self.eval(a))
                args.pos_nodes.append(a)
        for k in node.keywords:
            v = self.eval(k.value)
            if k.arg is None:
                dicts = [o for o in v if o.kind == "dict"]
                if len(v) == 1 and dicts:
                    for fk, fv in dicts[0].fields.items():
                        if fk != "*":
                            args.kw[fk] = fv
                    args.opaque = args.opaque or "*" in dicts[0].fields
                else:
                    args.opaque = True
            else:
                args.kw[k.arg] = v
                args.kw_nodes[k.arg] = k.value
        return args

    def ex_Call(self, node: ast.Call) -> Value:
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("detach", "detach_") and isinstance(node.func.value, ast.Call):
            self._detached_calls.add(id(node.func.value))
        if isinstance(node.func, ast.Attribute):
            receiver = self.eval(node.func.value)
            args = self.build_args(node)
            return self.method_call(receiver, node.func.attr, node, args)
        func = self.eval(node.func)
        args = self.build_args(node)
        return self.call_value(func, node, args)

    def call_value(self, func: Value, node: ast.Call, args: Args) -> Value:
        modules = tuple(o for o in func if o.is_module and o.kind not in ("class", "function", "bound"))
        out: list[Obj] = []
        if modules:
            out.extend(self.forward(modules, node, args))
        for o in func:
            if o in modules:
                continue
            kind = o.kind
            if kind == "function":
                out.extend(self.call_function(o, args, node))
            elif kind == "bound":
                out.extend(self.call_function(o.props["func"], args, node, self_obj=o.props["self"]))
            elif kind == "class":
                out.extend(self.instantiate(o, node, args))
            elif kind == "qual":
                out.extend(self.call_qual(o.qual or "", node, args, heuristic=o.props.get("heuristic", False)))
            elif kind == "builtin":
                out.extend(self.call_builtin(o.label or "", node, args))
            elif kind == "partial":
                merged = Args(
                    pos=list(o.props["args"].pos) + args.pos,
                    pos_nodes=list(o.props["args"].pos_nodes) + args.pos_nodes,
                    kw={**o.props["args"].kw, **args.kw},
                    kw_nodes={**o.props["args"].kw_nodes, **args.kw_nodes},
                    opaque=o.props["args"].opaque or args.opaque,
                )
                out.extend(self.call_value(o.props["func"], node, merged))
            elif kind == "loss":
                out.append(self.new("tensor", node, props={"loss": True}))
            else:
                out.extend(self.generic_call(o, _dotted_last(node.func), node, args))
        return _capped(union(out)) or (self.unknown(node),)

    def generic_call(self, func: Obj | None, name: str | None, node: ast.Call, args: Args, qual: str | None = None) -> Value:
        """A call whose target is not modelled: keep where its result came from (world size, grads) and its name."""
        tags = _depends(args.all())
        props: dict[str, Any] = {"call": name, "call_args": args, "qual": qual}
        base_name = name[4:] if name and name.startswith("get_") else name
        if name and N.is_main_predicate(name):
            tags = frozenset({"rank_cond", "named"})
            props["polarity"] = "main"
            props["scope"] = N.main_predicate_scope(name)
        elif base_name:
            nt = N.name_tags(base_name) - {"rank_cond"}
            if nt & (PER_RANK_TAGS | {"world_size"}) and (name.startswith("get_") or base_name == name):
                tags = tags | nt
                props["rank_direct"] = bool(nt & PER_RANK_TAGS)
        const = bool(qual and qual.startswith("math.") and is_constant(args.all()))
        label = (func.props.get("bound_name") or func.label) if func is not None else name
        if "grad" in tags:
            props["owner"] = _grad_owners(args.all() + ((func,) if func is not None else ()))
        self.emit("call", node, name=name, qual=qual, args=args, func=func)
        return (self.new("unknown", node, label=f"{label}()" if label else None, tags=tags, const=const, props=props),)

    def call_function(self, fobj: Obj, args: Args, node: ast.AST, self_obj: Value | None = None) -> Value:
        fnode = fobj.props["node"]
        if self._visits > VISIT_BUDGET:
            self.truncated = True
            return (self.unknown(node),)
        if fnode in self._active or len(self.frames) > MAX_DEPTH:
            return (self.unknown(node),)
        count = self._inlined.get(fnode, 0)
        if count >= MAX_INLINE_PER_FUNCTION:
            # a helper called from many places was walked enough times: reuse what it returned
            return self._summaries.get(fnode) or (self.unknown(node),)
        self._inlined[fnode] = count + 1
        self._walked.add(fnode)
        frame = Frame(
            id=next(self._frame_ids),
            name=fobj.props["qualname"],
            locals={},
            lexical=fobj.props["closure"],
            node=fnode,
            cls=fobj.props.get("cls"),
        )
        self._bind_params(frame, fobj, args, self_obj)
        pushed = 0
        for deco in fobj.props.get("decorators", []):
            for o in deco:
                if o.kind == "ctx" and o.props["ctx"] == "grad":
                    self.ctx.append(Ctx("grad", fnode, o.props.get("mode"), frame.id))
                    pushed += 1
                    break
                if o.kind == "qual" and N.canonical(o.qual or "") in ("torch.no_grad", "torch.inference_mode"):
                    self.ctx.append(Ctx("grad", fnode, "off", frame.id))
                    pushed += 1
                    break
        if any(N.is_rank_zero_decorator(n) for n in fobj.props.get("decorator_names", ())):
            self.ctx.append(Ctx("rank", fnode, "main", frame.id, 0, "global"))
            pushed += 1
        frame.ctx_base = len(self.ctx)
        self.frames.append(frame)
        self._active.append(fnode)
        try:
            if isinstance(fnode, ast.Lambda):
                result = self.eval(fnode.body)
            else:
                self.block(fnode.body)
                result = _capped(union(*frame.returns)) if frame.returns else (self.const(None, node),)
        finally:
            self._active.pop()
            self.frames.pop()
            if pushed:
                del self.ctx[len(self.ctx) - pushed :]
        self._summaries[fnode] = _capped(union(self._summaries.get(fnode, EMPTY), result))
        return result

    def _bind_params(self, frame: Frame, fobj: Obj, args: Args, self_obj: Value | None) -> None:
        fnode = fobj.props["node"]
        spec = fnode.args
        positional = list(spec.posonlyargs) + list(spec.args)
        values = list(args.pos)
        if self_obj is not None:
            values = [self_obj] + values
        defaults = fobj.props.get("defaults", [])
        first_default = len(positional) - len(defaults)
        for i, p in enumerate(positional):
            if i < len(values):
                v = values[i]
            elif p.arg in args.kw:
                v = args.kw[p.arg]
            elif i >= first_default and defaults:
                v = defaults[i - first_default]
            else:
                v = (self._param_unknown(p.arg, p),)
            frame.locals[p.arg] = self._tag_by_name(p.arg, v)
            self._label(v, p.arg)
        if spec.vararg is not None:
            rest = values[len(positional) :]
            tup = self.new("tuple", spec.vararg, items=None if args.opaque else tuple(rest))
            if args.opaque:
                tup.props["elem"] = (self.unknown(spec.vararg),)
            frame.locals[spec.vararg.arg] = (tup,)
        kw_defaults = fobj.props.get("kw_defaults", {})
        for p in spec.kwonlyargs:
            if p.arg in args.kw:
                frame.locals[p.arg] = args.kw[p.arg]
            elif p.arg in kw_defaults:
                frame.locals[p.arg] = kw_defaults[p.arg]
            else:
                frame.locals[p.arg] = (self._param_unknown(p.arg, p),)
        if spec.kwarg is not None:
            known = {p.arg for p in positional} | {p.arg for p in spec.kwonlyargs}
            d = self.new("dict", spec.kwarg)
            for k, v in args.kw.items():
                if k not in known:
                    d.fields[k] = v
            frame.locals[spec.kwarg.arg] = (d,)

    def _param_unknown(self, name: str, node: ast.AST) -> Obj:
        tags = N.name_tags(name)
        return self.unknown(node, label=name, tags=tags, param=name, rank_direct=bool(tags & PER_RANK_TAGS))

    def instantiate(self, cls: Obj, node: ast.AST, args: Args) -> Value:
        kind = cls.props.get("instance_kind", "instance")
        if kind == "wrapper":
            return self.wrap(node, args, "ddp", cls.label or "DistributedDataParallel", heuristic=False)
        inst = self._make_instance(cls, node)
        cls_node = cls.props["node"]
        self._instances.setdefault(cls_node, []).append(inst)
        if kind in ("dataset", "iterable_dataset"):
            inst.props["ctor_args"] = args
            inst.tags = frozenset({"rank_dep"}) if any(o.tags & (PER_RANK_TAGS | {"rank_dep"}) for o in args.all()) else frozenset()
        if kind == "optimizer":
            inst.props.update({"cls": cls.label, "params": args.get(0, "params"), "lr": args.get(None, "lr"), "custom": True})
        init = self._lookup_class_attr_objs(cls, "__init__")
        if init is not None:
            self.call_function(init, args, node, self_obj=(inst,))
        if kind == "sampler":
            self.emit("sampler", node, obj=inst)
        elif kind == "optimizer":
            self.emit("optimizer", node, obj=inst)
        return (inst,)

    def _make_instance(self, cls: Obj, node: ast.AST) -> Obj:
        kind = cls.props.get("instance_kind", "instance")
        inst = self.new(kind if kind != "wrapper" else "instance", node, label=cls.label, props={"class": cls})
        if kind == "module":
            inst.family = Family(mode="train" if self.reached else None, has_bn=self._class_has_bn(cls.props["node"]), members=[inst])
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

    def _class_has_bn(self, cls_node: ast.AST) -> bool:
        """Whether an nn.Module class of this file builds BatchNorm layers (directly, or through its own helpers)."""
        memo = self._has_bn_memo
        if cls_node in memo:
            return memo[cls_node]
        memo[cls_node] = False
        found = False
        for n in ast.walk(cls_node):
            ident = n.id if isinstance(n, ast.Name) else (n.attr if isinstance(n, ast.Attribute) else None)
            if ident is None:
                continue
            if "BatchNorm" in ident or ident in ("convert_sync_batchnorm", "convert_syncbn_model"):
                found = True
            elif isinstance(n, ast.Attribute) and _dotted(n).startswith(("models.", "torchvision.models.")):
                found = N.torchvision_model_has_bn(ident)
            elif ident in self._defs_by_name and isinstance(n, ast.Name):
                found = any(self._class_has_bn(d) for d in self._defs_by_name[ident] if d is not cls_node)
            if found:
                break
        memo[cls_node] = found
        return found

    # ------------------------------------------------------------------ methods

    def method_call(self, receiver: Value, name: str, node: ast.Call, args: Args) -> Value:
        modules = tuple(o for o in receiver if o.is_module)
        out: list[Obj] = []
        if modules:
            out.extend(self.module_method(modules, name, node, args))
        for o in receiver:
            if o in modules:
                continue
            out.extend(self.object_method(o, name, node, args))
        return union(out) or (self.unknown(node),)

    def module_method(self, modules: Value, name: str, node: ast.Call, args: Args) -> Value:
        if name in N.MODULE_MOVES:
            self.emit("move", node, target=modules, method=name, args=args)
            return modules
        if name in ("train", "eval"):
            mode: str | None = "eval" if name == "eval" else "train"
            if name == "train":
                flag = args.get(0, "mode")
                if flag is not None:
                    vals = [o.value for o in flag if o.kind == "const"]
                    mode = ("train" if vals[0] else "eval") if len(vals) == len(flag) == 1 else None
            for m in modules:
                self.family_of(m).mode = mode
            self.emit("mode", node, target=modules, mode=mode)
            return modules
        if name in ("parameters", "named_parameters"):
            return (self.new("params", node, props={"owner": modules, "named": name == "named_parameters"}),)
        if name == "state_dict":
            return (self.new("state_dict", node, props={"owner": modules}),)
        if name == "load_state_dict":
            self._emit_load(modules, node, args)
            return (self.unknown(node, label="load_state_dict()"),)
        if name == "forward":
            return self.forward(modules, node, args)
        if name == "module":
            inner = union(*(m.props.get("inner", EMPTY) for m in modules if m.kind == "wrapper"))
            if inner:
                return self.call_value(inner, node, args)
        if name == "no_sync":
            return (self.new("ctx", node, props={"ctx": "no_sync", "owner": modules}),)
        if name == "join":
            return (self.new("ctx", node, props={"ctx": "join", "owner": modules}),)
        if name in ("zero_grad", "apply", "requires_grad_", "share_memory", "float", "compile"):
            return modules
        out: list[Obj] = []
        rest: list[Obj] = []
        for m in modules:
            if m.props.get("class") is not None:
                found = self._attr_from_class(m, name)
                if found is not None:
                    out.extend(self.call_value(found, node, args))
                    continue
            if name in m.fields:
                out.extend(self.call_value(m.fields[name], node, args))
                continue
            rest.append(m)
        if rest:
            out.extend(self.generic_call(rest[0], name, node, args))
        return tuple(out)

    def _emit_load(self, target: Value, node: ast.Call, args: Args) -> None:
        strict = args.get(1, "strict")
        self.emit(
            "load_state_dict",
            node,
            target=target,
            state=args.get(0, "state_dict") or EMPTY,
            strict=strict,
            strict_node=args.node(1, "strict"),
            result_used=id(node) not in self._bare_calls,
        )

    def object_method(self, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
        kind = o.kind
        if kind == "qual":
            return self.call_qual(f"{o.qual}.{name}", node, args, heuristic=o.props.get("heuristic", False))
        # what the script does to samplers, losses and optimizers is recorded whoever implements the method
        emitted = False
        if name == "set_epoch":
            self.emit("set_epoch", node, target=(o,), arg=args.get(0, "epoch") or EMPTY, arg_node=args.node(0, "epoch"))
            emitted = True
        elif name == "backward" and kind != "class":
            self.emit("backward", node, target=(o,))
            emitted = True
        elif name == "step" and kind == "optimizer":
            self.emit("opt_step", node, target=(o,))
            emitted = True
        if kind in ("class", "super") or o.props.get("class") is not None:
            found = self._attr_from_class(o, name)
            if found is not None:
                return self.call_value(found, node, args)
        held = o.fields.get(name)
        if held and kind != "dict" and any(h.kind in _CALLABLE_KINDS or h.is_module for h in held):
            return self.call_value(held, node, args)
        if emitted:
            return (self.const(None, node),)
        if kind == "optimizer":
            if name == "zero_grad":
                return (self.const(None, node),)
            if name == "state_dict":
                return (self.new("state_dict", node, props={"owner": (o,), "optimizer": True}),)
        if kind == "scheduler" and name == "step":
            self.emit("sched_step", node, target=(o,))
            return (self.const(None, node),)
        if name in ("convert_sync_batchnorm", "convert_syncbn_model"):
            return self.convert_syncbn(node, args, name, True)
        if name == "step":
            optimizers = tuple(x for x in args.all() if x.kind == "optimizer")
            if optimizers:
                self.emit("opt_step", node, target=optimizers)
                return (self.unknown(node),)
            label = (o.props.get("bound_name") or o.label or "").lower()
            if kind == "unknown" and ("optim" in label or label.split(".")[-1] in ("opt", "optimizer")):
                self.emit("opt_step", node, target=(o,), heuristic=True)
                return (self.unknown(node),)
        if kind == "dict":
            if name in ("get", "setdefault", "pop"):
                key = self._const_key(node.args[0]) if node.args else None
                if isinstance(key, str) and key in o.fields:
                    return o.fields[key]
                default = args.get(1, None)
                return default or (self._derived(o, f"[{key}]", node),)
            if name == "update":
                for v in args.pos:
                    for d in v:
                        if d.kind == "dict":
                            for fk, fv in d.fields.items():
                                o.fields[fk] = union(o.fields.get(fk, ()), fv)
                for k, v in args.kw.items():
                    o.fields[k] = union(o.fields.get(k, ()), v)
                return (self.const(None, node),)
            if name in ("items", "values"):
                elem = union(*o.fields.values())
                if name == "items":
                    elem = (self.new("tuple", node, items=((self.unknown(node),), elem)),)
                return (self.new("tuple", node, props={"elem": elem}),)
        if kind == "tuple" and name in ("append", "extend", "insert"):
            added = args.pos[-1] if args.pos else EMPTY
            if name == "extend":
                added = self.element_of(added, node)
            if o.items is not None:
                o.props["elem"] = union(*o.items, added)
                o.items = None
            else:
                o.props["elem"] = union(o.props.get("elem", EMPTY), added)
            return (self.const(None, node),)
        if name == "add_argument" and args.pos:
            self._add_argument(node, args)
            return (self.unknown(node),)
        if name in ("add_argument_group", "add_mutually_exclusive_group", "add_subparsers", "add_parser"):
            return (self.new("parser", node),)
        if name == "parse_args":
            return (self.new("cli_args", node, label="args"),)
        if name == "parse_known_args":
            return (self.new("tuple", node, items=((self.new("cli_args", node, label="args"),), (self.unknown(node),))),)
        if name in _REPORT_METHODS:
            self.emit("report", node, args=args, name=name)
            return (self.const(None, node),)
        if name == "no_sync":
            return (self.new("ctx", node, props={"ctx": "no_sync", "owner": (o,)}),)
        if name == "accumulate":
            return (self.new("ctx", node, props={"ctx": "accumulate", "owner": (o,)}),)
        if name == "state_dict":
            return (self.new("state_dict", node, props={"owner": (o,)}),)
        if name == "load_state_dict":
            self._emit_load((o,), node, args)
            return (self.unknown(node),)
        if name in ("eval", "train") and kind == "unknown":
            self.emit("mode", node, target=(o,), mode="eval" if name == "eval" else None, unresolved=True)
            return (o,)
        if name in ("to", "cuda", "cpu", "detach", "clone", "contiguous", "half", "float", "double"):
            derived = self.new(
                "tensor" if kind in ("tensor", "grad") else "unknown",
                node,
                label=o.label,
                tags=o.tags - {"rank_cond"},
                props={"detached": name == "detach" or o.props.get("detached", False), "rank_direct": o.props.get("rank_direct", False), "base": o},
            )
            return (derived,)
        if kind in ("value", "unknown", "const", "tensor", "grad"):
            # methods on numbers and tensors keep where the value came from (`rank_t.item()` is still a rank)
            result = self.generic_call(o, name, node, args)
            for r in result:
                r.tags = r.tags | (o.tags - {"rank_cond"})
                if "grad" in o.tags:
                    r.props["owner"] = union(r.props.get("owner", EMPTY), o.props.get("owner", EMPTY))
                if o.props.get("rank_direct") and name in ("item", "strip", "lower", "upper", "__int__", "tolist", "split"):
                    r.props["rank_direct"] = True
            return result
        return self.generic_call(o, name, node, args)

    def _add_argument(self, node: ast.Call, args: Args) -> None:
        flags = tuple(o.value for v in args.pos for o in v if o.kind == "const" and isinstance(o.value, str))
        if not flags:
            return
        dest_v = args.get(None, "dest")
        dest = None
        if dest_v:
            dv = [o.value for o in dest_v if o.kind == "const"]
            dest = dv[0] if dv else None
        if dest is None:
            longs = [f for f in flags if f.startswith("--")]
            dest = (longs[0] if longs else flags[0]).lstrip("-").replace("-", "_")
        arg = CliArg(flags=flags, dest=dest, default=args.get(None, "default"), line=node.lineno, node=node)
        self.cli_args[dest] = arg
        self.emit("add_argument", node, arg=arg)

    # ------------------------------------------------------------------ modelled APIs

    def call_qual(self, qual: str, node: ast.Call, args: Args, heuristic: bool = False) -> Value:
        c = N.canonical(qual)
        last = c.rsplit(".", 1)[-1]
        if c in (N.DDP, N.APEX_DDP):
            return self.wrap(node, args, "ddp", c, heuristic)
        if c == N.DATA_PARALLEL:
            return self.wrap(node, args, "dp", c, heuristic)
        if c in (N.CONVERT_SYNC_BN, N.APEX_CONVERT_SYNC_BN):
            return self.convert_syncbn(node, args, c, heuristic)
        if last in ("convert_sync_batchnorm", "convert_syncbn_model"):
            return self.convert_syncbn(node, args, c, True)
        if c in (N.SYNC_BN, N.APEX_SYNC_BN):
            m = self.new("module", node, qual=c, label="SyncBatchNorm")
            m.family = Family(mode="train" if self.reached else None, has_bn=True, syncbn_line=node.lineno, members=[m])
            self.emit("syncbn_layer", node, obj=m)
            return (m,)
        if c.startswith("torch.nn.") and c.count(".") == 2 and last[:1].isupper():
            if last.endswith("Loss"):
                return (self.new("loss", node, qual=c, label=last),)
            m = self.new("module", node, qual=c, label=last)
            has_bn = "BatchNorm" in last
            if last in ("Sequential", "ModuleList", "ModuleDict"):
                members = [o for o in args.all() if o.family is not None]
                has_bn = any(bool(o.family and o.family.has_bn) for o in members) or (None if args.opaque else False)
            m.family = Family(mode="train" if self.reached else None, has_bn=has_bn, members=[m])
            return (m,)
        if (c.startswith("torchvision.models.") or c.startswith("models.")) and last[:1].islower() and last not in ("get_model_weights", "list_models"):
            m = self.new("module", node, qual=c, label=last)
            name = last if last != "get_model" else _first_const_str(args) or ""
            m.family = Family(mode="train" if self.reached else None, has_bn=N.torchvision_model_has_bn(name), members=[m])
            return (m,)
        if c in ("timm.create_model", "timm.models.create_model", "torch.hub.load") or last == "from_pretrained":
            m = self.new("module", node, qual=c, label=last)
            m.family = Family(mode="train" if self.reached else None, has_bn=None, members=[m])
            return (m,)
        if c == "torch.compile":
            return args.get(0, "model") or (self.unknown(node),)
        if c.startswith("torch.optim.lr_scheduler.") or c.startswith("transformers.") and "schedule" in last or last.startswith("get_") and "schedule" in last:
            s = self.new("scheduler", node, qual=c, label=last, props={"cls": last, "args": args})
            self.emit("scheduler", node, obj=s)
            return (s,)
        if (c.startswith("torch.optim.") and last[:1].isupper() and last != "Optimizer" and c.count(".") == 2) or c.startswith("apex.optimizers."):
            positional_lr = 1 if c.startswith("torch.optim.") else None
            o = self.new(
                "optimizer",
                node,
                qual=c,
                label=last,
                props={
                    "cls": last,
                    "params": args.get(0, "params") or EMPTY,
                    "lr": args.get(positional_lr, "lr"),
                    "lr_node": args.node(positional_lr, "lr"),
                },
            )
            self.emit("optimizer", node, obj=o)
            return (o,)
        if c == N.DATA_LOADER:
            return (self._loader(node, args),)
        if c == N.DISTRIBUTED_SAMPLER:
            return (self._sampler(node, args, distributed=True, qual=c),)
        if c.startswith("torch.utils.data.") and last.endswith("Sampler"):
            return (self._sampler(node, args, distributed=False, qual=c),)
        if c in ("torch.utils.data.TensorDataset", "torch.utils.data.Subset", "torch.utils.data.ConcatDataset") or c.startswith("torchvision.datasets."):
            return (self._dataset(node, args, c),)
        if c == "torch.utils.data.random_split":
            ds = self._dataset(node, args, c)
            return (self.new("tuple", node, props={"elem": (ds,)}),)
        if c.startswith("torch.distributed."):
            handled = self._distributed_call(c, last, node, args)
            if handled is not None:
                return handled
        if c == N.TORCH_SAVE:
            self.emit("save", node, obj=args.get(0, "obj") or EMPTY, path=args.get(1, "f") or EMPTY, path_node=args.node(1, "f"))
            return (self.const(None, node),)
        if c == N.TORCH_LOAD:
            return (self.unknown(node, label="torch.load()", loaded=True),)
        if c == N.SET_DEVICE:
            self.emit("set_device", node, arg=args.get(0, "device") or EMPTY, arg_node=args.node(0, "device"))
            return (self.const(None, node),)
        if c == N.DEVICE_COUNT:
            return (self.new("value", node, tags=frozenset({"device_count"}), label="torch.cuda.device_count()"),)
        if c in ("torch.cuda.current_device", "torch.cuda.is_available", "torch.cuda.is_initialized"):
            return (self.new("value", node, label=c),)
        if c == "torch.device":
            parts = args.all()
            text = ":".join(str(o.value) for o in parts if o.kind == "const")
            tags = tags_of(parts) - {"rank_cond"}
            return (self.new("device", node, tags=tags, const=is_constant(parts) or not parts, value=text, props={"text": text}),)
        if c in ("torch.no_grad", "torch.inference_mode"):
            return (self.new("ctx", node, props={"ctx": "grad", "mode": "off"}),)
        if c == "torch.enable_grad":
            return (self.new("ctx", node, props={"ctx": "grad", "mode": "on"}),)
        if c == "torch.set_grad_enabled":
            flag = args.get(0, "mode") or EMPTY
            vals = [o.value for o in flag if o.kind == "const"]
            mode = ("on" if vals[0] else "off") if len(vals) == len(flag) == 1 else None
            return (self.new("ctx", node, props={"ctx": "grad", "mode": mode}),)
        if c in (N.SPAWN, N.START_PROCESSES):
            return self._spawn(node, args, c)
        if c in ("multiprocessing.Process", "torch.multiprocessing.Process") or last == "Process" and "multiprocessing" in c:
            target = args.get(None, "target") or EMPTY
            target_args = args.get(None, "args")
            self._enter_process_target(node, target, target_args, rank_first=False)
            return (self.unknown(node, label="Process"),)
        if c in ("os.environ.get", "os.getenv", "os.environ.setdefault", "os.environ.__getitem__"):
            key = self._const_key(node.args[0]) if node.args else None
            return (self._env_read(node, key, args.get(1, "default")),)
        if c == "argparse.ArgumentParser":
            return (self.new("parser", node),)
        if c == "copy.deepcopy":
            src = args.get(0, None) or EMPTY
            out: list[Obj] = []
            for s in src:
                if s.is_module:
                    m = self.new("module", node, label=s.label, props={"copy_of": s, "class": s.props.get("class")})
                    fam = self.family_of(s)
                    m.family = Family(mode=fam.mode, has_bn=fam.has_bn, members=[m])
                    out.append(m)
            return tuple(out) or (self.unknown(node),)
        if c == "functools.partial":
            return (self.new("partial", node, props={"func": args.pos[0] if args.pos else EMPTY, "args": Args(args.pos[1:], args.pos_nodes[1:], args.kw, args.kw_nodes, args.opaque)}),)
        if c.startswith("logging.") and last in _REPORT_METHODS:
            self.emit("report", node, args=args, name=last)
            return (self.const(None, node),)
        if c in ("torch.distributed.algorithms.join.Join",):
            return (self.new("ctx", node, props={"ctx": "join"}),)
        if c.startswith("torch.autocast") or c in ("torch.cuda.amp.autocast", "torch.cpu.amp.autocast"):
            return (self.new("ctx", node, props={"ctx": "autocast"}),)
        if last == "consume_prefix_in_state_dict_if_present":
            self.emit("strip_prefix", node)
            return (self.const(None, node),)
        if c.startswith("torch.") and last in _TENSOR_FACTORIES:
            return (self._tensor_factory(node, args, last),)
        return self.generic_call(None, last, node, args, qual=c)

    def _distributed_call(self, c: str, last: str, node: ast.Call, args: Args) -> Value | None:
        if c == N.INIT_PROCESS_GROUP:
            names = ("backend", "init_method", "timeout", "world_size", "rank", "store", "group_name", "pg_options", "device_id")
            params = {n: args.get(i, n) for i, n in enumerate(names)}
            nodes = {n: args.node(i, n) for i, n in enumerate(names)}
            self.emit("init_pg", node, params=params, nodes=nodes, args=args)
            return (self.const(None, node),)
        if last in ("get_rank", "get_global_rank", "get_group_rank"):
            return (self.new("value", node, tags=frozenset({"rank"}), label=f"dist.{last}()", props={"rank_direct": True}),)
        if last == "get_node_local_rank":
            return (self.new("value", node, tags=frozenset({"local_rank"}), label=f"dist.{last}()", props={"rank_direct": True}),)
        if last == "get_world_size":
            return (self.new("value", node, tags=frozenset({"world_size"}), label="dist.get_world_size()"),)
        if last in N.COLLECTIVES:
            self.emit("collective", node, op=last, args=args)
            return (self.unknown(node, label=f"dist.{last}()"),)
        if last in N.POINT_TO_POINT:
            self.emit("p2p", node, op=last, args=args)
            return (self.unknown(node, label=f"dist.{last}()"),)
        if last in ("is_initialized", "is_available", "is_nccl_available", "is_gloo_available", "is_torchelastic_launched", "get_backend"):
            return (self.new("value", node, label=f"dist.{last}()"),)
        return None

    def wrap(self, node: ast.Call, args: Args, wrapper: str, qual: str, heuristic: bool = False) -> Value:
        inner = args.get(0, "module") or EMPTY
        w = self.new(
            "wrapper",
            node,
            qual=qual,
            label="DDP" if wrapper == "ddp" else "DataParallel",
            props={"wrapper": wrapper, "inner": inner, "args": args, "arg_node": args.node(0, "module"), "heuristic": heuristic},
        )
        objs = [o for o in inner if o.kind not in ("const",)]
        if objs:
            fam = self._merge_families(objs)
        else:
            fam = Family(mode="train" if self.reached else None)
        w.family = fam
        fam.members.append(w)
        self.emit("wrap", node, wrapper=w, inner=inner, wrapper_kind=wrapper, args=args, heuristic=heuristic)
        return (w,)

    def convert_syncbn(self, node: ast.Call, args: Args, qual: str, heuristic: bool) -> Value:
        target = args.get(0, "module") or EMPTY
        for o in target:
            if o.kind in ("const", "qual"):
                continue
            fam = self.family_of(o)
            fam.has_bn = True if fam.has_bn is None else fam.has_bn or True
            fam.syncbn_line = fam.syncbn_line or node.lineno
        self.emit("convert_syncbn", node, target=target, arg_node=args.node(0, "module"), qual=qual, heuristic=heuristic)
        return tuple(o for o in target if o.kind not in ("const",)) or (self.unknown(node),)

    def _loader(self, node: ast.Call, args: Args) -> Obj:
        names = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers")
        values = {n: args.get(i, n) for i, n in enumerate(names)}
        loader = self.new("loader", node, qual=N.DATA_LOADER, label="DataLoader", props={"args": args})
        for n in ("dataset", "sampler", "batch_sampler"):
            loader.fields[n] = values[n] or EMPTY
        loader.props["batch_size"] = values["batch_size"]
        loader.props["batch_size_node"] = args.node(1, "batch_size")
        loader.props["shuffle"] = values["shuffle"]
        loader.props["drop_last"] = args.get(None, "drop_last")
        self.emit("loader", node, obj=loader)
        return loader

    def _sampler(self, node: ast.Call, args: Args, distributed: bool, qual: str) -> Obj:
        shuffle = args.get(3, "shuffle") if distributed else None
        sampler = self.new(
            "sampler",
            node,
            qual=qual,
            label=qual.rsplit(".", 1)[-1],
            props={
                "distributed": distributed,
                "custom": False,
                "shuffle": shuffle,
                "drop_last": args.get(5, "drop_last") if distributed else None,
                "num_replicas": args.get(1, "num_replicas") if distributed else None,
                "dataset": args.get(0, "dataset") or EMPTY,
                "args": args,
            },
        )
        self.emit("sampler", node, obj=sampler)
        return sampler

    def _dataset(self, node: ast.Call, args: Args, qual: str) -> Obj:
        last = qual.rsplit(".", 1)[-1]
        ds = self.new("dataset", node, qual=qual, label=last, props={"ctor_args": args})
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

    def _tensor_factory(self, node: ast.Call, args: Args, last: str) -> Obj:
        rows = None
        shape = args.get(None, "size")
        if shape is None and args.pos:
            shape = args.pos[2] if last == "randint" and len(args.pos) >= 3 else (args.pos[0] if last not in ("randint", "full", "tensor", "arange", "normal", "linspace") else None)
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
        tags = tags_of(args.all()) - _CALL_DROPS
        return self.new("tensor", node, tags=tags, props={"rows": rows})

    def _env_read(self, node: ast.AST, key: Any, default: Value | None) -> Obj:
        var = key if isinstance(key, str) else None
        tags = N.env_tags(var) if var else frozenset({"env"})
        if default:
            tags = tags | (tags_of(default) - {"rank_cond", "named"})
        self.emit("env_read", node, var=var)
        return self.new("value", node, label=f"os.environ[{var!r}]" if var else "os.environ[?]", tags=tags, props={"env": var, "rank_direct": bool(tags & PER_RANK_TAGS)})

    def _spawn(self, node: ast.Call, args: Args, qual: str) -> Value:
        fn = args.get(0, "fn") or EMPTY
        spawn_args = args.get(1, "args")
        nprocs = args.get(2, "nprocs")
        self.emit("spawn", node, fn=fn, nprocs=nprocs, nprocs_node=args.node(2, "nprocs"), qual=qual)
        self._enter_process_target(node, fn, spawn_args, rank_first=True)
        return (self.unknown(node, label="spawn()"),)

    def _enter_process_target(self, node: ast.Call, fn: Value, extra: Value | None, rank_first: bool) -> None:
        pos: list[Value] = []
        opaque = False
        if rank_first:
            pos.append((self.new("value", node, label="process index", tags=frozenset({"rank", "local_rank", "spawn"}), props={"rank_direct": True}),))
        if extra:
            tup = [o for o in extra if o.kind == "tuple" and o.items is not None]
            if len(extra) == 1 and tup:
                pos.extend(tup[0].items)
            else:
                opaque = True
        call_args = Args(pos=pos, pos_nodes=[node] * len(pos), opaque=opaque)
        for f in fn:
            if f.kind == "function":
                self.call_function(f, call_args, node)
            elif f.kind == "bound":
                self.call_function(f.props["func"], call_args, node, self_obj=f.props["self"])

    def call_builtin(self, name: str, node: ast.Call, args: Args) -> Value:
        if name == "print":
            self.emit("report", node, args=args, name="print")
            return (self.const(None, node),)
        if name in _PASSTHROUGH_BUILTINS:
            parts = args.all()
            direct = any(o.props.get("rank_direct") for o in parts) and name in ("int", "str", "float", "round", "abs")
            const = is_constant(parts)
            value = None
            if const and len(args.pos) == 1 and len(args.pos[0]) == 1 and name in ("int", "float"):
                try:
                    value = (int if name == "int" else float)(args.pos[0][0].value)
                except (TypeError, ValueError):
                    value = None
            tags = tags_of(parts) - {"rank_cond"}
            return (self.new("value", node, tags=tags, const=const, value=value, props={"rank_direct": direct, "builtin": name, "call_args": args}),)
        if name == "range":
            return (self.new("range", node, tags=_depends(args.all()), props={"args": args}),)
        if name == "enumerate":
            return (self.new("enumerate", node, props={"inner": args.get(0, "iterable") or EMPTY}),)
        if name == "zip":
            return (self.new("zip", node, props={"inner": list(args.pos)}),)
        if name == "iter":
            inner = args.get(0, None) or EMPTY
            loaders = self.loaders_in(inner)
            if loaders:
                self.emit("iterate", node, loaders=loaders, loop=None, iterable=self.text(node.args[0]) if node.args else "?")
                return (self.new("loader_iter", node, props={"loaders": loaders}),)
            return inner or (self.unknown(node),)
        if name == "next":
            return self.element_of(args.get(0, None) or EMPTY, node)
        if name in ("list", "tuple", "sorted", "reversed", "set", "frozenset"):
            inner = args.get(0, None)
            if not inner:
                return (self.new("tuple", node, items=()),)
            if all(o.kind == "tuple" for o in inner):
                return inner
            return (self.new("tuple", node, tags=_depends(inner), props={"elem": self.element_of(inner, node)}),)
        if name == "dict":
            d = self.new("dict", node)
            for k, v in args.kw.items():
                d.fields[k] = v
            return (d,)
        if name == "getattr" and len(args.pos) >= 2:
            key = self._const_key(node.args[1])
            if isinstance(key, str):
                out: list[Obj] = []
                for o in args.pos[0]:
                    out.extend(self.get_attr(o, key, node))
                return union(out)
        if name == "setattr" and len(args.pos) >= 3:
            key = self._const_key(node.args[1])
            if isinstance(key, str):
                for o in args.pos[0]:
                    if o.kind not in ("qual", "const", "builtin"):
                        self._set_field(o, key, args.pos[2], strong=False)
            return (self.const(None, node),)
        if name == "super":
            frame = self.frame
            self_value = None
            fnode = frame.node
            if isinstance(fnode, (ast.FunctionDef, ast.AsyncFunctionDef)) and fnode.args.args:
                self_value = frame.locals.get(fnode.args.args[0].arg)
            return (self.new("super", node, props={"cls": frame.cls, "self": self_value or EMPTY}),)
        if name in ("isinstance", "hasattr", "callable", "issubclass", "len", "any", "all", "id", "hash", "type", "repr", "open", "vars"):
            return (self.new("value", node, label=f"{name}()"),)
        return self.generic_call(None, name, node, args, qual=name)

    # ------------------------------------------------------------------ forward

    def forward(self, modules: Value, node: ast.Call, args: Args) -> Value:
        modes = []
        for m in modules:
            fam = self.family_of(m)
            if fam.mode not in modes:
                modes.append(fam.mode)
        detached = id(node) in self._detached_calls
        ev = self.emit("forward", node, target=modules, modes=tuple(modes), args=args, detached=detached, inside_forward=self._forward_depth > 0)
        out: list[Obj] = []
        self._forward_depth += 1
        try:
            for m in modules:
                inner = m.props.get("inner", EMPTY) if m.kind == "wrapper" else (m,)
                for im in inner:
                    if im.props.get("class") is not None and im.kind == "module":
                        fwd = self._attr_from_class(im, "forward")
                        if fwd:
                            out.extend(self.call_value(fwd, node, args))
        finally:
            self._forward_depth -= 1
        result = self.new("tensor", node, props={"forward": ev})
        return union(out, (result,)) if out else (result,)

    # ------------------------------------------------------------------ iteration

    def loaders_in(self, value: Value, depth: int = 0) -> tuple[Obj, ...]:
        out: list[Obj] = []
        for o in value:
            if o.kind == "loader":
                out.append(o)
            elif depth < 3:
                if o.kind == "loader_iter":
                    out.extend(o.props.get("loaders", ()))
                elif o.kind == "enumerate":
                    out.extend(self.loaders_in(o.props.get("inner", EMPTY), depth + 1))
                elif o.kind == "zip":
                    for inner in o.props.get("inner", []):
                        out.extend(self.loaders_in(inner, depth + 1))
                elif o.kind == "unknown" and "call_args" in o.props:
                    out.extend(self.loaders_in(o.props["call_args"].all(), depth + 1))
                elif o.kind == "instance" and o.props.get("class") is not None:
                    # a prefetcher / device-loader class of the file wrapping the DataLoader it holds
                    out.extend(self.loaders_in(union(*o.fields.values()), depth + 1))
        return tuple(union(out))

    def element_of(self, value: Value, node: ast.AST) -> Value:
        out: list[Obj] = []
        for o in value:
            kind = o.kind
            if kind == "tuple":
                if o.items is not None:
                    out.extend(union(*o.items))
                else:
                    out.extend(o.props.get("elem", EMPTY))
            elif kind in ("loader", "loader_iter"):
                out.append(self.new("batch", node, props={"loaders": self.loaders_in((o,))}))
            elif kind == "params":
                param = self.new("param", node, label="param", props={"owner": o.props.get("owner", EMPTY)})
                if o.props.get("named"):
                    out.append(self.new("tuple", node, items=((self.unknown(node),), (param,))))
                else:
                    out.append(param)
            elif kind == "enumerate":
                out.append(self.new("tuple", node, items=((self.new("value", node),), self.element_of(o.props.get("inner", EMPTY), node))))
            elif kind == "zip":
                out.append(self.new("tuple", node, items=tuple(self.element_of(v, node) for v in o.props.get("inner", []))))
            elif kind == "range":
                out.append(self.new("value", node, label="index", props={"range": True}))
            elif kind in ("unknown", "instance") and self.loaders_in((o,)):
                out.append(self.new("batch", node, props={"loaders": self.loaders_in((o,))}))
            elif kind == "dict":
                out.append(self.unknown(node))
            else:
                out.append(self._derived(o, "[*]", node))
        return union(out) or (self.unknown(node),)


# ---------------------------------------------------------------------- helpers


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


def _depends(value: Value) -> frozenset[str]:
    """Tags a value derived from `value` keeps: world size and grads as they are, a rank as "depends on the rank"."""
    tags = tags_of(value)
    out = tags - _CALL_DROPS
    if tags & PER_RANK_TAGS or "rank_dep" in tags:
        out |= {"rank_dep"}
    return frozenset(out)


def _grad_owners(value: Value, depth: int = 0) -> Value:
    """The modules whose gradients a value was computed from (`torch.cat([p.grad.view(-1) for p in params])`)."""
    out: list[Obj] = []
    for o in value:
        if "grad" not in o.tags:
            continue
        out.extend(o.props.get("owner", EMPTY))
        if o.kind == "tuple" and depth < 3:
            for v in (o.items or ()) + ((o.props["elem"],) if "elem" in o.props else ()):
                out.extend(_grad_owners(v, depth + 1))
    return union(out)


def _merge_env(a: dict[str, Value], b: dict[str, Value]) -> dict[str, Value]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _capped(union(out[k], v)) if k in out and out[k] is not v else v
    return out


def _capped(value: Value) -> Value:
    """Keep every model/data/optimizer object a variable may hold, but only a few plain numbers and unknowns: a
    counter updated in a loop that runs in many calls would otherwise grow without bound."""
    if len(value) <= _VALUE_CAP:
        return value
    keep = [o for o in value if o.kind not in _PLAIN_KINDS]
    plain = [o for o in value if o.kind in _PLAIN_KINDS]
    return tuple(keep + plain[: max(0, _VALUE_CAP - len(keep))])


def _flip(polarity: str) -> str:
    return {"main": "nonmain", "nonmain": "main"}.get(polarity, "other")


_LOCAL_SCOPES = ("local_by_name", "local")  # weakest evidence first


def _narrowest_local(scopes: list[str]) -> str:
    """Of several node-local scopes, the one with the weakest evidence (a name only beats a visible origin)."""
    for s in _LOCAL_SCOPES:
        if s in scopes:
            return s
    return "global"


def _combine_scopes(scopes: list[str]) -> str:
    """A test that may read a global rank (any alternative) counts as global: only a test that reads a node-local
    rank on every path is reported as per-node."""
    if not scopes or "global" in scopes:
        return "global"
    return _narrowest_local(scopes)


_PER_NODE_WORDS = ("per_node", "local", "device_count", "gpu", "nproc")


def _value_scope(value: Value) -> str:
    """Scope of a rank value compared in a test: "global" for a job-wide rank, "local"/"local_by_name" for a
    node-local one: LOCAL_RANK and local_rank variables as they are (not `node_rank * gpus + local_rank`, which is
    global), and `rank % gpus_per_node` (the ImageNet example's `args.rank % ngpus_per_node == 0`)."""
    scopes: list[str] = []
    for o in value:
        if not (o.tags & PER_RANK_TAGS) or o.const:
            continue
        op = o.props.get("op")
        if op == "Mod" and tags_of(o.props.get("left") or ()) & PER_RANK_TAGS:
            right = o.props.get("right") or ()
            per_node = all(
                r.const or "device_count" in r.tags or any(w in (r.label or "").lower() for w in _PER_NODE_WORDS)
                for r in right
            ) and bool(right)
            scopes.append("local" if per_node else "global")
        elif "rank" in o.tags or op is not None:
            scopes.append("global")  # a global rank, or local_rank combined with other numbers
        elif o.tags & {"env", "spawn"} or "named" not in o.tags:
            scopes.append("local")
        else:
            scopes.append("local_by_name")
    return _combine_scopes(scopes)


def _rank_polarity(op: type, const: Any, rank_on_left: bool) -> str | None:
    """Which ranks of a distributed run (0, 1, 2…) make `rank <op> const` true: only 0 → "main", all but 0 →
    "nonmain", all or none → None (the test is uniform: `local_rank != -1` is true on every rank of a DDP run)."""
    fn = _CMP_OPS.get(op)
    if fn is None:
        return "other"
    try:
        truths = [bool(fn(r, const) if rank_on_left else fn(const, r)) for r in (0, 1, 2)]
    except TypeError:
        return "other"
    if all(truths) or not any(truths):
        return None
    if truths == [True, False, False]:
        return "main"
    if truths == [False, True, True]:
        return "nonmain"
    return "other"


def _is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def _target_ident(target: ast.AST) -> str | None:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str):
        return target.slice.value
    return None


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    return ""


def _dotted_last(node: ast.AST) -> str | None:
    d = _dotted(node)
    return d.rsplit(".", 1)[-1] if d else None


def _first_const_str(args: Args) -> str | None:
    for v in args.pos:
        for o in v:
            if o.kind == "const" and isinstance(o.value, str):
                return o.value
    return None
