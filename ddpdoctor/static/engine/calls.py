"""Attributes, functions, classes and calls of the interpreter: Python's calling convention over abstract values.

A call to a function or method defined in the analysed code is entered at its call site with the arguments bound
to the parameters (`call_function`); a call to an imported name goes to `call_qual`, where the models of library
APIs live; a call nobody models becomes a `call` event and an unknown result that remembers its arguments.
"""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor.static.engine.support import (
    MAX_DEPTH,
    MAX_INLINE_PER_FUNCTION,
    VISIT_BUDGET,
    Args,
    dotted_last,
)
from ddpdoctor.static.semantic import EMPTY, Ctx, Frame, Obj, Value, is_constant, union

# numeric builtins whose result is the value they are given, converted (`int(x)`, `abs(x)`)
PASSTHROUGH_BUILTINS = frozenset(
    {"int", "float", "str", "bool", "round", "abs", "max", "min", "sum", "pow", "divmod", "format"}
)
# of those, the ones that keep what the value is (`int(os.environ["RANK"])` is still the rank; `max(a, b)` is not)
IDENTITY_BUILTINS = frozenset({"int", "str", "float", "round", "abs"})
OPAQUE_BUILTINS = frozenset(
    {
        "isinstance",
        "hasattr",
        "callable",
        "issubclass",
        "len",
        "any",
        "all",
        "id",
        "hash",
        "type",
        "repr",
        "open",
        "vars",
    }
)


class CallsMixin:
    """The calling half of `Interpreter`."""

    # ------------------------------------------------------------------ attributes

    def _derived(self, base: Obj, name: str, node: ast.AST | None, key_name: str | None = None) -> Obj:
        """`base.name` (or `base[key]`) for an object whose attribute is not modelled; cached so it has one identity."""
        cached = base.fields.get(name)
        if cached:
            return cached[0] if len(cached) == 1 else self.new("unknown", node, props={"alternatives": cached})
        ident = key_name if key_name is not None else (name if not name.startswith("[") else None)
        tags, extra = self.attribute_facts(base, ident)
        base_label = base.props.get("bound_name") or base.label
        label = (
            f"{base_label}.{name}"
            if base_label and not name.startswith("[")
            else (f"{base_label}{name}" if base_label else name)
        )
        props: dict[str, Any] = {"base": base, "attr": name, **extra}
        obj = self.new("unknown", node, label=label, tags=tags, props=props)
        if base.kind not in ("const", "qual", "builtin", "value"):
            base.fields[name] = (obj,)
        return obj

    def get_attr(self, obj: Obj, name: str, node: ast.AST | None) -> Value:
        kind = obj.kind
        if kind == "qual":
            return (
                self.new(
                    "qual",
                    node,
                    qual=f"{obj.qual}.{name}",
                    label=name,
                    props={"heuristic": obj.props.get("heuristic", False)},
                ),
            )
        if kind == "pymodule":
            return self.module_attr(obj.props["module"], name, node)
        modelled = self.special_attr(obj, name, node)
        if modelled is not None:
            return modelled
        cls = obj.props.get("class")
        if name in obj.fields:
            held = obj.fields[name]
            if cls is not None and name in self.field_counters(cls) and any(o.const for o in held):
                # `self.epoch += 1` in a method: from one call to the next the field is not that constant
                return union(held, (self.new("value", node, label=f"{obj.label or 'self'}.{name}",
                                             props={"counter": True}),))
            return held
        if cls is not None or kind in ("class", "super"):
            found = self._attr_from_class(obj, name)
            if found is not None:
                return found
        return (self._derived(obj, name, node),)

    def _dunder_call(self, obj: Obj) -> Value | None:
        """The bound `__call__` of an instance of a project class, when every candidate is a function."""
        if obj.props.get("class") is None:
            return None
        found = self._lookup_class_attr(obj.props["class"], "__call__")
        if not found or not all(f.kind == "function" for f in found):
            return None
        return self._bind_methods(found, (obj,))

    def _attr_from_class(self, obj: Obj, name: str) -> Value | None:
        if obj.kind == "class":
            return self._lookup_class_attr(obj, name)
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

    # ------------------------------------------------------------------ functions

    def _define_function(
        self,
        st: ast.FunctionDef | ast.AsyncFunctionDef,
        closure: Frame,
        cls: Obj | None,
        evaluate_defaults: bool,
    ) -> Obj:
        decorators = [self.eval(d) for d in st.decorator_list] if evaluate_defaults else []
        defaults = [self.eval(d) for d in st.args.defaults] if evaluate_defaults else []
        kw_defaults = {
            a.arg: self.eval(d)
            for a, d in zip(st.args.kwonlyargs, st.args.kw_defaults, strict=True)
            if d is not None and evaluate_defaults
        }
        parent = self.frames[-1] if self.frames else None
        if cls is not None:
            qualname = f"{cls.label}.{st.name}"
        elif parent is not None and parent.name != "<module>" and not parent.is_class_body:
            qualname = f"{parent.name}.{st.name}"
        else:
            qualname = st.name
        deco_names = {dotted_last(d) for d in st.decorator_list}
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

    def no_args(self) -> Args:
        return Args.none()

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
        entry = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))  # entered with no call
        frame = Frame(
            id=next(self._frame_ids),
            name=fobj.props["qualname"],
            locals={},
            lexical=fobj.props["closure"],
            node=fnode,
            cls=fobj.props.get("cls"),
            file=fobj.file,
            call_site=None if entry else (self.frame.file, getattr(node, "lineno", 0) or 0, fobj.props["qualname"]),
        )
        self._bind_params(frame, fobj, args, self_obj)
        contexts = self.function_contexts(fobj, frame.id)
        self.ctx.extend(contexts)
        pushed = len(contexts)
        frame.ctx_base = len(self.ctx)
        self.frames.append(frame)
        self._active.append(fnode)
        try:
            if isinstance(fnode, ast.Lambda):
                result = self.eval(fnode.body)
            else:
                self.block(fnode.body)
                if frame.generator:
                    # a generator: what it yields, and what it was given to iterate (`log_every(loader)`)
                    yields = self.capped(union(*frame.yields))
                    label = f"{fobj.props['qualname']}()"
                    result = (self.unknown(node, label=label, call_args=args, yields=yields),)
                else:
                    result = self.capped(union(*frame.returns)) if frame.returns else (self.const(None, node),)
        finally:
            self._active.pop()
            self.frames.pop()
            if pushed:
                del self.ctx[len(self.ctx) - pushed :]
        self._summaries[fnode] = self.capped(union(self._summaries.get(fnode, EMPTY), result))
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
                v = (self.named_unknown(p, p.arg, param=p.arg),)
            frame.locals[p.arg] = self.tag_binding(p.arg, v)
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
                frame.locals[p.arg] = (self.named_unknown(p, p.arg, param=p.arg),)
        if spec.kwarg is not None:
            known = {p.arg for p in positional} | {p.arg for p in spec.kwonlyargs}
            d = self.new("dict", spec.kwarg)
            for k, v in args.kw.items():
                if k not in known:
                    d.fields[k] = v
            frame.locals[spec.kwarg.arg] = (d,)

    # ------------------------------------------------------------------ classes

    def instantiate(self, cls: Obj, node: ast.AST, args: Args) -> Value:
        modelled = self.instantiate_model(cls, node, args)
        if modelled is not None:
            return modelled
        inst = self.make_instance(cls, node)
        self._instances.setdefault(cls.props["node"], []).append(inst)
        self.before_init(inst, cls, args)
        init = self._lookup_class_attr_objs(cls, "__init__")
        if init is not None:
            self.call_function(init, args, node, self_obj=(inst,))
        self.after_init(inst, cls, node)
        return (inst,)

    # ------------------------------------------------------------------ calls

    def build_args(self, node: ast.Call) -> Args:
        args = Args.none()
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
        self.note_call(node)
        if isinstance(node.func, ast.Attribute):
            receiver = self.eval(node.func.value)
            args = self.build_args(node)
            return self.method_call(receiver, node.func.attr, node, args)
        func = self.eval(node.func)
        args = self.build_args(node)
        return self.call_value(func, node, args)

    def call_value(self, func: Value, node: ast.Call, args: Args) -> Value:
        result, handled = self.call_objects(func, node, args)
        out: list[Obj] = list(result)
        for o in func:
            if o in handled:
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
            elif kind == "instance" and (call := self._dunder_call(o)):
                # a project class's instance called like a function: its __call__ (an AMP scaler helper that
                # runs backward and the optimizer step, Swin's NativeScalerWithGradNormCount)
                out.extend(self.call_value(call, node, args))
            elif kind == "partial":
                merged = Args(
                    pos=list(o.props["args"].pos) + args.pos,
                    pos_nodes=list(o.props["args"].pos_nodes) + args.pos_nodes,
                    kw={**o.props["args"].kw, **args.kw},
                    kw_nodes={**o.props["args"].kw_nodes, **args.kw_nodes},
                    opaque=o.props["args"].opaque or args.opaque,
                )
                out.extend(self.call_value(o.props["func"], node, merged))
            else:
                other = self.call_other(o, node, args)
                out.extend(other if other is not None else self.generic_call(o, dotted_last(node.func), node, args))
        return self.capped(union(out)) or (self.unknown(node),)

    def generic_call(
        self, func: Obj | None, name: str | None, node: ast.Call, args: Args, qual: str | None = None
    ) -> Value:
        """A call whose target is not modelled: keep where its result came from (world size, grads) and its name."""
        props: dict[str, Any] = {"call": name, "call_args": args, "qual": qual}
        tags = self.call_result_facts(func, name, args, props)
        const = bool(qual and qual.startswith("math.") and is_constant(args.all()))
        label = (func.props.get("bound_name") or func.label) if func is not None else name
        self.emit("call", node, name=name, qual=qual, args=args, func=func)
        result = self.new("unknown", node, label=f"{label}()" if label else None, tags=tags, const=const, props=props)
        if self.ctx:
            self.mark_new(result)
        return (result,)

    def method_call(self, receiver: Value, name: str, node: ast.Call, args: Args) -> Value:
        result, handled = self.method_objects(receiver, name, node, args)
        out: list[Obj] = list(result)
        for o in receiver:
            if o in handled:
                continue
            out.extend(self.object_method(o, name, node, args))
        return union(out) or (self.unknown(node),)

    def object_method(self, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
        kind = o.kind
        if kind == "qual":
            return self.call_qual(f"{o.qual}.{name}", node, args, heuristic=o.props.get("heuristic", False))
        if kind == "pymodule":
            return self.call_value(self.module_attr(o.props["module"], name, node.func), node, args)
        emitted = self.method_events(o, name, node, args)
        if kind in ("class", "super") or o.props.get("class") is not None:
            found = self._attr_from_class(o, name)
            if found is not None:
                return self.call_value(found, node, args)
        held = o.fields.get(name)
        if held and kind != "dict" and any(self.is_callable_object(h) for h in held):
            return self.call_value(held, node, args)
        if emitted:
            return (self.const(None, node),)
        modelled = self.method_model(o, name, node, args, late=False)
        if modelled is not None:
            return modelled
        if kind == "dict":
            if name in ("get", "setdefault", "pop"):
                key = self._const_key(node.args[0]) if node.args else None
                if isinstance(key, str) and key in o.fields:
                    return o.fields[key]
                default = args.get(1, None)
                if key is None and node.args and o.fields:  # a key only known at run time: any item, or the default
                    return union(*o.fields.values(), default or ())
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
        modelled = self.method_model(o, name, node, args, late=True)
        if modelled is not None:
            return modelled
        return self.generic_call(o, name, node, args)

    # ------------------------------------------------------------------ builtins

    def call_builtin(self, name: str, node: ast.Call, args: Args) -> Value:
        modelled = self.call_builtin_model(name, node, args)
        if modelled is not None:
            return modelled
        if name in PASSTHROUGH_BUILTINS:
            parts = args.all()
            const = is_constant(parts)
            value = None
            if const and len(args.pos) == 1 and len(args.pos[0]) == 1 and name in ("int", "float"):
                try:
                    value = (int if name == "int" else float)(args.pos[0][0].value)
                except (TypeError, ValueError):
                    value = None
            kept = self.carried_props(parts if name in IDENTITY_BUILTINS else EMPTY)
            props = {**kept, "builtin": name, "call_args": args}
            return (self.new("value", node, tags=self.carried_tags(parts), const=const, value=value, props=props),)
        if name == "range":
            return (self.new("range", node, tags=self.depends_tags(args.all()), props={"args": args}),)
        if name == "enumerate":
            return (self.new("enumerate", node, props={"inner": args.get(0, "iterable") or EMPTY}),)
        if name == "zip":
            return (self.new("zip", node, props={"inner": list(args.pos)}),)
        if name == "iter":
            return args.get(0, None) or (self.unknown(node),)
        if name == "next":
            return self.element_of(args.get(0, None) or EMPTY, node)
        if name in ("list", "tuple", "sorted", "reversed", "set", "frozenset"):
            inner = args.get(0, None)
            if not inner:
                return (self.new("tuple", node, items=()),)
            if all(o.kind == "tuple" for o in inner):
                return inner
            return (
                self.new("tuple", node, tags=self.depends_tags(inner), props={"elem": self.element_of(inner, node)}),
            )
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
        if name in OPAQUE_BUILTINS:
            return (self.new("value", node, label=f"{name}()"),)
        return self.generic_call(None, name, node, args, qual=name)

    # ------------------------------------------------------------------ iteration

    def element_of(self, value: Value, node: ast.AST) -> Value:
        out: list[Obj] = []
        for o in value:
            kind = o.kind
            if kind == "tuple":
                if o.items is not None:
                    out.extend(union(*o.items))
                else:
                    out.extend(o.props.get("elem", EMPTY))
                continue
            modelled = self.element_model(o, node)
            if modelled is not None:
                out.extend(modelled)
            elif o.props.get("yields"):
                out.extend(o.props["yields"])
            elif kind == "enumerate":
                out.append(
                    self.new(
                        "tuple",
                        node,
                        items=((self.new("value", node),), self.element_of(o.props.get("inner", EMPTY), node)),
                    )
                )
            elif kind == "zip":
                out.append(
                    self.new("tuple", node, items=tuple(self.element_of(v, node) for v in o.props.get("inner", [])))
                )
            elif kind == "range":
                out.append(self.new("value", node, label="index", props={"range": True}))
            elif kind == "dict":
                out.append(self.unknown(node))
            else:
                out.append(self._derived(o, "[*]", node))
        return union(out) or (self.unknown(node),)


__all__ = ["CallsMixin", "Ctx"]
