"""Run a callback right after a module finishes importing, without importing it ourselves.

The probe installs its torch patches when the *script* imports torch: processes that never use torch
(multiprocessing's resource tracker, data-preparation helpers) never pay for it, and the script's own
environment set-up before `import torch` still happens first.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Callable


class _AfterImport:
    """A one-shot meta-path finder: finds `name` with the remaining finders and wraps its loader's exec_module."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib protocol
        if fullname != self.name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module
        callback = self.callback

        def exec_module(module):  # noqa: ANN001
            original(module)
            try:
                del loader.exec_module  # back to the class's method for any later reload
            except AttributeError:
                pass
            callback()

        loader.exec_module = exec_module
        return spec


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """Call `callback()` once `name` has finished importing (now, if it already has)."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        callback()
        return
    sys.meta_path.insert(0, _AfterImport(name, callback))
