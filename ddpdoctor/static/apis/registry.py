"""Where a library call finds its model: handlers keyed by canonical name, and by method name.

A call to an imported API is folded to its canonical name (`ddpdoctor.torchnames.canonical`) and looked up here:
first among the exact names, then among the patterns (families of names: every `torch.nn.<Module>`, every
`torch.optim.<Optimizer>`), in the order the API modules list them. A handler returns the call's Value, or None to
let the next candidate (finally the interpreter's generic call) have it.

Methods of objects the models made are keyed by method name (`set_epoch`, `step`, `add_argument`), optionally
restricted to receiver kinds. Each API module declares its own tables (`CALLS`, `PATTERNS`, `METHOD_EVENTS`,
`METHODS`, `LATE_METHODS`, `MODULE_METHODS`, `BUILTINS`); `ddpdoctor.static.apis` lists the modules once, in order.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import NamedTuple

from ddpdoctor.plain import FrozenRecord
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.support import Args
from ddpdoctor.static.semantic import Obj, Value


class Call(NamedTuple):
    """One call to an imported API: its canonical name, the name's last part, the call node, its arguments, and
    whether the name was guessed (a bare `DDP` never imported)."""

    qual: str
    last: str
    node: ast.Call
    args: Args
    heuristic: bool


CallHandler = Callable[[TorchState, Call], Value | None]
Pattern = Callable[[str, str], bool]
# (interpreter, receiver, method name, call node, arguments) -> Value or None
MethodHandler = Callable[[TorchState, Obj, str, ast.Call, Args], Value | None]
# (interpreter, receivers that are models, method name, call node, arguments) -> Value or None
GroupHandler = Callable[[TorchState, Value, str, ast.Call, Args], Value | None]
EventHandler = Callable[[TorchState, Obj, str, ast.Call, Args], bool]
BuiltinHandler = Callable[[TorchState, str, ast.Call, Args], Value | None]


class Method(FrozenRecord):
    """A method model: `kinds` restricts the receivers (None: any)."""

    __match_args__ = ("handler", "kinds")
    handler: MethodHandler
    kinds: frozenset[str] | None

    def __init__(self, handler: MethodHandler, kinds: frozenset[str] | None = None) -> None:
        object.__setattr__(self, "handler", handler)
        object.__setattr__(self, "kinds", kinds)


def method(handler: MethodHandler, *kinds: str) -> Method:
    return Method(handler, frozenset(kinds) if kinds else None)


class ApiModels:
    """The models of every API module, merged (see the module docstring)."""

    def __init__(self, modules: Iterable[ModuleType]) -> None:
        self.calls: dict[str, CallHandler] = {}
        self.patterns: list[tuple[Pattern, CallHandler]] = []
        self.method_events: dict[str, list[EventHandler]] = {}
        self.methods: dict[str, list[Method]] = {}
        self.late_methods: dict[str, list[Method]] = {}
        self.late_fallbacks: list[MethodHandler] = []
        self.module_methods: dict[str, GroupHandler] = {}
        self.builtins: dict[str, BuiltinHandler] = {}
        self._candidates: dict[str, tuple[CallHandler, ...]] = {}
        for module in modules:
            self._merge(self.calls, getattr(module, "CALLS", {}), module)
            self.patterns.extend(getattr(module, "PATTERNS", ()))
            for name, handler in getattr(module, "METHOD_EVENTS", {}).items():
                self.method_events.setdefault(name, []).append(handler)
            for table, own in ((self.methods, "METHODS"), (self.late_methods, "LATE_METHODS")):
                for name, m in getattr(module, own, {}).items():
                    table.setdefault(name, []).extend(m if isinstance(m, (list, tuple)) else [m])
            self.late_fallbacks.extend(getattr(module, "LATE_FALLBACKS", ()))
            self._merge(self.module_methods, getattr(module, "MODULE_METHODS", {}), module)
            self._merge(self.builtins, getattr(module, "BUILTINS", {}), module)

    @staticmethod
    def _merge(into: dict, table: dict, module: ModuleType) -> None:
        for name, handler in table.items():
            if name in into:
                raise ValueError(f"{module.__name__}: {name!r} is modelled twice")
            into[name] = handler

    def call(self, state: TorchState, call: Call) -> Value | None:
        for handler in self.candidates(call.qual, call.last):
            result = handler(state, call)
            if result is not None:
                return result
        return None

    def candidates(self, qual: str, last: str) -> tuple[CallHandler, ...]:
        """The handlers that may model a call to `qual`, in the order they are tried (computed once per name)."""
        found = self._candidates.get(qual)
        if found is None:
            exact = self.calls.get(qual)
            found = ((exact,) if exact is not None else ()) + tuple(h for m, h in self.patterns if m(qual, last))
            self._candidates[qual] = found
        return found

    def method(
        self, table: dict[str, list[Method]], state: TorchState, o: Obj, name: str, node: ast.Call, args: Args
    ) -> Value | None:
        for m in table.get(name, ()):
            if m.kinds is None or o.kind in m.kinds:
                result = m.handler(state, o, name, node, args)
                if result is not None:
                    return result
        return None
