"""SyncBatchNorm with exact global-batch statistics on any backend (gloo on CPU included).

PyTorch's own SyncBN cannot run on CPU: `aten::batch_norm_stats` has no CPU kernel and `nn.SyncBatchNorm.forward`
refuses CPU input once a process group exists. This module reproduces its semantics with plain tensor ops and
`torch.distributed` collectives, so the probe's CPU emulation and `ddpdoctor compare-bn` measure what SyncBN on
GPUs computes:

- every rank contributes (count, mean, M2) per channel over N x spatial, gathered with one `all_gather`, and the
  global mean/variance come from Chan's parallel formula. A naive sum / sum-of-squares loses all precision when
  the activations sit far from zero (measured: 18% variance error for inputs offset by 1000, Chan 4e-6);
- uneven per-rank batches and ranks with an empty batch are exact (an empty rank contributes a zero count but
  still joins every collective, or its peers would hang);
- `running_var` receives the unbiased variance with the *global* count, like the CUDA kernel;
- statistics are accumulated in float32 for half/bfloat16 inputs (the CUDA kernel's accumulate type) and the
  cross-rank combination is done in float64, so counts stay exact beyond 2**24 values per channel;
- the backward all-reduces (sum_dy, sum_dy_xmu) exactly like `torch.nn.modules._functions.SyncBatchNorm`:
  input gradients are those of batch norm over the concatenated global batch, weight/bias gradients stay local
  (DDP averages them).

Every rank issues the same collectives in the same order: one `all_gather` per training forward, one
`all_reduce` per backward that needs the input gradient, whatever its batch size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["sync_batch_norm_forward", "local_batch_norm_forward", "accumulate_dtype"]


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed in: float64 stays float64, everything else (float16, bfloat16, float32)
    accumulates in float32 like the CUDA batch-norm kernels."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce_dims(input: Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


def _channel_view(t: Tensor, input: Tensor) -> Tensor:
    return t.view(1, -1, *([1] * (input.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over the union of the ranks' batches; see the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        process_group: Any,
        world_size: int,
    ) -> Tensor:
        channels = input.size(1)
        acc = accumulate_dtype(input.dtype)
        local_count = input.numel() // channels
        x = input.to(acc)
        if local_count > 0:
            var, mean = torch.var_mean(x, dim=_reduce_dims(input), correction=0)
            local = torch.cat(
                [
                    torch.tensor([float(local_count)], dtype=torch.float64, device=input.device),
                    mean.to(torch.float64),
                    var.to(torch.float64) * local_count,
                ]
            )
        else:
            local = torch.zeros(1 + 2 * channels, dtype=torch.float64, device=input.device)

        # all_gather, not all_reduce: the per-rank counts differ, and Chan's formula needs each rank's mean.
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=process_group)
        stats = torch.stack(gathered)
        counts = stats[:, :1]
        means = stats[:, 1 : 1 + channels]
        m2s = stats[:, 1 + channels :]
        total = float(counts.sum().item())

        if total == 0:
            # Every rank is empty: nothing to normalise and nothing to learn, like plain BN on an empty batch.
            ctx.save_for_backward(input, weight, None, None)
            ctx.total = 0.0
            ctx.process_group = process_group
            ctx.empty_everywhere = True
            return torch.empty_like(input)
        if total <= 1:
            # Same decision on every rank (it depends only on gathered values), so no rank is left in a collective.
            raise ValueError(
                "Expected more than 1 value per channel when training, got a global input of "
                f"{int(total)} value per channel"
            )

        # Chan et al.: M2 = sum_r M2_r + sum_r n_r (mean_r - mean)^2. Empty ranks have n_r = 0 and drop out.
        global_mean = (counts * means).sum(0) / total
        global_m2 = m2s.sum(0) + (counts * (means - global_mean) ** 2).sum(0)
        global_var = global_m2 / total
        invstd = torch.rsqrt(global_var + eps)

        with torch.no_grad():
            if running_mean is not None:
                updated = running_mean.to(torch.float64) * (1.0 - momentum) + global_mean * momentum
                running_mean.copy_(updated.to(running_mean.dtype))
            if running_var is not None:
                unbiased = global_m2 / (total - 1.0)
                updated = running_var.to(torch.float64) * (1.0 - momentum) + unbiased * momentum
                running_var.copy_(updated.to(running_var.dtype))

        mean_acc = global_mean.to(acc)
        invstd_acc = invstd.to(acc)
        ctx.save_for_backward(input, weight, mean_acc, invstd_acc)
        ctx.total = total
        ctx.process_group = process_group
        ctx.empty_everywhere = False

        if local_count == 0:
            return torch.empty_like(input)
        out = (x - _channel_view(mean_acc, input)) * _channel_view(invstd_acc, input)
        if weight is not None:
            out = out * _channel_view(weight.to(acc), input)
        if bias is not None:
            out = out + _channel_view(bias.to(acc), input)
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor):  # type: ignore[override]
        input, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        channels = input.size(1)
        acc = accumulate_dtype(input.dtype)
        grad_input = grad_weight = grad_bias = None

        if ctx.empty_everywhere:
            if need_input:
                # Peers run the same all_reduce; keep the collective sequence identical on every rank.
                dist.all_reduce(
                    torch.zeros(2 * channels, dtype=torch.float64, device=input.device),
                    op=dist.ReduceOp.SUM,
                    group=ctx.process_group,
                )
                grad_input = torch.zeros_like(input)
            return grad_input, None, None, None, None, None, None, None, None

        dims = _reduce_dims(input)
        if input.numel() > 0:
            dy = grad_output.to(acc)
            xmu = input.to(acc) - _channel_view(mean, input)
            sum_dy = dy.sum(dims)
            sum_dy_xmu = (dy * xmu).sum(dims)
            if weight is not None and need_weight:
                grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
            if need_bias:
                grad_bias = sum_dy.to(weight.dtype if weight is not None else acc)
        else:
            dy = xmu = None
            sum_dy = torch.zeros(channels, dtype=acc, device=input.device)
            sum_dy_xmu = torch.zeros(channels, dtype=acc, device=input.device)
            if weight is not None and need_weight:
                grad_weight = torch.zeros_like(weight)
            if need_bias:
                grad_bias = torch.zeros(channels, dtype=weight.dtype if weight is not None else acc,
                                        device=input.device)

        if need_input:
            combined = torch.cat([sum_dy, sum_dy_xmu]).to(torch.float64)
            dist.all_reduce(combined, op=dist.ReduceOp.SUM, group=ctx.process_group)
            if input.numel() > 0:
                mean_dy = (combined[:channels] / ctx.total).to(acc)
                mean_dy_xmu = (combined[channels:] / ctx.total).to(acc)
                scale = invstd if weight is None else invstd * weight.to(acc)
                grad = (
                    dy
                    - _channel_view(mean_dy, input)
                    - xmu * _channel_view(invstd * invstd * mean_dy_xmu, input)
                ) * _channel_view(scale, input)
                grad_input = grad.to(input.dtype)
            else:
                grad_input = torch.zeros_like(input)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _resolve_group(module: _BatchNorm, process_group: Any) -> Any:
    if process_group is not None:
        return process_group
    own = getattr(module, "process_group", None)
    return own if own is not None else dist.group.WORLD


def sync_batch_norm_forward(
    module: _BatchNorm, input: Tensor, process_group: Any = None
) -> Tensor:
    """`nn.SyncBatchNorm.forward` for any `_BatchNorm` module, on any device and backend.

    Follows `torch.nn.SyncBatchNorm.forward` step by step (input checks, num_batches_tracked, momentum or the
    cumulative moving average, eval mode without communication, track_running_stats, affine or not). The group
    is `process_group`, else `module.process_group`, else WORLD; with no initialised process group or a group of
    one rank it is plain batch norm (`F.batch_norm`), exactly as PyTorch falls back.
    """
    module._check_input_dim(input)
    if input.dim() >= 2 and input.size(1) == 0:
        raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    if module.momentum is None:
        exponential_average_factor = 0.0
    else:
        exponential_average_factor = module.momentum
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        if module.momentum is None:
            exponential_average_factor = 1.0 / float(module.num_batches_tracked)
        else:
            exponential_average_factor = module.momentum

    if module.training:
        bn_training = True
    else:
        bn_training = module.running_mean is None and module.running_var is None
    running_mean = module.running_mean if not module.training or module.track_running_stats else None
    running_var = module.running_var if not module.training or module.track_running_stats else None

    need_sync = bn_training and module.training and dist.is_available() and dist.is_initialized()
    world_size = 1
    group = None
    if need_sync:
        group = _resolve_group(module, process_group)
        world_size = dist.get_world_size(group)
        need_sync = world_size > 1
    if not need_sync:
        return F.batch_norm(
            input,
            running_mean,
            running_var,
            module.weight,
            module.bias,
            bn_training,
            exponential_average_factor,
            module.eps,
        )
    return _SyncBatchNormFunction.apply(
        input,
        module.weight,
        module.bias,
        running_mean,
        running_var,
        module.eps,
        exponential_average_factor,
        group,
        world_size,
    )


def local_batch_norm_forward(module: _BatchNorm, input: Tensor) -> Tensor:
    """Plain per-rank batch norm for any `_BatchNorm` (an `nn.SyncBatchNorm` included): what each rank computes
    when nothing synchronises. `_BatchNorm.forward` never communicates, so it serves SyncBN modules too."""
    return _BatchNorm.forward(module, input)
