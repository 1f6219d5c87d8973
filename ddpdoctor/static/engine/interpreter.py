"""A Python interpreter over abstract values that walks a script in execution order and records events.

Why an interpreter rather than pattern matching: the bugs ddpdoctor looks for live in the relation between
statements — a model built in one function, wrapped in another and trained in a method of a class; a sampler
reached through `loader.sampler`; a save inside a helper that only rank 0 calls. So the walk follows the script the
way it runs: the module body first; calls to functions, classes and methods entered at their call sites with
arguments bound to parameters; both sides of every branch taken (and the variables merged afterwards); loop bodies
walked once. Values are tuples of abstract objects (`semantic.Obj`); what happens to them becomes an ordered list of
`Event`s, each with the context it happened in (branches, loops, the call stack).

Functions the walk never reaches (a Trainer used from another file, a callback handed to a library) are walked
afterwards on their own with unknown arguments; their events carry `reached=False`.

This package knows Python and nothing else. What library calls mean (a DDP wrap, a sampler, argparse, os.environ)
is decided by the *hooks* — the methods of `hooks.Hooks`, which a subclass overrides — and by the handlers that
subclass registers (`ddpdoctor.static.apis`). The walk never executes user code and never imports anything.

The interpreter is one class assembled from parts: this module (driver, contexts, simple statements), `control`
(branches, loops, with, try, match), `binding` (names, scopes, assignment targets), `expressions` (expression
evaluation), `calls` (attributes, functions, classes, calls) and `imports` (project modules).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import Any

from ddpdoctor.static.engine.binding import BindingMixin
from ddpdoctor.static.engine.calls import CallsMixin
from ddpdoctor.static.engine.control import ControlMixin
from ddpdoctor.static.engine.expressions import ExpressionsMixin
from ddpdoctor.static.engine.hooks import Hooks
from ddpdoctor.static.engine.imports import ImportsMixin
from ddpdoctor.static.engine.support import (
    VISIT_BUDGET,
    SourceFile,
    SourceIndex,
    dotted_name,
    merge_env,
    merge_loop_env,
    simple_text,
    target_ident,
)
from ddpdoctor.static.project import ModuleFile, Project
from ddpdoctor.static.semantic import EMPTY, Ctx, Event, Frame, Obj, Value, new_obj

EXIT_CALLS = frozenset({"sys.exit", "exit", "quit", "os._exit", "os.abort"})
VALUE_CAP = 12
# Objects of interest are all kept, up to this many; past it, one per place in the source that made them (a factory
# over a table of 25 activation classes, called from 60 places, otherwise gave values of 1,600 objects).
KEPT_CAP = 48


class Interpreter(ImportsMixin, ControlMixin, BindingMixin, CallsMixin, ExpressionsMixin, Hooks):
    """Walks one parsed file and records its events (see the module docstring)."""

    # Its own attributes are slots. Those of a subclass (the API models' state) stay in the instance's dict, which
    # then holds few enough names to keep CPython 3.11's compact form: one of over 30 names became an ordinary
    # dict, and then no `self.method(...)` call of the walk could use the interpreter's specialised method lookup
    # (~3 % of `check --static` on a 4,000-line script).
    __slots__ = (
        "source", "tree", "project", "events", "ctx", "frames", "errors", "_error_files", "truncated", "reached",
        "_seq", "_frame_ids", "_visits", "_ex_handlers", "_st_handlers", "_active", "_walked", "_function_objs",
        "_classes", "_instances", "_placeholders", "_guard", "_trailing_guard", "_cond_keys", "_texts", "_literals",
        "_counters", "_field_counters", "_inlined", "_summaries", "_method_class", "_bare_calls", "sources",
        "_module_of_file", "_file_frames", "_module_frames", "_pymodules", "_resolving", "_import_depth",
        "_module_depth", "module_frame",
    )

    def __init__(self, source: SourceFile, project: Project | None = None) -> None:
        self.source = source
        self.tree = source.tree
        self.project = project
        self.events: list[Event] = []
        self.ctx: list[Ctx] = []
        self.frames: list[Frame] = []
        self.errors: list[str] = []
        self._error_files: list[str] = []
        self.truncated = False
        self.reached = True
        self._seq = itertools.count()
        self._frame_ids = itertools.count(1)
        self._visits = 0
        self._ex_handlers: dict[type, Any] = {}  # node class → bound ex_/st_ method (dispatch without getattr)
        self._st_handlers: dict[type, Any] = {}
        self._active: list[ast.AST] = []
        self._walked: set[ast.AST] = set()
        self._function_objs: dict[ast.AST, Obj] = {}
        self._classes: dict[ast.AST, Obj] = {}
        self._instances: dict[ast.AST, list[Obj]] = {}
        self._placeholders: dict[tuple[str, str], Obj] = {}
        self._guard: tuple[str, Any, int, str | None, Value] | None = None  # (kind, info, branch, scope, test)
        self._trailing_guard: tuple[str, Any, int, str | None, Value] | None = None  # of the last block walked
        self._cond_keys: dict[int, tuple[str, int]] = {}
        self._texts: dict[int, str] = {}
        self._literals: dict[int, Value] = {}
        self._counters: dict[int, tuple[frozenset[str], frozenset[tuple[str, str]]]] = {}  # loop node → counters
        self._field_counters: dict[int, frozenset[str]] = {}  # class node → fields its methods increment
        self._inlined: dict[ast.AST, int] = {}
        self._summaries: dict[ast.AST, Value] = {}
        self._method_class: dict[ast.AST, ast.ClassDef] = {}
        self._bare_calls: set[int] = set()  # calls whose result is thrown away (`model.load_state_dict(sd)`)
        # files read (display path → file), their modules, and the global scope of each module
        self.sources: dict[str, SourceFile] = {}
        self._module_of_file: dict[str, ModuleFile] = {}
        self._file_frames: dict[str, Frame] = {}
        self._module_frames: dict[Path, Frame | None] = {}
        self._pymodules: dict[Path, Obj] = {}
        self._resolving: set[tuple[Path, str]] = set()
        self._import_depth = 0
        self._module_depth: dict[Path, int] = {}  # import level of each module (the script's own imports: 1)
        self.module_frame = Frame(
            id=next(self._frame_ids), name="<module>", locals={}, lexical=None, node=self.tree, file=source.path
        )
        entry = project.module_of(project.entry) if project is not None else None
        self.add_source(source, entry)
        if entry is not None:
            self._module_frames[entry.path] = self.module_frame
            self.module_frame.locals["__file__"] = (self.const(str(entry.path), None),)
        self._file_frames[source.path] = self.module_frame

    def add_source(self, source: SourceFile, module: ModuleFile | None) -> None:
        self.sources[source.path] = source
        self._method_class.update(source.index.method_class)
        if module is not None:
            self._module_of_file[source.path] = module

    def error(self, message: str) -> None:
        """Something the interpreter could not follow (it goes on with the next statement)."""
        self.errors.append(message)
        self._error_files.append(self.frames[-1].file if self.frames else self.source.path)

    def errors_by_file(self) -> list[tuple[str, str]]:
        return list(zip(self._error_files, self.errors, strict=True))

    def index_of(self, file: str) -> SourceIndex:
        return self.sources[file].index

    def module_frame_of(self, file: str) -> Frame:
        """The global scope of the module a file is."""
        return self._file_frames.get(file) or self.module_frame

    # ------------------------------------------------------------------ driver

    def run(self, also: list[ModuleFile] | tuple[ModuleFile, ...] = ()) -> None:
        """Walk the script, then what nothing called in it and in the project modules `also` (files the user
        asked about that the script imports)."""
        self.frames.append(self.module_frame)
        try:
            self.block(self.tree.body)
        finally:
            self.frames.pop()
        for module in also:
            self.execute_module(module)
        self.reached = False
        self._walk_unreached(self.source.path)
        for module in also:
            frame = self._module_frames.get(module.path)
            if frame is not None:
                self._walk_unreached(frame.file)

    def _walk_unreached(self, file: str) -> None:
        """Walk what a module's body never called, callers before callees: a helper that the file calls
        (`self._save_snapshot(epoch)` under `if self.local_rank == 0` in a Trainer used from another file) or hands
        on (`mp.spawn(worker, ...)`, a callback) is then entered at its call sites, with their rank guards and
        arguments, rather than on its own with neither (and not walked twice)."""
        index = self.index_of(file)
        used = index.loaded_names
        defs = sorted(index.functions, key=lambda n: (n.name in used, n.lineno, n.col_offset))
        self.frames.append(self.module_frame_of(file))
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
                    self.error(f"line {d.lineno}: nesting too deep")
                except Exception as exc:  # a bug here must not cost the user the rest of the analysis
                    self.error(f"line {d.lineno}: {type(exc).__name__}: {exc}")
                finally:
                    del self.ctx[depth[0] :]
                    del self.frames[depth[1] :]
                    del self._active[depth[2] :]
        finally:
            self.frames.pop()

    def _walk_entry(self, d: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        module_frame = self.frame
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
                inst = self.make_instance(cls, d)
                self._instances.setdefault(parent, []).append(inst)
                init = self._lookup_class_attr_objs(cls, "__init__")
                if init is not None and init.props["node"] not in self._walked and d.name != "__init__":
                    self.call_function(init, self.no_args(), init.props["node"], self_obj=(inst,))
                instances = [inst]
            self_obj = tuple(instances)
        if fobj is None or fobj.kind != "function":
            fobj = self._define_function(d, module_frame, cls=None, evaluate_defaults=True)
        if fobj.props.get("staticmethod"):
            self_obj = None
        self.call_function(fobj, self.no_args(), d, self_obj=self_obj)

    # ------------------------------------------------------------------ infrastructure

    @property
    def frame(self) -> Frame:
        return self.frames[-1]

    def new(
        self,
        kind: str,
        node: ast.AST | None,
        *,
        qual: str | None = None,
        label: str | None = None,
        tags: frozenset[str] = frozenset(),
        const: bool = False,
        value: Any = None,
        fields: dict[str, Value] | None = None,
        items: tuple[Value, ...] | None = None,
        props: dict[str, Any] | None = None,
        family: Any = None,
    ) -> Obj:
        """A new object made at `node` (its line, its file), with the fields of `Obj` given."""
        frames = self.frames
        obj = new_obj(
            kind, getattr(node, "lineno", 0) or 0, node, frames[-1].file if frames else self.source.path,
            qual, label, tags, const, value, fields, items, props, family,
        )
        if self.ctx:
            if kind in self.PATH_KINDS:
                path = self._path()
                if path:
                    obj.props["path"] = path
            if kind in self.MARKED_KINDS:
                self.mark_new(obj)
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
            key = (self.source_text(inner), negated)
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

    def unknown(
        self, node: ast.AST | None, label: str | None = None, tags: frozenset[str] = frozenset(), **props: Any
    ) -> Obj:
        return self.new("unknown", node, label=label, tags=tags, props=props)

    def emit(self, kind: str, node: ast.AST, **data: Any) -> Event:
        frames = self.frames
        top = frames[-1]
        if top.stack is None:  # the frames under a frame never change while it is on the stack: computed once
            top.stack = (tuple(f.id for f in frames), tuple(f.call_site for f in frames if f.call_site is not None))
        ev = Event.made(
            kind, node, getattr(node, "lineno", 0) or 0, next(self._seq), tuple(self.ctx), top.stack[0], top.name,
            self.reached, data, top.file, top.stack[1],
        )
        self.events.append(ev)
        return ev

    def text(self, node: ast.AST | None, limit: int = 60) -> str:
        if node is None:
            return "?"
        cached = self.source_text(node)
        return cached if len(cached) <= limit else cached[: limit - 1] + "…"

    def source_text(self, node: ast.AST) -> str:
        """`ast.unparse(node)`, once per node; a name or a chain of attributes on one (most of what is asked),
        and the other small expressions `simple_text` knows, are written directly, as unparse would write them,
        without building an unparser."""
        cached = self._texts.get(id(node))
        if cached is None:
            cached = simple_text(node)
            if cached is None:
                try:
                    cached = ast.unparse(node)
                except Exception:  # pragma: no cover - unparse handles every node the parser makes
                    cached = "?"
            self._texts[id(node)] = cached
        return cached

    def capped(self, value: Value) -> Value:
        """Keep every object of interest a variable may hold, but only a few plain numbers and unknowns: a
        counter updated in a loop that runs in many calls would otherwise grow without bound."""
        if len(value) <= VALUE_CAP:
            return value
        plain_kinds = self.PLAIN_KINDS
        keep = [o for o in value if o.kind not in plain_kinds]
        plain = [o for o in value if o.kind in plain_kinds]
        if len(keep) > KEPT_CAP:
            sites: set[tuple[int, str]] = set()
            kept: list[Obj] = []
            for o in keep:
                site = (id(o.node), o.kind)
                if site not in sites:
                    sites.add(site)
                    kept.append(o)
            keep = kept[:KEPT_CAP]
        return tuple(keep + plain[: max(0, VALUE_CAP - len(keep))])

    def merge(self, a: dict[str, Value], b: dict[str, Value], written: set[str] | None = None) -> dict[str, Value]:
        return merge_env(a, b, self.capped, written)

    def merge_loop(
        self, before: dict[str, Value], after: dict[str, Value], written: set[str] | None
    ) -> dict[str, Value]:
        if written is None:
            return merge_env(before, after, self.capped)
        return merge_loop_env(before, after, self.capped, written)

    def _conditional_here(self) -> bool:
        return any(c.kind in ("cond", "rank", "loop", "try") for c in self.ctx[self.frame.ctx_base :])

    # ------------------------------------------------------------------ statements

    def block(self, stmts: list[ast.stmt]) -> bool:
        """Walk statements in order; True when the block always ends in return/raise/break/continue/exit."""
        pushed = 0
        last_guard = None
        try:
            for st in stmts:
                self._guard = None
                if self.stmt(st):
                    return True
                guard, self._guard = self._guard, None
                if guard is not None:
                    self.ctx.append(
                        Ctx(guard[0], st, guard[1], self.frame.id, guard[2], guard[3], guard[4], file=self.frame.file)
                    )
                    pushed += 1
                    last_guard = guard
            return False
        finally:
            if pushed:
                del self.ctx[len(self.ctx) - pushed :]
            self._trailing_guard = last_guard  # what the end of this block runs under (read by st_If)

    def stmt(self, st: ast.stmt) -> bool:
        self._visits += 1
        t = type(st)  # not st.__class__: CPython 3.11 never specialises an attribute read on an AST node
        handler = self._st_handlers.get(t, False)
        if handler is False:
            handler = self._st_handlers[t] = getattr(self, "st_" + t.__name__, None)
        if handler is None:
            return False
        depth = (len(self.ctx), len(self.frames), len(self._active), self.save_state())
        try:
            return bool(handler(st))
        except RecursionError:
            self.error(f"line {getattr(st, 'lineno', 0)}: nesting too deep")
        except Exception as exc:  # one statement the interpreter does not understand must not end the analysis
            self.error(f"line {getattr(st, 'lineno', 0)}: {type(exc).__name__}: {exc}")
        del self.ctx[depth[0] :]
        del self.frames[depth[1] :]
        del self._active[depth[2] :]
        self.restore_state(depth[3])
        return False

    def st_Expr(self, st: ast.Expr) -> bool:
        if isinstance(st.value, ast.Call):
            self._bare_calls.add(id(st.value))
        self.eval(st.value)
        return isinstance(st.value, ast.Call) and dotted_name(st.value.func) in EXIT_CALLS

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
        ident = target_ident(target)
        if ident is not None:
            self.on_assign(ident, target, value, st)

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

    def st_FunctionDef(self, st: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        frame = self.frame
        cls = frame.cls if frame.is_class_body else None
        closure = frame.lexical if frame.is_class_body else frame
        fobj = self._define_function(st, closure or self.module_frame_of(frame.file), cls=cls, evaluate_defaults=True)
        self.bind_name(st.name, (fobj,))

    st_AsyncFunctionDef = st_FunctionDef

    def st_ClassDef(self, st: ast.ClassDef) -> None:
        bases = [self.eval(b) for b in st.bases]
        cls = self.new("class", st, label=st.name, props={"node": st, "bases": bases})
        cls.props.update(self.class_facts(bases, st))
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
            file=self.frame.file,
        )
        self.frames.append(frame)
        try:
            self.block(st.body)
        finally:
            self.frames.pop()
        cls.fields = dict(frame.locals)
        self.bind_name(st.name, (cls,))


__all__ = ["EMPTY", "Interpreter"]
