"""Batch-norm statistics: an exact SyncBatchNorm over any backend, the non-i.i.d. shard test, and `compare-bn`.

Modules:
- `syncbn`  (imports torch) — `sync_batch_norm_forward`, the one SyncBN implementation of the package: exact
  global-batch statistics (Chan's parallel formula over per-rank count/mean/M2), gradients through the reduction.
  Used by the probe's CPU emulation and by compare-bn.
- `stats`   (numpy + scipy only) — `noniid_test` (is each rank's data drawn from the same distribution?),
  `relative_error`, `combine_moments`, `replay_running_stats` (what SyncBN would have accumulated).
- `plan`    (pure Python) — which samples each rank sees at each step of a comparison.
- `compare` (no torch at import) — `CompareConfig`, `run_compare`, `render_compare`: launches the ranks and
  turns their measurements into tables, a verdict and findings.

This package's `__init__` deliberately imports nothing: analyses import `ddpdoctor.bn.stats` and must not pay
for (or depend on) torch.
"""

from __future__ import annotations
