"""ddpdoctor: find out why a DDP / SyncBatchNorm run trains worse than it should."""

__version__ = "0.1.0"
