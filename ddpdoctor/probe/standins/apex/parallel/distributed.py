"""`apex.parallel.DistributedDataParallel` and `Reducer` on torch.distributed.

Kept from apex (apex/parallel/distributed.py, last release with it):
- the constructor broadcasts the PARAMETERS of rank 0 to every rank, and nothing else: buffers (BatchNorm running
  statistics) are never broadcast, neither at construction nor in forward, so each rank keeps its own;
- during backward the gradients of every parameter that got one are summed across ranks and, with
  `gradient_average=True` (default), divided by the world size (`gradient_predivide_factor` splits the division
  before and after the sum); `disable_allreduce()` / `enable_allreduce()` turn that off and on (accumulation);
- the forward is the wrapped module's; the wrapper's `state_dict()` keys carry the `module.` prefix;
- the constructor's argument checks (shared_param, allreduce_trigger_params with delay_allreduce, ...) raise
  the same errors, and with the NCCL backend every parameter must be on a GPU.

Difference (also in the README): the reduction runs once at the end of backward, over all gradients in parameter
order, in one flat buffer per dtype — apex's `delay_allreduce=True`; by default apex overlaps buckets with the
backward pass. The values are the same.
"""

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.nn.modules import Module

from ddpdoctor.probe.standins import _common


def flatten(bucket):
    return torch._utils._flatten_dense_tensors(bucket)


def unflatten(coalesced, bucket):
    return torch._utils._unflatten_dense_tensors(coalesced, bucket)


def apply_flat_dist_call(bucket, call, extra_args=None):
    coalesced = flatten(bucket)
    if extra_args is not None:
        call(coalesced, *extra_args)
    else:
        call(coalesced)
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for buf, synced in zip(bucket, unflatten(coalesced, bucket), strict=True):
        buf.copy_(synced)


def split_by_type(tensors):
    buckets = OrderedDict()
    for tensor in tensors:
        buckets.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return buckets


def flat_dist_call(tensors, call, extra_args=None):
    with torch.no_grad():
        for bucket in split_by_type(tensors).values():
            apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor, tensor_list):
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
    else:
        try:
            for item in maybe_tensor:
                extract_tensors(item, tensor_list)
        except TypeError:
            return


class Reducer:
    """Averages gradients (or the tensors given) across processes when `reduce()` is called; built on a module it
    first broadcasts rank 0's parameters."""

    def __init__(self, module_or_grads_list):
        if isinstance(module_or_grads_list, Module):
            self.module = module_or_grads_list
            flat_dist_call([param.data for param in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            self.grads = []
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self):
        if self.module:
            grads = [param.grad.data for param in self.module.parameters() if param.grad is not None]
            flat_dist_call(grads, dist.all_reduce)
        else:
            flat_dist_call(self.grads, dist.all_reduce)


class DistributedDataParallel(Module):
    """apex's data-parallel wrapper (see the module docstring)."""

    def __init__(self, module, message_size=10000000, delay_allreduce=False, shared_param=None,
                 allreduce_trigger_params=None, retain_allreduce_buffers=False,
                 allreduce_always_fp32=False, num_allreduce_streams=1, allreduce_communicators=None,
                 gradient_average=True, gradient_predivide_factor=1.0, gradient_average_split_factor=None,
                 prof=False):
        super().__init__()
        from apex import deprecated_warning

        deprecated_warning("apex.parallel.DistributedDataParallel is deprecated and will be removed by the end of "
                           "February 2023.")
        site = _common.user_frame_site()
        self._backend = dist.get_backend()
        self.allreduce_different_streams = num_allreduce_streams > 1
        self.num_allreduce_streams = num_allreduce_streams
        self.allreduce_communicators = allreduce_communicators
        if self.allreduce_communicators:
            assert len(allreduce_communicators[0]) == num_allreduce_streams
            assert len(allreduce_communicators[0]) == len(allreduce_communicators[1])
            assert self.allreduce_different_streams
        if self.allreduce_different_streams and delay_allreduce:
            raise ValueError("self.allreduce_different_streams may only be used if delay_allreduce=False.")
        if shared_param is not None:
            raise ValueError("shared_param is no longer supported as an option.  It was misleadingly named from the "
                             "start.  It turns out overlapping communication with computation should work fine with "
                             "shared parameters.  If you still wish to delay communication to the end of the "
                             "backward pass, use delay_allreduce=True|False instead.")
        self.world_size = float(dist.get_world_size())
        self.retain_allreduce_buffers = retain_allreduce_buffers
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor
        self.custom_allreduce_triggers = False
        if allreduce_trigger_params is not None:
            if delay_allreduce:
                raise ValueError("Setting allreduce_trigger_params is only valid if delay_allreduce=False.")
            self.custom_allreduce_triggers = True
        self.delay_allreduce = delay_allreduce
        self.message_size = message_size
        self.prof = prof
        self.module = module
        self._disable_allreduce = False
        self._callback_queued = False
        if str(self._backend).lower() == "nccl":
            for param in self.module.parameters():
                assert _common.on_gpu(param), "NCCL backend only supports model parameters to be on GPU."
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready)
                       for p in self.module.parameters() if p.requires_grad]
        flat_dist_call([param.data for param in self.module.parameters()], dist.broadcast, (0,))
        _common.record_wrapper(self, site, {
            "wrapper": "apex.parallel.DistributedDataParallel",
            "module_class": type(module).__name__,
            "broadcast_buffers": False,
            "device_ids": None,
            "output_device": None,
            "find_unused_parameters": False,
            "static_graph": False,
            "mixed_precision": False,
            "delay_allreduce": bool(delay_allreduce),
            "gradient_average": bool(gradient_average),
            "gradient_predivide_factor": float(gradient_predivide_factor),
        })

    def enable_allreduce(self):
        self._disable_allreduce = False

    def disable_allreduce(self):
        self._disable_allreduce = True

    def _gradient_ready(self, param):
        if self._disable_allreduce or self._callback_queued:
            return
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._allreduce_gradients)

    def _allreduce_gradients(self):
        self._callback_queued = False
        grads = [param.grad.data for param in self.module.parameters() if param.grad is not None]
        with torch.no_grad():
            for bucket in split_by_type(grads).values():
                tensor = flatten(bucket)
                reduced = tensor.float() if self.allreduce_always_fp32 else tensor
                if self.gradient_predivide_factor != 1.0:
                    reduced.mul_(1.0 / self.gradient_predivide_factor)
                dist.all_reduce(reduced)
                if self.gradient_average:
                    reduced.mul_(self.gradient_predivide_factor / self.world_size)
                if reduced is not tensor:
                    tensor.copy_(reduced)
                for buf, synced in zip(bucket, unflatten(tensor, bucket), strict=True):
                    buf.copy_(synced)

    def forward(self, *inputs, **kwargs):
        with _common.wrapper_forward(self):
            return self.module(*inputs, **kwargs)
