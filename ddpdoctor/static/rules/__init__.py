"""The static rules, one module per rule, named after it. `RULES` is the explicit list analysis runs.

Each module has `CODE` (its catalog code) and `check(script: ScriptModel) -> Iterator[Finding]`, and documents in
its docstring what it flags, what it deliberately leaves silent, and how it picks its confidence.
"""

from __future__ import annotations

from types import ModuleType

from ddpdoctor.static.rules import (
    dd101_sync_bn_after_ddp,
    dd102_forward_bypasses_ddp,
    dd104_hardcoded_rank,
    dd105_device_not_bound,
    dd106_data_parallel,
    dd107_moved_after_wrap,
    dd108_legacy_local_rank_arg,
    dd109_single_node_world_size,
    dd205_syncbn_needs_cuda,
    dd206_collective_on_subset,
    dd207_eval_in_train_mode,
    dd209_bn_type_check_misses_syncbn,
    dd216_bn_params_not_trained,
    dd301_sampler_not_reshuffled,
    dd302_missing_distributed_sampler,
    dd303_eval_sampler_padding,
    dd401_lr_not_scaled,
    dd402_no_warmup,
    dd403_accumulation_without_no_sync,
    dd404_grads_reduced_twice,
    dd501_module_prefix_checkpoint,
    dd502_save_on_every_rank,
    dd503_non_strict_load,
    dd504_unreduced_metric,
)

RULES: tuple[ModuleType, ...] = (
    dd101_sync_bn_after_ddp,
    dd102_forward_bypasses_ddp,
    dd104_hardcoded_rank,
    dd105_device_not_bound,
    dd106_data_parallel,
    dd107_moved_after_wrap,
    dd108_legacy_local_rank_arg,
    dd109_single_node_world_size,
    dd205_syncbn_needs_cuda,
    dd206_collective_on_subset,
    dd207_eval_in_train_mode,
    dd209_bn_type_check_misses_syncbn,
    dd216_bn_params_not_trained,
    dd301_sampler_not_reshuffled,
    dd302_missing_distributed_sampler,
    dd303_eval_sampler_padding,
    dd401_lr_not_scaled,
    dd402_no_warmup,
    dd403_accumulation_without_no_sync,
    dd404_grads_reduced_twice,
    dd501_module_prefix_checkpoint,
    dd502_save_on_every_rank,
    dd503_non_strict_load,
    dd504_unreduced_metric,
)
