"""Batch-norm statistics and what runs inside compare-bn's ranks: a layer below the probe (the probe's CUDA
emulation and its apex/Horovod stand-ins run `syncbn`, the analyses read `stats`), importing nothing of ddpdoctor
but itself (tests/test_architecture.py). `compare-bn`'s caller side (launch, progress, analysis) is
ddpdoctor.comparebn, above the probe.

Modules:
- `syncbn`  (imports torch) — `sync_batch_norm_forward`, the one SyncBN implementation of the package: exact
  global-batch statistics (Chan's parallel formula over per-rank count/mean/M2), gradients through the reduction.
  Used by the probe's CPU emulation and by compare-bn.
- `stats`   (numpy + scipy only) — `noniid_test` (is each rank's data drawn from the same distribution?),
  `relative_error`, `combine_moments`, `replay_running_stats` (what SyncBN would have accumulated).
- `plan`    (pure Python) — which samples each rank sees at each step of a comparison.
- `_worker`, `demo` — one rank of compare-bn (`python -m ddpdoctor.bn._worker`), and its demo model and data.

This package's `__init__` deliberately imports nothing: analyses import `ddpdoctor.bn.stats` and must not pay
for (or depend on) torch.
"""

from __future__ import annotations
