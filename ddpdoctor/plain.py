"""Plain classes for records, in place of dataclasses, where a dataclass would cost every command its creation.

`@dataclass` writes each class's `__init__`, `__repr__`, `__eq__` (and, frozen, `__hash__`, `__setattr__`,
`__delattr__`) as source text and compiles it when the module is imported: 3 to 5 M instructions per class, paid by
every `check --static` run (a pre-commit hook's included) before anything is analysed. The records of the static
analysis, and the small frozen records the static path imports (a rule's `Setting`, `causes.Explains`,
`output.Target`, `static.project.Limits`, `static.apis.registry.Method`), are written out instead: each class has
its own `__init__`, lists its fields in `__match_args__` (as a dataclass does), and takes its `__repr__` (and, for
those compared by value, `__eq__`; frozen: `__hash__` and the refusal to change) from the bases here, which format,
compare, hash and refuse exactly as the generated methods did. `Finding`, the options and the report stay dataclasses
(`dataclasses.replace` builds them).

`LazyPattern` is the same idea for a regular expression that only some inputs reach: `re.compile` at import costs
0.3 to 1.5 M instructions a pattern on every run; a LazyPattern compiles on its first use.
"""
from __future__ import annotations

import re
import reprlib
from dataclasses import FrozenInstanceError
from typing import Any


class Record:
    """A dataclass's repr from `__match_args__`: `Name(field=value, ...)`, `...` for a record inside itself."""

    __slots__ = ()
    __match_args__: tuple[str, ...] = ()

    @reprlib.recursive_repr()
    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__match_args__)})"


class ValueRecord(Record):
    """A record equal to another of its exact class with equal fields, in order; unhashable (a dataclass with
    `eq=True` and not frozen)."""

    __slots__ = ()

    def __eq__(self, other: Any) -> Any:
        if other.__class__ is self.__class__:
            names = self.__match_args__
            return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class FrozenRecord(ValueRecord):
    """A frozen dataclass's behaviour (`@dataclass(frozen=True)`): equal as a `ValueRecord`, hashed by its fields in
    order, and read-only: `__init__` sets the fields with `object.__setattr__`, as the generated one does, and
    assigning or deleting an attribute afterwards raises `dataclasses.FrozenInstanceError`."""

    __slots__ = ()
    # the fields compared and hashed, in order (a dataclass field with `compare=False` is left out); None: all
    __compared__: tuple[str, ...] | None = None

    def __eq__(self, other: Any) -> Any:
        if other.__class__ is self.__class__:
            names = self.__compared__ if self.__compared__ is not None else self.__match_args__
            return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)
        return NotImplemented

    def __hash__(self) -> int:
        names = self.__compared__ if self.__compared__ is not None else self.__match_args__
        return hash(tuple(getattr(self, n) for n in names))

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")


def fields_of(cls: type) -> tuple[str, ...]:
    """The fields of a record class, in order (what `dataclasses.fields` names for a dataclass)."""
    return cls.__match_args__


class LazyPattern:
    """A regular expression compiled on its first `match`/`search`/`fullmatch` (for a module-level pattern that
    only some inputs reach); each answers exactly as the compiled `re.Pattern` does."""

    __slots__ = ("_compiled", "flags", "pattern")

    def __init__(self, pattern: str, flags: int = 0) -> None:
        self.pattern = pattern
        self.flags = flags
        self._compiled: re.Pattern[str] | None = None

    @property
    def compiled(self) -> re.Pattern[str]:
        if self._compiled is None:
            self._compiled = re.compile(self.pattern, self.flags)
        return self._compiled

    def match(self, string: str) -> re.Match[str] | None:
        return self.compiled.match(string)

    def search(self, string: str) -> re.Match[str] | None:
        return self.compiled.search(string)

    def fullmatch(self, string: str) -> re.Match[str] | None:
        return self.compiled.fullmatch(string)

    def __repr__(self) -> str:
        return f"LazyPattern({self.pattern!r}, {self.flags!r})"
