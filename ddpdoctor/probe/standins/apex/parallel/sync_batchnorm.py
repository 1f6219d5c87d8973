"""`apex.parallel.SyncBatchNorm`: batch norm over the global batch of the ranks of its process group.

Kept: a `_BatchNorm` subclass with apex's constructor (`process_group`, `channel_last`, `fuse_relu`) and
`forward(input, z=None)` (z added before the fused ReLU); training-mode statistics over the union of the ranks'
batches, running variance updated with the unbiased global variance; eval mode (with running statistics) is plain
batch norm. The statistics are exact over uneven per-rank batches (`ddpdoctor.bn.syncbn`, what apex's CUDA kernel
computes with per-rank counts); apex's pure-Python fallback averaged per-rank means with equal weights.
"""

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ddpdoctor.bn.syncbn import sync_batch_norm_forward


class SyncBatchNorm(_BatchNorm):
    """Synchronized batch normalization across the processes of `process_group` (default: all)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, channel_last=False, fuse_relu=False):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _specify_process_group(self, process_group):
        self.process_group = process_group

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input, z=None):
        x = input
        if self.channel_last and x.dim() > 2:  # channels last: (N, ..., C) -> (N, C, ...)
            x = x.movedim(-1, 1)
        if self.running_mean is not None and self.running_mean.dtype != x.dtype:
            out = sync_batch_norm_forward(self, x.to(self.running_mean.dtype), self.process_group).to(x.dtype)
        else:
            out = sync_batch_norm_forward(self, x, self.process_group)
        if self.channel_last and out.dim() > 2:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        if self.fuse_relu:
            out = torch.relu(out)
        return out
