"""`apex.parallel` stand-in: DistributedDataParallel, Reducer, SyncBatchNorm, convert_syncbn_model,
create_syncbn_process_group, LARC (see the modules' docstrings for what is kept)."""

import torch
import torch.distributed

from ddpdoctor.probe.standins import _common

from .distributed import DistributedDataParallel, Reducer
from .LARC import LARC
from .sync_batchnorm import SyncBatchNorm

ReduceOp = torch.distributed.ReduceOp


def convert_syncbn_model(module, process_group=None, channel_last=False):
    """Replace every `_BatchNorm` (instance norms excepted) by apex's SyncBatchNorm, as apex did: the running
    statistics are shared with the old layer, but weight and bias are CLONED into new Parameters — an optimizer
    built before the conversion keeps updating the old ones, and the converted layers never learn."""
    from apex import deprecated_warning

    deprecated_warning("apex.parallel.convert_syncbn_model is deprecated and will be removed by the end of "
                       "February 2023. Use `torch.nn.SyncBatchNorm.convert_sync_batchnorm`.")
    site = _common.user_frame_site()
    converted = []
    result = _convert(module, process_group, channel_last, converted)
    _common.record_conversion(module, result, converted, site, converter="apex.parallel.convert_syncbn_model")
    return result


def _convert(module, process_group, channel_last, converted):
    mod = module
    if isinstance(module, torch.nn.modules.instancenorm._InstanceNorm):
        return module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        mod = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, channel_last=channel_last)
        mod.running_mean = module.running_mean
        mod.running_var = module.running_var
        mod.num_batches_tracked = module.num_batches_tracked
        if module.affine:
            mod.weight.data = module.weight.data.clone().detach()
            mod.bias.data = module.bias.data.clone().detach()
        converted.append((module, mod))
    for name, child in module.named_children():
        mod.add_module(name, _convert(child, process_group, channel_last, converted))
    del module
    return mod


def create_syncbn_process_group(group_size):
    """The process group of `group_size` consecutive ranks this rank belongs to (None for 0 = all ranks)."""
    if group_size == 0:
        return None
    world_size = torch.distributed.get_world_size()
    assert world_size >= group_size
    assert world_size % group_size == 0
    group = None
    for group_num in range(world_size // group_size):
        group_ids = range(group_num * group_size, (group_num + 1) * group_size)
        cur_group = torch.distributed.new_group(ranks=group_ids)
        if torch.distributed.get_rank() // group_size == group_num:
            group = cur_group
    assert group is not None
    return group


__all__ = [
    "LARC",
    "DistributedDataParallel",
    "ReduceOp",
    "Reducer",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
]
