"""ddpdoctor's stand-in for NVIDIA apex (see ddpdoctor.probe.standins): `apex.parallel` (DistributedDataParallel,
SyncBatchNorm, convert_syncbn_model, Reducer, LARC) and `apex.amp` (initialize, scale_loss), the parts of apex
that distributed training recipes import. What each keeps and where it differs: their docstrings and the README."""

import warnings

from ddpdoctor.probe.standins import _common

# The API mirrored is apex's last release with apex.parallel and apex.amp (22.x); the local label says it is not
# apex itself.
__version__ = "0.1+ddpdoctor.standin"

DIFFERENCES = [
    "apex.parallel.DistributedDataParallel averages gradients at the end of backward in one flat buffer per dtype "
    "(apex's delay_allreduce=True; with the default it overlaps buckets with backward: same values)",
    "apex.parallel.SyncBatchNorm uses exact global statistics over uneven batches (apex's CUDA kernel); apex's "
    "Python fallback averaged per-rank means with equal weights",
    "apex.amp keeps fp32 weights at every opt_level and computes the model's forward under autocast (float16 on "
    "GPUs; bfloat16 under the probe's CPU emulation); O2/O3's fp16 model copy and O3's fp16 weight updates are "
    "not reproduced; loss scaling is apex's (dynamic: 2**16, halved on overflow, doubled every 2000 steps)",
    "apex.optimizers, apex.fp16_utils, apex.contrib and apex.normalization are not provided",
]


def deprecated_warning(msg: str) -> None:
    """apex warned that its distributed parts were deprecated; so does the stand-in (once per message)."""
    warnings.warn(msg, FutureWarning, stacklevel=3)


_common.announce("apex", __name__, DIFFERENCES)

from . import amp, parallel  # noqa: E402  - apex's own __init__ imports both

__all__ = ["amp", "deprecated_warning", "parallel"]
