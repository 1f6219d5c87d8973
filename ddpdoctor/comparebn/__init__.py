"""`ddpdoctor compare-bn`, the caller's side: launches the ranks (ddpdoctor.bn._worker) under the supervisor, shows
their phases, and turns what they measured into tables, a verdict and findings.

Modules:
- `compare`  (no torch at import) — `CompareConfig`, `run_compare`: validates, launches, supervises the ranks.
- `analysis` — `CompareResult`, `analyse`: per-layer errors, the non-i.i.d. test, findings (DD201-DD204), verdict.
- `progress` — the ranks' phases on stderr while they run.

A layer above the probe (its supervisor and progress display) and below the report, as `check` and `triage` are;
what runs inside the ranks (the exact SyncBN, the plan, the demo model, the worker) is ddpdoctor.bn, below the probe.
"""

from __future__ import annotations
