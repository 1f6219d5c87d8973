"""`ddpdoctor triage`: "my DDP+SyncBN run scores lower than plain DDP — why?", answered on the user's own script.

    triage.run.run_triage (I/O)          arms A, L, P (G) ──► probe runs (ddpdoctor.probe.launcher, arms.py)
                                                              └─► analyses per arm (ddpdoctor.analyses)
    triage.verdicts.triage (pure)        arms' events + findings ──► ranked causes, headline, pairing
      checks.py (CONFIRMED), measures.py (LIKELY / POSSIBLE / RULED OUT), model.py (Arm, Cause, TriageResult);
      a cause explained by another is folded through ddpdoctor.causes, the relation `check` folds findings with
    report                               check report of the as-written arm + the `triage` object

Nothing in verdicts/checks/measures/model imports torch; a triage directory (`--keep-run`) holds one run directory per
arm and is re-analysed by `ddpdoctor report DIR` like a check run.
"""

from __future__ import annotations

from os import PathLike
from typing import TYPE_CHECKING, Any, Sequence

from ddpdoctor.callmodule import callable_module

if TYPE_CHECKING:
    from ddpdoctor.report import Report

__all__ = ["ARM_NAMES", "FAVOURS", "VERDICTS", "triage"]

ARM_NAMES = ("A", "L", "P", "G")
VERDICTS = ("confirmed", "likely", "possible", "ruled_out", "both_arms", "not_measurable")
FAVOURS = ("syncbn", "plain", "subgroups", "fix_conversion", "none")




def triage(script: str | PathLike, args: Sequence[str] = (), *, arms: str | Sequence[str] | None = None,
           group_size: int | None = None, seed: int = 0, nproc: int | None = None, epochs: int | None = None,
           steps: int | None = None, **options: Any) -> Report:
    """`ddpdoctor triage SCRIPT -- ARGS` as a function (`ddpdoctor.triage(...)`): the paired arms and the ranked
    causes, returning the Report (`report.triage` is the JSON `triage` object). `options` as for
    `ddpdoctor.check` (timeout per arm, device, base_lr, select, keep_run, quiet ...); bad input raises
    UsageError."""
    from ddpdoctor.config import check_config
    from ddpdoctor.errors import UsageError, require_analysis_packages

    require_analysis_packages("triage")
    from ddpdoctor.triage.run import DEFAULT_EPOCHS, DEFAULT_STEPS, TriageConfig, parse_arms, run_triage

    options.setdefault("quiet", True)
    cfg, _ = check_config(script, args, nproc=nproc, epochs=epochs or DEFAULT_EPOCHS, steps=steps or DEFAULT_STEPS,
                          **options)
    if group_size is not None and (group_size < 2 or cfg.nproc % group_size or group_size >= cfg.nproc):
        raise UsageError(f"--group-size {group_size}: needs 2 <= G < --nproc ({cfg.nproc}) with --nproc a multiple "
                         "of G (SyncBN over subgroups smaller than the world)")
    spec = ",".join(arms) if arms is not None and not isinstance(arms, str) else arms
    return run_triage(TriageConfig(check=cfg, arms=parse_arms(spec, group_size), group_size=group_size, seed=seed))


# `ddpdoctor.triage(script, ...)` is the function above although this package has its name (ddpdoctor.callmodule)
callable_module(__name__, triage)
