"""The points where the interpreter asks what a library means, with plain-Python defaults.

The interpreter (`Interpreter`) calls these methods wherever Python's own semantics stop: a call to an imported
name, a method of an object the models made, the truth of a branch test, what a name suggests. The defaults here
make a plain Python interpreter that knows no library at all; `ddpdoctor.static.apis.TorchInterpreter` overrides
them with the models of PyTorch, argparse and os.environ. A hook that returns None means "not mine: do what
Python does".
"""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor.static.engine.support import Args
from ddpdoctor.static.semantic import Obj, Value, tags_of


class Hooks:
    """Plain-Python defaults of every hook (see the module docstring). Mixed into `Interpreter`."""

    # kinds of objects that remember which side of which `if` they were made on (`Interpreter._on_path`)
    PATH_KINDS: frozenset[str] = frozenset()
    # kinds a variable may hold many of without limit are everything but these (`Interpreter.capped`)
    PLAIN_KINDS: frozenset[str] = frozenset({"value", "const", "unknown", "tuple", "dict", "range"})
    # kinds that take the name they are first bound to, for messages (`model`, `self.train_loader`)
    LABELLED_KINDS: frozenset[str] = frozenset({"instance", "unknown", "dict"})
    # kinds whose items `x[key] = v` records as a field
    ITEM_STORE_KINDS: frozenset[str] = frozenset({"dict", "unknown", "instance"})
    # kinds that are called rather than held (`self.fn(...)` on a field holding one calls it)
    CALLABLE_KINDS: frozenset[str] = frozenset({"function", "bound", "class", "qual", "builtin", "partial"})
    # tags that mark a truth value: they do not survive arithmetic, formatting or collection into a list
    CONDITION_TAGS: frozenset[str] = frozenset()
    # kinds of objects shown to `mark_new` when made inside some context (a branch, a loop)
    MARKED_KINDS: frozenset[str] = frozenset()

    def mark_new(self, obj: Obj) -> None:
        """Record on an object what the contexts it is made in say about it (the ranks that make it)."""
        return None

    # ------------------------------------------------------------------ state saved around a failing statement

    def save_state(self) -> Any:
        return None

    def restore_state(self, saved: Any) -> None:
        return None

    # ------------------------------------------------------------------ names

    def unbound_name(self, name: str, node: ast.AST) -> Value | None:
        """A name never bound in the file (star imports, exec'd preambles): what it most likely is, or None."""
        return None

    def named_unknown(self, node: ast.AST | None, name: str, **props: Any) -> Obj:
        """The unknown value of a free name or of a parameter nobody passes: a name may suggest what it holds."""
        return self.unknown(node, label=name, **props)

    def tag_binding(self, name: str, value: Value) -> Value:
        """The value as stored under `name` (a name may say what a literal stands for)."""
        return value

    def attribute_facts(self, base: Obj, ident: str | None) -> tuple[frozenset[str], dict[str, Any]]:
        """(tags, props) of `base.ident` when the attribute is not modelled."""
        return frozenset(), {}

    def on_assign(self, ident: str, target: ast.AST, value: Value, st: ast.stmt) -> None:
        """Called after every assignment to a name, attribute or string-keyed item."""
        return

    # ------------------------------------------------------------------ values flowing through operations

    def carried_tags(self, value: Value) -> frozenset[str]:
        """Tags that a number computed from `value` keeps."""
        return tags_of(value) - self.CONDITION_TAGS

    def carried_props(self, value: Value) -> dict[str, Any]:
        """Props that a number computed from `value` keeps."""
        return {}

    def depends_tags(self, value: Value) -> frozenset[str]:
        """Tags that a value computed by an opaque function from `value` keeps (`range(world_size)`)."""
        return frozenset()

    def binop_model(self, node: ast.AST, op: type, left: Value, right: Value) -> Obj | None:
        """`left <op> right` for objects the models made (`Path(...) / "x"`), or None."""
        return None

    # ------------------------------------------------------------------ branches, comparisons, contexts

    def single_process_otherwise(self, node: ast.expr, test: Value) -> bool:
        """Whether the `else` side of this `if` test runs in a single process (the test asks "distributed?")."""
        return False

    def narrowing(self, node: ast.expr) -> tuple[str, Any, bool] | None:
        """What a test says about a local variable: (name, predicate on its objects, whether the predicate holds
        when the test is true), as `isinstance(model, DDP)` says `model` is the wrapper; None when nothing."""
        return None

    def classify_branch(self, test: Value, node: ast.expr) -> tuple[str, Any, Any, str | None]:
        """(ctx kind, info of the body, info of the else side, scope) of an `if` test."""
        text = self.text(node)
        return "cond", text, "not " + text, None

    def compare_value(self, node: ast.Compare, operands: list[Value]) -> Value | None:
        """A comparison the models understand (a rank test), or None."""
        return None

    def boolop_value(self, node: ast.BoolOp, values: list[Value]) -> Value | None:
        return None

    def negation_value(self, node: ast.UnaryOp, operand: Value) -> Value | None:
        """`not x` when the models know what x means, or None."""
        return None

    def context_of(self, obj: Obj) -> tuple[str, Any] | None:
        """(ctx kind, info) a `with` statement over this object enters, or None."""
        if obj.kind == "ctx":
            return obj.props["ctx"], obj.props.get("mode")
        return None

    def function_contexts(self, fobj: Obj, frame_id: int) -> list[Any]:
        """Contexts a decorated function's body runs in (`@torch.no_grad()`)."""
        return []

    def loop_info(self, node: ast.For | ast.AsyncFor | ast.While, iterable: Value | None) -> dict[str, Any]:
        """The info of a loop context (for loops: after the iterable is evaluated)."""
        if isinstance(node, ast.While):
            return {"iter": self.text(node.test), "target": "", "kind": "while"}  # type: ignore[attr-defined]
        kind = "range" if iterable and any(o.kind == "range" for o in iterable) else "other"
        return {"iter": self.text(node.iter), "target": self.text(node.target), "kind": kind}  # type: ignore[attr-defined]

    def on_comprehension(self, node: ast.AST, gen: ast.comprehension, iterable: Value) -> None:
        return None

    # ------------------------------------------------------------------ items and attributes

    def load_item(self, base: Obj, key: Any, node: ast.Subscript) -> Value | None:
        return None

    def store_item(self, base: Obj, key: Any, value: Value, target: ast.Subscript) -> bool:
        return False

    def special_attr(self, obj: Obj, name: str, node: ast.AST | None) -> Value | None:
        """`obj.name` for objects the models made (a wrapper's `.module`), before the object's own fields."""
        return None

    # ------------------------------------------------------------------ calls

    def note_call(self, node: ast.Call) -> None:
        """Seen before a call's parts are evaluated."""
        return

    def call_qual(self, qual: str, node: ast.Call, args: Args, heuristic: bool = False) -> Value:
        """A call to an imported name (`qual` as spelled through the imports)."""
        return self.generic_call(None, qual.rsplit(".", 1)[-1], node, args, qual=qual)

    def call_objects(self, func: Value, node: ast.Call, args: Args) -> tuple[Value, Value]:
        """(result, handled objects) of calling objects the models made (a model's forward)."""
        return (), ()

    def call_other(self, obj: Obj, node: ast.Call, args: Args) -> Value | None:
        """Calling an object of a kind the interpreter does not call itself."""
        return None

    def call_builtin_model(self, name: str, node: ast.Call, args: Args) -> Value | None:
        """A builtin the models give a meaning (print as a report, iter over a loader), or None."""
        return None

    def is_callable_object(self, obj: Obj) -> bool:
        return obj.kind in self.CALLABLE_KINDS

    def method_objects(self, receiver: Value, name: str, node: ast.Call, args: Args) -> tuple[Value, Value]:
        """(result, handled objects) of calling a method on objects the models made, as one group."""
        return (), ()

    def method_events(self, obj: Obj, name: str, node: ast.Call, args: Args) -> bool:
        """Record what a method call does whoever implements it; True when it recorded something."""
        return False

    def method_model(self, obj: Obj, name: str, node: ast.Call, args: Args, late: bool) -> Value | None:
        """A modelled method: `late=False` before Python's dict/list methods are tried, `late=True` after."""
        return None

    def call_result_facts(
        self, func: Obj | None, name: str | None, args: Args, props: dict[str, Any]
    ) -> frozenset[str]:
        """Tags of an unmodelled call's result, from its arguments and its name (`get_rank()`); may add props."""
        return self.depends_tags(args.all())

    # ------------------------------------------------------------------ classes and instances

    def class_facts(self, bases: list[Value], st: ast.ClassDef) -> dict[str, Any]:
        """Props of a class defined in the file, from its bases: at least `instance_kind`."""
        return {"instance_kind": "instance"}

    def make_instance(self, cls: Obj, node: ast.AST) -> Obj:
        return self.new("instance", node, label=cls.label, props={"class": cls})

    def instantiate_model(self, cls: Obj, node: ast.AST, args: Args) -> Value | None:
        """Instantiating a class of the file whose base the models replace entirely (a DDP subclass)."""
        return None

    def before_init(self, inst: Obj, cls: Obj, args: Args) -> None:
        return None

    def after_init(self, inst: Obj, cls: Obj, node: ast.AST) -> None:
        return None

    # ------------------------------------------------------------------ iteration

    def element_model(self, obj: Obj, node: ast.AST) -> Value | None:
        """An element of an iterable object the models made (a batch of a loader), or None."""
        return None
