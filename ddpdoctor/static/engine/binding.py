"""Names and binding of the interpreter: scopes (locals, closures, globals, class bodies), and assignment to
names, attributes, items and unpacked targets."""

from __future__ import annotations

import ast
import builtins

from ddpdoctor.static.semantic import Frame, Obj, Value, union

BUILTIN_NAMES = frozenset(dir(builtins))


class BindingMixin:
    """The naming half of `Interpreter`."""

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
        if name not in self._bound_names:
            guessed = self.unbound_name(name, node)
            if guessed is not None:
                return guessed
        if name in BUILTIN_NAMES:
            return (self.new("builtin", node, label=name),)
        ph = self._placeholders.get(name)
        if ph is None:
            ph = self.named_unknown(node, name, free=True)
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
        frame.locals[name] = self.tag_binding(name, value)
        self._label(value, name)

    def _label(self, value: Value, text: str) -> None:
        kinds = self.LABELLED_KINDS
        for o in value:
            if o.kind in kinds:
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
                if self.store_item(b, key, value, target):
                    continue
                if b.kind in self.ITEM_STORE_KINDS and isinstance(key, (str, int)):
                    self._set_field(b, f"[{key}]" if b.kind != "dict" else str(key), value, strong=False)
        elif isinstance(target, (ast.Tuple, ast.List)):
            self._unpack(target.elts, value, target)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, (self.new("tuple", target, props={"elem": self.element_of(value, target)}),))

    def _set_field(self, obj: Obj, name: str, value: Value, strong: bool) -> None:
        if strong or name not in obj.fields:
            obj.fields[name] = value
        else:
            obj.fields[name] = self.capped(union(obj.fields[name], value))

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
