"""Names and binding of the interpreter: scopes (locals, closures, globals, class bodies), and assignment to
names, attributes, items and unpacked targets."""

from __future__ import annotations

import ast
import builtins

from ddpdoctor.static.engine.support import counters
from ddpdoctor.static.semantic import Frame, Obj, Value, union

BUILTIN_NAMES = frozenset(dir(builtins))


class BindingMixin:
    """The naming half of `Interpreter`."""

    def lookup(self, name: str, node: ast.AST) -> Value:
        frame = self.frames[-1]
        module_frame = self._file_frames.get(frame.file) or self.module_frame  # module_frame_of, inlined: hot
        if name in frame.globals_declared:
            if name in module_frame.locals:
                return self.resolve_lazy(module_frame, name)
        else:
            # the enclosing scopes (class bodies only when they are the current scope), then the module's globals
            f: Frame | None = frame
            seen_module = False
            while f is not None:
                if (f is frame or not f.is_class_body) and name in f.locals:
                    # resolve_lazy, inlined for a name no lazy import binds (nearly all lookups)
                    return self.resolve_lazy(f, name) if name in f.lazy else f.locals[name]
                seen_module = seen_module or f is module_frame
                f = f.lexical
            if not seen_module and name in module_frame.locals:
                return self.resolve_lazy(module_frame, name)
        if module_frame.stars and name not in BUILTIN_NAMES:
            starred = self.from_stars(module_frame, name, node)
            if starred is not None:
                module_frame.locals[name] = starred
                if module_frame.written is not None:
                    module_frame.written.add(name)
                return starred
        if name not in self.index_of(frame.file).bound_names:
            guessed = self.unbound_name(name, node)
            if guessed is not None:
                return guessed
        if name in BUILTIN_NAMES:
            return (self.new("builtin", node, label=name),)
        key = (frame.file, name)
        ph = self._placeholders.get(key)
        if ph is None:
            ph = self.named_unknown(node, name, free=True)
            self._placeholders[key] = ph
        return (ph,)

    def bind_name(self, name: str, value: Value) -> None:
        frame = self.frame
        if name in frame.globals_declared:
            module_frame = self.module_frame_of(frame.file)
            module_frame.locals[name] = value
            if module_frame.written is not None:
                module_frame.written.add(name)
            return
        if name in frame.nonlocal_declared:
            f = frame.lexical
            while f is not None:
                if name in f.locals:
                    f.locals[name] = value
                    if f.written is not None:
                        f.written.add(name)
                    return
                f = f.lexical
        frame.locals[name] = self.tag_binding(name, value)
        if frame.written is not None:
            frame.written.add(name)
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

    def field_counters(self, cls: Obj, seen: set[int] | None = None) -> frozenset[str]:
        """The fields a class's methods (and its bases') update with `self.field += ...`."""
        node = cls.props.get("node")
        if node is None:
            return frozenset()
        found = self._field_counters.get(id(node))
        if found is None:
            names: set[str] = set()
            for item in getattr(node, "body", ()):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.args.args:
                    me = item.args.args[0].arg
                    names.update(attr for base, attr in counters(item.body)[1] if base == me)
            seen = seen if seen is not None else set()
            seen.add(id(node))
            for base in cls.props.get("bases", []):
                for b in base:
                    if b.kind == "class" and id(b.props.get("node")) not in seen:
                        names |= self.field_counters(b, seen)
            found = self._field_counters[id(node)] = frozenset(names)
        return found
