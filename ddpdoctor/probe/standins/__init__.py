"""Stand-ins for the distributed packages old recipes import and a laptop cannot install: Horovod (`horovod.torch`)
and NVIDIA apex (`apex.parallel`, `apex.amp`).

Horovod builds against the installed framework and MPI/NCCL; apex's distributed parts were deprecated and then
removed, and the PyPI package named `apex` is an unrelated web toolkit. A script that imports either would end the
probe with one ModuleNotFoundError. Inside a probe run, when the real package cannot be imported, `import horovod`
/ `import apex` find ddpdoctor's stand-ins instead: the same public API, built on `torch.distributed` (gloo on
CPU, NCCL with the CUDA tensors of a GPU run), with the semantics of the originals where they matter for accuracy
(what is averaged, what is broadcast, what is copied, which misuse raises). Each stand-in says so in the run (a
`standin` event; the report adds a note), and the README lists where they differ from the originals.

A stand-in only replaces what the user's environment cannot import at all, and only for the user's own code:

- The real package always wins: asked for `horovod` or `apex`, the finder first asks every other finder and stands in
  only when none finds the package. An installed package that lacks what the script uses (NVIDIA apex after it
  removed `apex.parallel`, the unrelated PyPI `apex`) is the user's: the script's import or attribute access fails
  as it does on the user's machine, and the run reports that crash (DD902), not a run of ddpdoctor's stand-in.
- The import must come from the script or its project modules: a library's optional `try: import apex` (in
  site-packages) gets the ModuleNotFoundError the user's environment gives it, so a run never differs from the
  user's for a package the script itself does not use.

Layout: `horovod/` and `apex/` here mirror the originals' module paths (`horovod.torch.mpi_ops`,
`apex.parallel.LARC`, ...), so `from horovod.torch.mpi_ops import Sum` works. They are loaded under the
original names, never as `ddpdoctor.probe.standins.horovod`; their frames are ddpdoctor's, so recorded call sites
and tracebacks point at the user's lines.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

# top-level import name → what the stand-in provides, in the user's words
STANDINS = {
    "horovod": "Horovod's PyTorch API (horovod.torch)",
    "apex": "NVIDIA apex (apex.parallel, apex.amp)",
}

_WHY: dict[str, str] = {}  # top-level name → why the stand-in is used (read by the stand-in's announcement)


def _real_spec(name: str) -> Any:
    """The spec the remaining finders would give `name` (None when it is not installed)."""
    for finder in sys.meta_path:
        if isinstance(finder, StandinFinder):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, None)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            return spec
    return None


_IMPORT_MACHINERY = ("<frozen importlib", os.path.dirname(importlib.util.__file__) + os.sep)


def _imported_by_user_code() -> bool:
    """Does the import being resolved come from the script or its project modules? The first frame outside the
    import machinery (importlib, `importlib.import_module`) and ddpdoctor decides: a library's frame (site-packages,
    the standard library) is not the user's."""
    from ddpdoctor.probe.session import is_probe_file, is_user_file

    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_IMPORT_MACHINERY) or is_probe_file(name)):
            return is_user_file(name)
        f = f.f_back
    return False


def why_standing_in(name: str) -> str:
    return _WHY.get(name, "not installed")


class StandinFinder:
    """Finds the stand-in packages when the real ones are not importable (see the module docstring)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in STANDINS:
            return None
        if _real_spec(fullname) is not None or not _imported_by_user_code():
            return None
        _WHY.setdefault(fullname, "not installed")
        package_dir = os.path.join(HERE, fullname)
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir]
        )


def install_finder() -> StandinFinder:
    """Put the stand-in finder on sys.meta_path (once). It defers to the other finders for every name it serves,
    so its position only decides who answers first."""
    for finder in sys.meta_path:
        if isinstance(finder, StandinFinder):
            return finder
    finder = StandinFinder()
    sys.meta_path.insert(0, finder)
    return finder


def remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, StandinFinder)]
