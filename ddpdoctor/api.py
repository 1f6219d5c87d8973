"""The Python API: `ddpdoctor.check`, `ddpdoctor.triage`, `ddpdoctor.compare_bn`, for notebooks and CI scripts.

Each does what its command does, with the same options and the same `[tool.ddpdoctor]` defaults, and returns
the result object instead of printing it: a `ddpdoctor.report.Report` (check, triage) or a
`ddpdoctor.comparebn.analysis.CompareResult` (compare_bn). Both hold the same data as `--format json` (`.to_json()`,
or `result["findings"]`), and a notebook shows them as their Markdown report (`_repr_markdown_`)::

    import ddpdoctor
    report = ddpdoctor.check("train.py", args=["--epochs", "1"], nproc=2)
    report.findings            # tuple of ddpdoctor.findings.Finding, unranked; report.ranked() ranks them
    report.exit_code()         # 1 when a finding is at or above medium (fail_on=...), as the command exits
    report["summary"]          # the JSON document's fields

Bad input raises `ddpdoctor.errors.UsageError` (one line, the same message the command prints); nothing is
printed (the probe's progress display is off unless `quiet=False`). `import ddpdoctor` stays cheap: this module
is imported on first use of one of these names, and it imports torch, rich and scipy only where the command would.
`ddpdoctor.check` and `ddpdoctor.triage` are the modules of those commands, callable as these functions
(ddpdoctor.callmodule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpdoctor.check import check
from ddpdoctor.config import check_config
from ddpdoctor.triage import triage

if TYPE_CHECKING:
    from ddpdoctor.comparebn.analysis import CompareResult

__all__ = ["check", "check_config", "compare_bn", "triage"]


def compare_bn(model: str | None = None, data: str | None = None, *, nproc: int = 2, batch_size: int = 16,
               steps: int = 20, shard: str = "iid", seed: int = 0, device: str = "auto",
               timeout: float = 300.0, quiet: bool = True) -> "CompareResult":
    """`ddpdoctor compare-bn`: local BN vs SyncBN vs the exact global-batch BN, per layer, as a CompareResult
    (`.to_json()` is `--format json`'s document; `.layers`, `.findings`, `.verdict`). `model`/`data` are
    `MODULE:FACTORY` strings, None for the built-in demo; `quiet=False` shows the ranks' phases on stderr."""
    from ddpdoctor.config import DEVICES, choice
    from ddpdoctor.errors import UsageError, require_analysis_packages, require_torch

    for name, value in (("nproc", nproc), ("batch_size", batch_size), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name}: {value!r} is not a positive integer")
    require_torch("compare-bn")
    require_analysis_packages("compare-bn")
    from ddpdoctor.comparebn.compare import CompareConfig, run_compare

    return run_compare(CompareConfig(model=model, data=data, nproc=nproc, batch_size=batch_size, steps=steps,
                                     shard=shard, seed=seed, device=choice(device, DEVICES, "--device"),
                                     timeout=float(timeout)), quiet=quiet)

