"""ddpdoctor: find out why a DDP / SyncBatchNorm run trains worse than it should.

The Python API (`ddpdoctor.api`): `ddpdoctor.check(script, args=..., nproc=..., static=...)`,
`ddpdoctor.triage(script, ...)`, `ddpdoctor.compare_bn(...)`, each returning the result object (the same data as
`--format json`, shown as Markdown in a notebook). They are loaded on first use: `import ddpdoctor` imports
nothing else (no torch, rich, scipy or numpy), which keeps the command line and the pre-commit hook fast.
"""

__version__ = "0.1.0"

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
