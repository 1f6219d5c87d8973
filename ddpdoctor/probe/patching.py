"""Patches that can be undone: every replaced attribute is recorded with its original (pytest's monkeypatch idea).

Patch the attribute the user's code actually looks up — class attributes, so `from x import Y as Z` and
subclasses are covered — and undo everything in `finally`. The one patcher of the probe: the recorders
(`probe.patcher`) and the CUDA emulation each hold one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

_MISSING = object()
_CALL = object()


class Patcher:
    """Records (owner, name, original) for every patch; `undo()` restores them in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner.name = value`, remembering what was there (in the owner's own __dict__ for classes, so a
        restored subclass does not end up with a copy of its base class's attribute)."""
        if isinstance(owner, type):
            old = owner.__dict__.get(name, _MISSING)
        else:
            old = getattr(owner, name, _MISSING)
        self._undo.append((owner, name, old))
        setattr(owner, name, value)

    def wrap(
        self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> Callable[..., Any]:
        """Replace the function `owner.name` by `make(original)`; the wrapper looks like the original
        (functools.wraps) so introspection, pickling by qualified name and `inspect.signature` keep working."""
        original = owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name)
        if isinstance(original, (classmethod, staticmethod)):
            func = original.__func__
            wrapper = functools.wraps(func)(make(func))
            self.setattr(owner, name, type(original)(wrapper))
            return wrapper
        wrapper = functools.wraps(original)(make(original))
        self.setattr(owner, name, wrapper)
        return wrapper

    def setattr_everywhere(self, owners: list[Any], name: str, value: Any) -> None:
        """Set `name` on the first owner and on every other owner that holds the very same object (a function
        re-exported by several modules: `torch.load` and `torch.serialization.load`)."""
        original = getattr(owners[0], name, _MISSING)
        for i, owner in enumerate(owners):
            if i == 0 or (original is not _MISSING and getattr(owner, name, _MISSING) is original):
                self.setattr(owner, name, value)

    def setitem(self, container: Any, key: Any, value: Any) -> None:
        """Set `container[key] = value`, remembering the item that was there."""
        old = container[key]
        self.add_undo(lambda: container.__setitem__(key, old))
        container[key] = value

    def add_undo(self, fn: Callable[[], Any]) -> None:
        """Something else to undo (a hook handle's remove, emulation's undo), in the same reverse order."""
        self._undo.append((fn, "", _CALL))

    def undo(self) -> None:
        while self._undo:
            owner, name, old = self._undo.pop()
            try:
                if old is _CALL:
                    owner()
                elif old is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, old)
            except Exception:
                pass


def wrap_everywhere(
    probe_or_patcher: Any, owners: tuple[Any, ...], name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Wrap `name` on each owner (e.g. `torch.distributed` and `torch.distributed.distributed_c10d`, which hold
    the same function): one wrapper per distinct function found, so a layer patched on only one of them (the CUDA
    emulation) stays inside ours."""
    patcher = getattr(probe_or_patcher, "patcher", probe_or_patcher)
    made: dict[int, Callable[..., Any]] = {}
    for owner in owners:
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        wrapper = made.get(id(fn))
        if wrapper is None:
            wrapper = functools.wraps(fn)(make(fn))
            made[id(fn)] = wrapper
        patcher.setattr(owner, name, wrapper)
