"""ddpdoctor: find out why a DDP / SyncBatchNorm run trains worse than it should.

The Python API (`ddpdoctor.api`): `ddpdoctor.check(script, args=..., nproc=..., static=...)`,
`ddpdoctor.triage(script, ...)`, `ddpdoctor.compare_bn(...)`, each returning the result object (the same data as
`--format json`, shown as Markdown in a notebook). They are loaded on first use: `import ddpdoctor` imports
nothing else (no torch, rich, scipy or numpy), which keeps the command line and the pre-commit hook fast.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"
# the first statement of the code ddpdoctor runs with `python -c` (the supervisor, the torch queries): `-c` puts
# the working directory ('') first on sys.path, and it is the user's, never a place for ddpdoctor to import from
WITHOUT_CWD = "import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "


def leave_the_working_directory_to_the_user() -> None:
    """`python -m ddpdoctor...` (the CLI, and every process of ddpdoctor's own: the launcher's agent, the ranks'
    bootstrap) puts the working directory first on sys.path: a project's `types.py` or `tokenize.py` there would be
    imported by ddpdoctor instead of the standard library's (and run inside it). This package is the first code
    of ours to run (runpy imports it to find the module, while sys.argv[0] is still "-m"): the entry goes before any
    other import. Where the package was imported earlier, by the probe's sitecustomize (before the interpreter
    added the entry), the sitecustomize calls this again when the module is looked up. The user's script still gets
    its own folder first on sys.path (probe.bootstrap)."""
    if _sys.argv[:1] != ["-m"] or getattr(_sys.flags, "safe_path", False):  # not run by -m, or run by -P
        return
    try:
        cwd = _os.getcwd()
    except OSError:
        return
    if _sys.path and _sys.path[0] in (cwd, ""):
        del _sys.path[0]


leave_the_working_directory_to_the_user()

__all__ = ["__version__", "check", "compare_bn", "triage"]

_SUBMODULES = ("check", "triage")  # modules of the same name, made callable (ddpdoctor.api.callable_module)


def __getattr__(name: str):
    """`ddpdoctor.check` / `ddpdoctor.triage` are the modules of those commands, callable as the API functions
    (importing them sets the attribute, so this runs only until then); `ddpdoctor.compare_bn` is the function."""
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"ddpdoctor.{name}")
    if name in ("compare_bn", "check_config"):
        return getattr(importlib.import_module("ddpdoctor.api"), name)
    raise AttributeError(f"module 'ddpdoctor' has no attribute {name!r}")
