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

__all__ = ["ARM_NAMES", "FAVOURS", "VERDICTS"]

ARM_NAMES = ("A", "L", "P", "G")
VERDICTS = ("confirmed", "likely", "possible", "ruled_out", "both_arms", "not_measurable")
FAVOURS = ("syncbn", "plain", "subgroups", "fix_conversion", "none")
