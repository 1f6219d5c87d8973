"""Expression evaluation of the interpreter: each `ex_<Node>` returns the Value an expression may have."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from ddpdoctor.static.engine.support import DEAD, const_key
from ddpdoctor.static.semantic import EMPTY, Ctx, Obj, Value, is_constant, union

BIN_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


CMP_OPS: dict[type, Callable[[Any, Any], Any]] = {
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
NOT_COMPUTED = object()


def known_value(value: Value) -> Any:
    """The Python value of a Value that is one literal (or a number computed from literals), else NOT_COMPUTED."""
    if len(value) != 1:
        return NOT_COMPUTED
    o = value[0]
    if o.kind == "const" or (o.const and o.kind in ("value", "tuple") and o.value is not None):
        return o.value
    return NOT_COMPUTED


def truth_of(value: Value) -> bool | None:
    """Whether a Value is truthy when every object it may hold is a known literal of one truthiness, else None."""
    truths = set()
    for o in value:
        v = known_value((o,))
        if v is NOT_COMPUTED:
            return None
        try:
            truths.add(bool(v))
        except Exception:
            return None
    return truths.pop() if len(truths) == 1 else None


def compare_constants(node: ast.Compare, operands: list[Value]) -> bool | None:
    """`a < b == c` over known literals, else None."""
    values = [known_value(v) for v in operands]
    if any(v is NOT_COMPUTED for v in values):
        return None
    try:
        return all(bool(CMP_OPS[type(op)](values[i], values[i + 1])) for i, op in enumerate(node.ops))
    except Exception:
        return None


class ExpressionsMixin:
    """The expression half of `Interpreter`."""

    def eval(self, node: ast.AST | None) -> Value:
        if node is None:
            return EMPTY
        self._visits += 1
        t = type(node)  # not node.__class__: CPython 3.11 never specialises an attribute read on an AST node
        handler = self._ex_handlers.get(t)
        if handler is None:
            handler = getattr(self, "ex_" + t.__name__, None) or self._ex_unmodelled
            self._ex_handlers[t] = handler
        return handler(node)

    def _ex_unmodelled(self, node: ast.AST) -> Value:
        return (self.unknown(node),)

    def _const_key(self, node: ast.AST) -> Any:
        return const_key(node)

    def ex_Constant(self, node: ast.Constant) -> Value:
        # a literal's object is never changed by what happens to it (fields, labels and marks go to other kinds):
        # one per literal in the source, however often it is evaluated
        value = self._literals.get(id(node))
        if value is None:
            value = self._literals[id(node)] = (self.const(node.value, node),)
        return value

    def ex_Name(self, node: ast.Name) -> Value:
        value = self.lookup(node.id, node)
        return value if len(value) < 2 or not self.ctx else self._on_path(value)

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
            modelled = self.load_item(b, key, node)
            if modelled is not None:
                out.extend(modelled)
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
                out.append(
                    self._derived(
                        b, f"[{key}]" if key is not None else "[]", node, key_name=key if isinstance(key, str) else None
                    )
                )
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
        obj.tags = self.carried_tags(union(*items))
        return (obj,)

    ex_List = _sequence
    ex_Tuple = _sequence
    ex_Set = _sequence

    def ex_Dict(self, node: ast.Dict) -> Value:
        obj = self.new("dict", node)
        for k, v in zip(node.keys, node.values, strict=True):
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
        tags = frozenset().union(*(self.carried_tags(p) for p in parts))
        return (self.new("value", node, tags=tags, const=const, value=text if const else None, props={"text": text}),)

    def ex_FormattedValue(self, node: ast.FormattedValue) -> Value:
        return self.eval(node.value)

    def ex_BinOp(self, node: ast.BinOp) -> Value:
        left = self.eval(node.left)
        right = self.eval(node.right)
        return (self._binop_value(node, type(node.op), left, right),)

    def _binop_value(self, node: ast.AST, op: type, left: Value, right: Value) -> Obj:
        modelled = self.binop_model(node, op, left, right)
        if modelled is not None:
            return modelled
        const = is_constant(left) and is_constant(right)
        value = None
        if const and len(left) == 1 and len(right) == 1 and op in BIN_OPS:
            a, b = left[0].value, right[0].value
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
                try:
                    value = BIN_OPS[op](a, b)
                except (ArithmeticError, ValueError):
                    value = None
        both = union(left, right)
        return self.new(
            "value",
            node,
            tags=self.carried_tags(both),
            const=const,
            value=value,
            props={"op": op.__name__, "left": left, "right": right, **self.carried_props(both)},
        )

    def ex_UnaryOp(self, node: ast.UnaryOp) -> Value:
        operand = self.eval(node.operand)
        if isinstance(node.op, ast.Not):
            modelled = self.negation_value(node, operand)
            if modelled is not None:
                return modelled
            truth = truth_of(operand)
            if truth is not None:
                return (self.const(not truth, node),)
            return (self.new("value", node),)
        const = is_constant(operand)
        value = None
        if const and len(operand) == 1 and isinstance(operand[0].value, (int, float)) and isinstance(node.op, ast.USub):
            value = -operand[0].value
        return (
            self.new(
                "value",
                node,
                tags=self.carried_tags(operand),
                const=const,
                value=value,
                props=self.carried_props(operand),
            ),
        )

    def ex_BoolOp(self, node: ast.BoolOp) -> Value:
        values = [self.eval(v) for v in node.values]
        modelled = self.boolop_value(node, values)
        if modelled is not None:
            return modelled
        # Python's semantics: `a or b` is a when a is truthy, else b; an operand of unknown truth may be either
        stop_on = isinstance(node.op, ast.Or)
        results: list[Value] = []
        for i, v in enumerate(values):
            truth = truth_of(v)
            if truth is None or truth == stop_on or i == len(values) - 1:
                results.append(v)
            if truth == stop_on:
                break
        return union(*results)

    def ex_Compare(self, node: ast.Compare) -> Value:
        operands = [self.eval(node.left)] + [self.eval(c) for c in node.comparators]
        modelled = self.compare_value(node, operands)
        if modelled is not None:
            return modelled
        folded = compare_constants(node, operands)
        if folded is not None:
            return (self.const(folded, node),)
        return (self.new("value", node),)

    def ex_IfExp(self, node: ast.IfExp) -> Value:
        test = self.eval(node.test)
        frame_id = self.frame.id
        narrowing = self.narrowing(node.test)
        sides: list[Value] = []
        for branch, part in ((0, node.body), (1, node.orelse)):
            kept = self.narrowed(narrowing, branch == 0)
            if kept is DEAD:
                continue  # no object of the variable the test asks about takes this side here
            held = None
            if kept is not None:  # an expression binds nothing: the variable is narrowed for this side only
                held, self.frame.locals[narrowing[0]] = self.frame.locals[narrowing[0]], kept
                if self.frame.written is not None:
                    self.frame.written.add(narrowing[0])
            self.ctx.append(Ctx("cond", node, self.text(node.test), frame_id, branch, None, test, file=self.frame.file))
            try:
                sides.append(self.eval(part))
            finally:
                self.ctx.pop()
                if held is not None:
                    self.frame.locals[narrowing[0]] = held
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
                self.on_comprehension(node, gen, iterable)
                self.bind(gen.target, self.element_of(iterable, gen))
                for cond in gen.ifs:
                    self.eval(cond)
            return [self.eval(e) for e in elts]
        finally:
            frame.locals = saved

    def ex_ListComp(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp) -> Value:
        (elem,) = self._comprehension(node, node.generators, [node.elt])
        return (self.new("tuple", node, props={"elem": elem}, tags=self.carried_tags(elem)),)

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
        self.frame.generator = True  # a function whose body yields returns a generator
        if node.value is not None:
            value = self.eval(node.value)
            self.frame.yields.append(self.element_of(value, node) if isinstance(node, ast.YieldFrom) else value)
        return (self.unknown(node),)

    ex_YieldFrom = ex_Yield

    def ex_Slice(self, node: ast.Slice) -> Value:
        for part in (node.lower, node.upper, node.step):
            self.eval(part)
        return (self.unknown(node),)
