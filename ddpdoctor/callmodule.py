"""Modules that are also functions: `ddpdoctor.check` and `ddpdoctor.triage` name both a module (the command's
pipeline) and a function of the Python API. An attribute of a package is one object, which the import system sets
to the submodule the first time it is imported, so the module itself is made callable (the documented assignment of
`module.__class__`): `ddpdoctor.check("train.py")` and `from ddpdoctor.check import run_check` both work, whichever
was imported first. A leaf: it imports nothing of ddpdoctor."""

from __future__ import annotations

import sys
import types
from typing import Any, Callable


def callable_module(module_name: str, function: Callable[..., Any]) -> None:
    """Calling the module `module_name` calls `function` (its docstring is the call's)."""

    class CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

    CallableModule.__call__.__doc__ = function.__doc__
    sys.modules[module_name].__class__ = CallableModule
