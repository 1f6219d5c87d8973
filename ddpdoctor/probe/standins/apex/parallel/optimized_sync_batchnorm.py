"""`apex.parallel.optimized_sync_batchnorm`: the same SyncBatchNorm (see sync_batchnorm)."""

from .sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
