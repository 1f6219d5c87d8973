"""What the interpreter stands on: call arguments, environment merging, and the one pass over a file's tree.

Nothing here knows about PyTorch: these are pieces of a Python interpreter over abstract values.
"""

from __future__ import annotations

import ast
from functools import cached_property
from typing import Any

from ddpdoctor.plain import Record, ValueRecord
from ddpdoctor.static.semantic import Obj, Value, union

MAX_DEPTH = 24
# A helper called from many call sites is entered at each of the first few, then summarised by what it returned:
# training scripts call their helpers a handful of times, while library-style code can fan out exponentially.
MAX_INLINE_PER_FUNCTION = 16
DEAD: Any = object()  # ControlMixin.narrowed: no object of the variable a test asks about can be on that side
# A safety net for pathological inputs (deep mutual calls in a huge file): past this many visited nodes, calls are
# no longer entered and the model says it was truncated. Real scripts of a few thousand lines use a few percent.
VISIT_BUDGET = 400_000


_bare = object.__new__


class Args(ValueRecord):
    """The arguments of one call, evaluated."""

    __match_args__ = ("pos", "pos_nodes", "kw", "kw_nodes", "opaque")

    def __init__(
        self,
        pos: list[Value] | None = None,
        pos_nodes: list[ast.AST] | None = None,
        kw: dict[str, Value] | None = None,
        kw_nodes: dict[str, ast.AST] | None = None,
        opaque: bool = False,  # *args / **kwargs whose content is not known
    ) -> None:
        self.pos: list[Value] = [] if pos is None else pos
        self.pos_nodes: list[ast.AST] = [] if pos_nodes is None else pos_nodes
        self.kw: dict[str, Value] = {} if kw is None else kw
        self.kw_nodes: dict[str, ast.AST] = {} if kw_nodes is None else kw_nodes
        self.opaque = opaque

    @classmethod
    def none(cls) -> Args:
        """`Args()`, its fields set directly (the class call's protocol is most of its cost): a call's arguments
        before they are evaluated (`build_args`, thousands on a large script), or a call with none."""
        args = _bare(cls)
        args.pos = []
        args.pos_nodes = []
        args.kw = {}
        args.kw_nodes = {}
        args.opaque = False
        return args

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


# Fields that never hold a node: identifiers, flags, operators (childless singletons) and load/store markers.
_SCALAR_FIELDS = frozenset(
    {"ctx", "op", "ops", "id", "attr", "name", "arg", "asname", "module", "level", "kind", "type_comment",
     "is_async", "conversion", "simple", "rest"}
)
# List fields whose items are not all nodes (None keys of `{**d}`, missing keyword-only defaults, identifiers).
_MIXED_LISTS = frozenset(
    {(ast.Dict, "keys"), (ast.arguments, "kw_defaults"), (ast.Global, "names"), (ast.Nonlocal, "names"),
     (ast.MatchClass, "kwd_attrs")}
)
_SINGLE, _LIST, _MIXED = 0, 1, 2
_CHILD_FIELDS: dict[type, tuple[tuple[str, int], ...]] = {}


def _child_fields(t: type, sample: ast.AST) -> tuple[tuple[str, int], ...]:
    """The fields of a node type that may hold nodes, in order, each with how it holds them."""
    out = []
    for f in t._fields:
        if f in _SCALAR_FIELDS or (f == "value" and t in (ast.Constant, ast.MatchSingleton)):
            continue
        if (t, f) in _MIXED_LISTS:
            out.append((f, _MIXED))
        elif isinstance(getattr(sample, f, None), list):
            out.append((f, _LIST))
        else:
            out.append((f, _SINGLE))
    _CHILD_FIELDS[t] = fields = tuple(out)
    return fields


def walk(tree: ast.AST) -> list[ast.AST]:
    """Every node of a tree in `ast.walk`'s breadth-first order, without the load/store context markers and the
    operator singletons (`ast.Add()`, `ast.Eq()`: they have no children and nothing reads them): a plain list built
    in one loop, lists of children appended whole (several times faster than `ast.walk`)."""
    out: list[ast.AST] = [tree]
    push = out.append
    extend = out.extend
    fields_of = _CHILD_FIELDS
    node_type = ast.AST
    for node in out:  # the list grows while it is read: breadth-first
        t = type(node)
        fields = fields_of.get(t)
        if fields is None:
            fields = _child_fields(t, node)
        for name, how in fields:
            v = getattr(node, name, None)
            if how == _LIST:
                extend(v)
            elif how == _SINGLE:
                if isinstance(v, node_type):
                    push(v)
            elif v:
                for x in v:
                    if isinstance(x, node_type):
                        push(x)
    return out


class SourceIndex:
    """Facts about one file's tree gathered in a single walk, shared by the interpreter, the semantic model and
    the rules (each used to walk the whole tree again; on a 4,000-line script each walk cost as much as the
    interpretation itself).

    The walk is breadth-first (`ast.walk` order), so `words` keeps the order it always had; `nodes` is that walk,
    kept for the rules that look for a syntactic pattern anywhere in the file (they filter it instead of walking
    the tree again). It is `walk`'s loop with the facts gathered in it (one pass over the nodes instead of two;
    names and constants, half of the nodes, have no children and skip the child fields): the same list as
    `walk(tree)` (tests/test_static.py checks it on every fixture).
    """

    def __init__(self, tree: ast.Module) -> None:
        self.defs_by_name: dict[str, list[ast.AST]] = {}
        self.bound_names: set[str] = set()
        self.functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
        self.method_class: dict[ast.AST, ast.ClassDef] = {}
        self.called_names: set[str] = set()
        self.loaded_names: set[str] = set()  # names and attributes read (called, or passed on: `spawn(worker)`)
        self.with_items: list[ast.withitem] = []
        self.imports: set[str] = set()
        self.import_specs: list[tuple[str, int, tuple[str, ...]]] = []  # (module, level, names imported from it)
        self.strings: set[str] = set()
        parts: list[str] = []
        docstrings: set[int] = set()
        append = parts.append
        # the node types and set methods as locals: this loop visits every node of the file
        Name, Attribute, Call, Constant, Expr, Store, Load = (
            ast.Name, ast.Attribute, ast.Call, ast.Constant, ast.Expr, ast.Store, ast.Load
        )
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        bound, loaded, called = self.bound_names.add, self.loaded_names.add, self.called_names.add
        self.nodes = nodes = [tree]
        push, extend, fields_of, node_type = nodes.append, nodes.extend, _CHILD_FIELDS, ast.AST
        for node in nodes:  # the list grows while it is read: breadth-first, as in `walk`
            t = type(node)
            if t is Name:
                append(node.id)
                if type(node.ctx) is Store:
                    bound(node.id)
                else:
                    loaded(node.id)
                continue  # no child fields
            elif t is Attribute:
                append(node.attr)
                if type(node.ctx) is Load:
                    loaded(node.attr)
            elif t is Call:
                func = node.func
                if type(func) is Name:
                    called(func.id)
                elif type(func) is Attribute:
                    called(func.attr)
            elif t is Constant:
                if type(node.value) is str:
                    self.strings.add(node.value)
                    if id(node) not in docstrings:
                        append(node.value[:200])
                continue  # no child fields
            elif t is Expr:
                if type(node.value) is Constant:
                    docstrings.add(id(node.value))
            elif t in defs:
                append(node.name)
                self.defs_by_name.setdefault(node.name, []).append(node)
                bound(node.name)
                if t is ast.ClassDef:
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            self.method_class[item] = node
                else:
                    self.functions.append(node)
            elif t is ast.arg:
                append(node.arg)
                bound(node.arg)
            elif t is ast.keyword:
                if node.arg:
                    append(node.arg)
            elif t is ast.alias:
                bound((node.asname or node.name).split(".")[0])
            elif t is ast.Import:
                self.imports.update(a.name for a in node.names)
                self.import_specs.extend((a.name, 0, ()) for a in node.names)
            elif t is ast.ImportFrom:
                if node.module:
                    self.imports.add(node.module)
                self.import_specs.append((node.module or "", node.level or 0, tuple(a.name for a in node.names)))
            elif t is ast.withitem:
                self.with_items.append(node)
            fields = fields_of.get(t)
            if fields is None:
                fields = _child_fields(t, node)
            for name, how in fields:
                v = getattr(node, name, None)
                if how == _LIST:
                    extend(v)
                elif how == _SINGLE:
                    if isinstance(v, node_type):
                        push(v)
                elif v:
                    for x in v:
                        if isinstance(x, node_type):
                            push(x)
        self._parts = parts

    @cached_property
    def words(self) -> str:
        """Every identifier, attribute and string constant (not docstrings) of the file, lower-cased."""
        return " ".join(self._parts).lower()


class SourceFile(Record):
    """One parsed file: its path as reported in findings, its text, its tree, and the index of its tree."""

    __match_args__ = ("path", "source", "tree")

    def __init__(self, path: str, source: str, tree: ast.Module) -> None:
        self.path = path
        self.source = source
        self.tree = tree

    @cached_property
    def index(self) -> SourceIndex:
        return SourceIndex(self.tree)

    @cached_property
    def lines(self) -> list[str]:
        return self.source.splitlines()

    @cached_property
    def top_names(self) -> tuple[frozenset[str], frozenset[str] | None]:
        """(names the module's global scope defines, the literal `__all__` or None): what `from m import *`
        may bind, read from the top-level statements only."""
        names: set[str] = set()
        exported: set[str] | None = None
        stack: list[ast.stmt] = list(self.tree.body)
        while stack:
            st = stack.pop()
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(st.name)
            elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
                            if n.id == "__all__" and isinstance(st.value, (ast.List, ast.Tuple)):
                                exported = {e.value for e in st.value.elts if isinstance(e, ast.Constant)}
            elif isinstance(st, (ast.Import, ast.ImportFrom)):
                for a in st.names:
                    if a.name != "*":
                        names.add((a.asname or a.name).split(".")[0])
            elif isinstance(st, (ast.If, ast.Try, ast.With)):
                stack.extend(getattr(st, "body", []) + getattr(st, "orelse", []) + getattr(st, "finalbody", []))
                for h in getattr(st, "handlers", []):
                    stack.extend(h.body)
        return frozenset(names), (frozenset(exported) if exported is not None else None)


def merge_env(
    a: dict[str, Value], b: dict[str, Value], cap: Any, written: set[str] | None = None
) -> dict[str, Value]:
    """The variables after two paths join: each name holds what either path left in it.

    Both paths usually start from the same variables and change a few (a long function holds thousands at every
    `if`), so the names whose values differ are picked out first in one comprehension, and only those are
    joined; a name in `b` alone is appended in `b`'s order, as before. `written`, when given, holds every name
    bound on either path since they parted (`Frame.written`): only those can differ, and only those are compared
    (a loop at module level would otherwise compare all the module's variables)."""
    out = dict(a)
    get = a.get
    if written is None:
        changed = [k for k, v in b.items() if get(k) is not v]
    else:
        changed = [k for k in written if k in b and get(k) is not b[k]]
        added = {k for k in changed if k not in a}
        if added:  # appended in b's order: they are among the names b gained last, so walk b from its end
            tail: list[str] = []
            for k in reversed(b):
                if k in added:
                    tail.append(k)
                    if len(tail) == len(added):
                        break
            changed = [k for k in changed if k in a] + tail[::-1]
    for k in changed:
        v = b[k]
        out[k] = cap(union(a[k], v)) if k in a else v
    return out


def merge_loop_env(before: dict[str, Value], after: dict[str, Value], cap: Any, written: set[str]) -> dict[str, Value]:
    """`merge_env(before, after, cap, written)` where `after` is the end of a loop body walked from a copy of
    `before`, joined into `after` itself instead of a new copy (a module-level loop would copy the module's
    variables once more). The same dict results: no name is ever removed from a frame's variables, so `after`
    holds `before`'s names in their order and then the names the body added, which the counts confirm (else the
    copying merge runs)."""
    added = 0
    for k in written:
        v = after.get(k)
        if v is None:
            if k in after:
                return merge_env(before, after, cap, written)  # a name holding None: merge_env keeps it out
            continue
        old = before.get(k)
        if old is None:
            added += 1
    if len(after) != len(before) + added:
        return merge_env(before, after, cap, written)
    for k in written:
        old = before.get(k)
        if old is not None:
            v = after[k]
            if old is not v:
                after[k] = cap(union(old, v))
    return after


def const_key(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int)):
        return node.value
    return None


def is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def target_ident(target: ast.AST) -> str | None:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    if (
        isinstance(target, ast.Subscript)
        and isinstance(target.slice, ast.Constant)
        and isinstance(target.slice.value, str)
    ):
        return target.slice.value
    return None


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return dotted(node.func)
    return ""


def dotted_name(node: ast.AST) -> str | None:
    """`a.b.c` for a name or a chain of attributes on one (exactly what `ast.unparse` writes for it), else None."""
    parts: list[str] = []
    while type(node) is ast.Attribute:
        parts.append(node.attr)
        node = node.value
    if type(node) is not ast.Name:
        return None
    if not parts:
        return node.id
    parts.append(node.id)
    return ".".join(reversed(parts))


_CMP_TEXT = {
    ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Is: "is",
    ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in",
}


def _atom_text(node: ast.AST) -> str | None:
    """`ast.unparse` of a name, an attribute chain on one, a plain literal (an int, True/False/None, a string
    with nothing to escape or quote) or a call of a dotted name with such arguments; None for anything else."""
    t = type(node)
    if t is ast.Name or t is ast.Attribute:
        return dotted_name(node)
    if t is ast.Constant:
        v = node.value
        tv = type(v)
        if tv is int or tv is bool or v is None:
            return repr(v)
        if tv is str and node.kind is None and v.isprintable() and "'" not in v and '"' not in v and "\\" not in v:
            return "'" + v + "'"
        return None
    if t is ast.Call:
        func = dotted_name(node.func)
        if func is None:
            return None
        parts = _atom_texts(node.args)
        if parts is None:
            return None
        for k in node.keywords:
            text = _atom_text(k.value) if k.arg is not None else None
            if text is None:
                return None
            parts.append(k.arg + "=" + text)
        return func + "(" + ", ".join(parts) + ")"
    return None


def _atom_texts(nodes: list[ast.expr]) -> list[str] | None:
    """Each node's `_atom_text`, or None when one of them is not an atom."""
    parts = []
    for node in nodes:
        text = _atom_text(node)
        if text is None:
            return None
        parts.append(text)
    return parts


def _operand_text(node: ast.AST, compare: bool = True) -> str | None:
    """An operand of `and` / `or` / `not` as `ast.unparse` writes it there: an atom, or (where `compare`) a
    comparison of atoms, which binds tighter than the three and so needs no parentheses."""
    if type(node) is ast.Compare:
        return simple_text(node) if compare else None
    return _atom_text(node)


def simple_text(node: ast.AST) -> str | None:
    """Exactly what `ast.unparse(node)` writes, for the small expressions the walk names most (a call of a dotted
    name, a tuple of names, a comparison, `a or b`, `not x`, over atoms: see `_atom_text`), without building an
    unparser (tens of thousands of instructions each); None for anything else, which `ast.unparse` then writes.
    tests/test_static.py holds it to `ast.unparse` on every expression of the fixtures and of ddpdoctor itself."""
    t = type(node)
    if t is ast.Compare:
        left = _atom_text(node.left)
        if left is None:
            return None
        parts = [left]
        for op, right in zip(node.ops, node.comparators):
            text = _atom_text(right)
            if text is None:
                return None
            parts.append(_CMP_TEXT[type(op)])
            parts.append(text)
        return " ".join(parts)
    if t is ast.Tuple:
        parts = _atom_texts(node.elts)
        if parts is None:
            return None
        return "(" + parts[0] + ",)" if len(parts) == 1 else "(" + ", ".join(parts) + ")"
    if t is ast.BoolOp:
        # unparse raises the precedence it writes each further operand at by one level: from the third operand of
        # `or` (the second of `and`) on, a comparison gets parentheses; those are left to unparse
        conj = type(node.op) is ast.And
        parts = []
        for i, v in enumerate(node.values):
            text = _operand_text(v, compare=i < (2 if conj else 3))
            if text is None:
                return None
            parts.append(text)
        return (" and " if conj else " or ").join(parts)
    if t is ast.UnaryOp and type(node.op) is ast.Not:
        text = _operand_text(node.operand)
        return None if text is None else "not " + text
    return _atom_text(node)


def dotted_last(node: ast.AST) -> str | None:
    d = dotted(node)
    return d.rsplit(".", 1)[-1] if d else None


def first_const_str(args: Args) -> str | None:
    for v in args.pos:
        for o in v:
            if o.kind == "const" and isinstance(o.value, str):
                return o.value
    return None


__all__ = [
    "Args",
    "Obj",
    "SourceFile",
    "SourceIndex",
    "const_key",
    "dotted",
    "dotted_name",
    "dotted_last",
    "first_const_str",
    "is_main_guard",
    "merge_env",
    "merge_loop_env",
    "simple_text",
    "target_ident",
]


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_BLOCK_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")  # where statements hold statements


def counters(body: list[ast.stmt]) -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
    """What `x += ...` updates in these statements, nested scopes left out: the names, and the (name, attribute)
    pairs of `name.attr += ...`. A loop walked once sees such a counter at its first value only; it is what
    changes from one iteration (or one call) to the next."""
    names: set[str] = set()
    attrs: set[tuple[str, str]] = set()
    stack: list[ast.AST] = list(body)
    while stack:  # statements only: an augmented assignment is one
        node = stack.pop()
        t = type(node)
        if t is ast.AugAssign:
            target = node.target
            if isinstance(target, ast.Name):
                names.add(target.id)
            elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                attrs.add((target.value.id, target.attr))
        elif t not in _SCOPES:
            for name in _BLOCK_FIELDS:
                block = getattr(node, name, None)
                if block:
                    stack.extend(block)
    return frozenset(names), frozenset(attrs)
