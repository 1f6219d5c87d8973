"""Plain classes for the static path's own records, in place of dataclasses.

`@dataclass` writes each class's `__init__`, `__repr__` and `__eq__` as source text and compiles it when the module
is imported: about 3 M instructions per class, paid by every `check --static` run (a pre-commit hook's included)
for a dozen classes before anything is analysed. The records of the static analysis are written out instead:
each class has its own `__init__`, lists its fields in `__match_args__` (as a dataclass does), and takes its
`__repr__` (and, for those compared by value, `__eq__`) from the bases here, which format and compare exactly as the
generated methods did. `Finding`, the options and the report stay dataclasses (`dataclasses.replace` builds them).
"""

from __future__ import annotations

import reprlib
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


def fields_of(cls: type) -> tuple[str, ...]:
    """The fields of a record class, in order (what `dataclasses.fields` names for a dataclass)."""
    return cls.__match_args__
