"""`hvd.SyncBatchNorm` (horovod/torch/sync_batch_norm.py): batch norm over the global batch of all ranks.

Kept from Horovod 0.28: a `_BatchNorm` subclass (not `torch.nn.SyncBatchNorm`, so `convert_sync_batchnorm` and
`isinstance(m, nn.SyncBatchNorm)` do not see it); training-mode forwards normalise with the mean and variance of
the union of the ranks' batches and update the running statistics with the unbiased global variance; eval mode
(with running statistics) is plain batch norm without communication; a job of one process is plain batch norm;
input must be on a GPU (on CPU the probe's CUDA emulation stands for one) and at least 2-D. Weight and bias
gradients stay local (the DistributedOptimizer averages them). The statistics are computed by
`ddpdoctor.bn.syncbn` (exact over uneven batches, like the kernels Horovod calls).
"""

import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ddpdoctor.bn.syncbn import _SyncBatchNormFunction
from ddpdoctor.probe.standins import _common

from .mpi_ops import size


class SyncBatchNorm(_BatchNorm):
    """Applies synchronous version of N-dimensional BatchNorm across all Horovod ranks."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _run_bn(self, input):
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training or not self.track_running_stats, self.momentum, self.eps)

    def _maybe_run_sync_bn(self, input):
        if size() == 1:
            return self._run_bn(input)
        momentum = self.momentum
        if momentum is None:  # cumulative moving average over the batches tracked so far
            momentum = 1.0 / float(self.num_batches_tracked) if self.num_batches_tracked else 0.0
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.running_mean, self.running_var,
                                            self.eps, momentum, None, size())

    def forward(self, input):
        if not _common.on_gpu(input):
            raise ValueError("SyncBatchNorm expected input tensor to be on GPU")
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked = self.num_batches_tracked + 1
        if not self.training and self.track_running_stats:
            return self._run_bn(input)
        return self._maybe_run_sync_bn(input)
