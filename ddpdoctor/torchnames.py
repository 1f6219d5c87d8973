"""Canonical names of the PyTorch APIs ddpdoctor looks for, and the naming conventions scripts use for ranks.

One neutral module for the static analysis, the launch plan and the analyses (none of them imports another for
these names). Scripts reach one API through many spellings (`DDP`, `nn.parallel.DistributedDataParallel`,
`torch.nn.parallel.distributed.DistributedDataParallel`). The static interpreter resolves imports to a qualified
name and `canonical()` folds the spellings into one, so a model or a rule compares one string. Where a value's
origin is not visible in the file (a parameter of a function nobody calls, `args.local_rank`), the conventions
below say what the name usually holds; values known only through their name carry the `named` tag so rules can
lower their confidence.
"""

from __future__ import annotations

import re
from functools import lru_cache

from ddpdoctor.plain import LazyPattern

DDP = "torch.nn.parallel.DistributedDataParallel"
APEX_DDP = "apex.parallel.DistributedDataParallel"
DATA_PARALLEL = "torch.nn.parallel.DataParallel"
SYNC_BN = "torch.nn.SyncBatchNorm"
CONVERT_SYNC_BN = "torch.nn.SyncBatchNorm.convert_sync_batchnorm"
APEX_CONVERT_SYNC_BN = "apex.parallel.convert_syncbn_model"
APEX_SYNC_BN = "apex.parallel.SyncBatchNorm"
DISTRIBUTED_SAMPLER = "torch.utils.data.DistributedSampler"
DATA_LOADER = "torch.utils.data.DataLoader"
INIT_PROCESS_GROUP = "torch.distributed.init_process_group"
SPAWN = "torch.multiprocessing.spawn"
START_PROCESSES = "torch.multiprocessing.start_processes"
TORCH_SAVE = "torch.save"
TORCH_LOAD = "torch.load"
DEVICE_COUNT = "torch.cuda.device_count"
SET_DEVICE = "torch.cuda.set_device"
MP_PROCESS = "multiprocessing.Process"
MP_GET_CONTEXT = "multiprocessing.get_context"

# The variables every launcher sets (torchrun, torch.distributed.launch with --use-env, SLURM wrappers): a script
# that reads them supports being started by one.
LAUNCHER_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE"})
# The option torch.distributed.launch passed to each process (torchrun passes LOCAL_RANK instead).
LOCAL_RANK_OPTIONS = ("--local_rank", "--local-rank")



def _literal_prefix(pattern: str) -> str:
    """What every string an anchored pattern (`^...`) matches starts with: its characters up to the first one
    with a meaning in a regex (`\\.` is a dot; a character made optional by the quantifier after it is not
    part of it)."""
    out: list[str] = []
    i = 1
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and pattern[i + 1 : i + 2] == ".":
            out.append(".")
            i += 2
            continue
        if c in "*?{":
            out.pop()
            break
        if c in ".^$+[]()|\\":
            break
        out.append(c)
        i += 1
    return "".join(out)


@lru_cache(maxsize=None)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


# (literal prefix, pattern, replacement): a rewrite is compiled and tried only for the names that start with its
# prefix (compiling the twenty of them cost a static check more than all its rules' imports, and most scripts
# meet three or four)
_REWRITES: tuple[tuple[str, str, str], ...] = tuple(
    (_literal_prefix(p), p, r)
    for p, r in (
        (r"^torch\.distributed\.distributed_c10d\.", "torch.distributed."),
        (r"^torch\.nn\.parallel\.(distributed|data_parallel)\.", "torch.nn.parallel."),
        (r"^torch\.nn\.DataParallel\b", "torch.nn.parallel.DataParallel"),
        (r"^torch\.nn\.modules\.(?:[a-z_]+\.)?([A-Z]\w*)", r"torch.nn.\1"),
        (r"^torch\.utils\.data\.(distributed|dataloader|dataset|sampler)\.", "torch.utils.data."),
        (r"^torch\.multiprocessing\.spawn\.", "torch.multiprocessing."),
        (r"^torch\.autograd\.(?:grad_mode\.)?(no_grad|enable_grad|set_grad_enabled|inference_mode)\b", r"torch.\1"),
        (r"^torch\.optim\.(?!lr_scheduler\b)[a-z_]+\.([A-Z]\w*)$", r"torch.optim.\1"),
        (r"^torch\.optim\.lr_scheduler\.lr_scheduler\.", "torch.optim.lr_scheduler."),
        (r"^torch\.amp\.autocast_mode\.autocast$", "torch.autocast"),
        (r"^torch\.cuda\.amp\.autocast$", "torch.autocast"),
        (r"^torch\.amp\.autocast$", "torch.autocast"),
        (r"^apex\.parallel\.(?:distributed|optimized_sync_batchnorm|sync_batchnorm)\.", "apex.parallel."),
        (r"^torch\.distributed\.nn\.(?:functional\.)?", "torch.distributed."),
        (r"^horovod\.torch\.(?:mpi_ops|functions|optimizer|sync_batch_norm|compression)\.", "horovod.torch."),
        # Lightning's three spellings (`lightning.Trainer`, `lightning.pytorch.Trainer`, `pytorch_lightning.Trainer`)
        (r"^pytorch_lightning\.", "lightning.pytorch."),
        # `lightning.Fabric` is Fabric's (lightning/__init__ re-exports it), not Lightning's Trainer package's
        (r"^lightning_fabric\.(?:fabric\.)?Fabric$", "lightning.fabric.Fabric"),
        (r"^lightning\.fabric\.(?:fabric\.)?Fabric$", "lightning.fabric.Fabric"),
        (r"^lightning\.Fabric$", "lightning.fabric.Fabric"),
        (r"^lightning\.(?!pytorch\.|fabric\.|app\.)(\w+)", r"lightning.pytorch.\1"),
        (r"^lightning\.pytorch\.(?:trainer\.trainer|trainer|core\.module|core)\.([A-Z]\w*)$", r"lightning.pytorch.\1"),
        (r"^accelerate\.accelerator\.Accelerator$", "accelerate.Accelerator"),
        (r"^transformers\.(?:trainer|trainer_seq2seq)\.(\w*Trainer)$", r"transformers.\1"),
    )
)


@lru_cache(maxsize=4096)
def canonical(qualname: str) -> str:
    """One spelling per API: `torch.nn.parallel.distributed.DistributedDataParallel` →
    `torch.nn.parallel.DistributedDataParallel`."""
    for prefix, pattern, repl in _REWRITES:
        if qualname.startswith(prefix):
            qualname = _compiled(pattern).sub(repl, qualname)
    return qualname


COLLECTIVES = frozenset(
    {
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "_all_gather_base",
        "gather",
        "scatter",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast_object_list",
        "all_gather_object",
        "gather_object",
        "scatter_object_list",
        "all_reduce_coalesced",
        "all_gather_coalesced",
        "new_group",
    }
)
# point-to-point: legitimately rank-dependent, but a receive that no rank's send matches never returns
POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
# collectives that combine values across ranks (a metric reduced with one of these is global)
REDUCING_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "_all_gather_base",
        "gather",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_gather_object",
        "gather_object",
        "all_reduce_coalesced",
        "all_gather_coalesced",
    }
)

MODULE_MOVES = frozenset({"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "type", "to_empty", "xpu"})

ADAM_FAMILY = frozenset(
    {
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "SparseAdam",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "FusedAdam",
        "FusedLAMB",
        "LAMB",
        "Lamb",
        "Adafactor",
    }
)
# default lr of torch.optim constructors when the script passes none (SGD has none before torch 2.x: 1e-3 after)
DEFAULT_LR = {
    "SGD": 1e-3,
    "Adam": 1e-3,
    "AdamW": 1e-3,
    "Adamax": 2e-3,
    "NAdam": 2e-3,
    "RAdam": 1e-3,
    "Adagrad": 1e-2,
    "Adadelta": 1.0,
    "RMSprop": 1e-2,
    "ASGD": 1e-2,
    "Rprop": 1e-2,
    "LBFGS": 1.0,
}
# schedulers that can ramp the lr up from a small value
WARMUP_SCHEDULERS = frozenset({"LinearLR", "OneCycleLR", "ConstantLR"})

_TORCHVISION_WITHOUT_BN = LazyPattern(r"^(alexnet|squeezenet|vit_|swin_|convnext|vgg\d+$|maxvit)")


def torchvision_model_has_bn(name: str) -> bool:
    """Most torchvision classification models normalise with BatchNorm; the transformer/ConvNeXt/plain-VGG ones
    do not."""
    return not _TORCHVISION_WITHOUT_BN.match(name)


# ---- what names usually hold, when the value's origin is not visible ----

_LOCAL_RANK = re.compile(r"^(.*_)?local_?rank$|^(gpu|gpu_id|gpuid|local_process_index|local_rank_id)$")
_RANK = re.compile(
    r"^(rank|global_rank|ddp_rank|world_rank|process_rank|proc_rank|process_index|my_rank|dist_rank|"
    r"rank_id|rank_idx|global_process_index|worker_rank|cur_rank|current_rank)$"
)
_NOT_RANK = re.compile(r"node_rank|group_rank")
_WORLD = re.compile(
    r"(^|_)world_?size$|^(world|num_replicas|num_processes|nprocs|num_procs|n_procs|num_gpus|ngpus|n_gpus|"
    r"num_devices|n_devices|world_sz|ws)$|gpus_per_node|(global|total|effective|eff|world)_?batch(_?size)?$|"
    r"^batch_size_(total|global)$"
)
_MAIN_PREDICATE = re.compile(
    r"^(is_)?(local_)?(main|master|primary|leader|chief)(_?process|_proc|_rank|_worker|_node)?$|"
    r"^is_(global|world|local)_(zero|process_zero)$|^is_rank_?(0|zero)$|^rank_?(0|zero)$|^is_world_process_zero$|"
    r"^is_local_process_zero$|^is_global_zero$"
)
_RANK_ZERO_DECORATOR = re.compile(
    r"^(rank_?zero_only|rank_?0_only|master_only|main_process_only|on_main_process|main_only)$"
)
_ENV_LOCAL_RANK = re.compile(r"LOCAL_?RANK$|LOCALID$|LOCALRANKID$")
_ENV_WORLD = re.compile(r"WORLD_SIZE$|NTASKS$|^PMI_SIZE$|^OMPI_COMM_WORLD_SIZE$|^NPROCS$")
_ENV_RANK = re.compile(r"RANK$|PROCID$")


@lru_cache(maxsize=4096)
def name_tags(ident: str | None) -> frozenset[str]:
    """Tags that a variable/attribute name suggests (`local_rank` → local_rank), marked `named`."""
    if not ident:
        return frozenset()
    low = ident.lower()
    if _NOT_RANK.search(low):
        return frozenset()
    if _LOCAL_RANK.search(low):
        return frozenset({"local_rank", "named"})
    if _RANK.match(low):
        return frozenset({"rank", "named"})
    if _WORLD.search(low):
        return frozenset({"world_size", "named"})
    if _MAIN_PREDICATE.match(low):
        return frozenset({"rank_cond", "named"})
    return frozenset()


@lru_cache(maxsize=4096)
def is_main_predicate(ident: str | None) -> bool:
    """`is_main_process`, `is_master`, `master_process`…: true on the main rank only."""
    return bool(ident) and bool(_MAIN_PREDICATE.match(ident.lower()))


def main_predicate_scope(ident: str | None) -> str:
    """"local" for the per-node predicates (`is_local_main_process`, `is_local_process_zero`, `local_master`),
    "global" for the others: `is_local_main_process` is true on one process of every node."""
    return "local" if ident and "local" in ident.lower() else "global"


def is_rank_zero_decorator(ident: str | None) -> bool:
    return bool(ident) and bool(_RANK_ZERO_DECORATOR.match(ident.lower()))


def env_tags(var: str) -> frozenset[str]:
    """Tags of an environment variable the launchers set: LOCAL_RANK, RANK, WORLD_SIZE, SLURM_PROCID…"""
    up = var.upper()
    if up == "LOCAL_WORLD_SIZE":
        return frozenset({"world_size", "env"})
    if _ENV_LOCAL_RANK.search(up):
        return frozenset({"local_rank", "env"})
    if _ENV_WORLD.search(up):
        return frozenset({"world_size", "env"})
    if _ENV_RANK.search(up) and "NODE" not in up and "GROUP" not in up:
        return frozenset({"rank", "env"})
    return frozenset({"env"})


_LR_NAME = re.compile(r"(^|_)(lr|learning_rate)(_|$)|^blr$")
_LR_NOT = re.compile(r"sched|decay|min_lr|lr_min|final|end_lr|warmup_lr|lr_noise|step|ratio|factor")
_LOSS_NAME = re.compile(r"(^|_)loss(es)?(_|$)")


@lru_cache(maxsize=4096)
def is_lr_name(ident: str | None) -> bool:
    if not ident:
        return False
    low = ident.lower()
    return bool(_LR_NAME.search(low)) and not _LR_NOT.search(low)


@lru_cache(maxsize=4096)
def is_loss_name(ident: str | None) -> bool:
    return bool(ident) and bool(_LOSS_NAME.search(ident.lower()))


# Bare names used without an import in the file (star imports, exec'd preambles): what they most likely are.
UNIMPORTED_NAMES = {
    "DistributedDataParallel": DDP,
    "DDP": DDP,
    "DataParallel": DATA_PARALLEL,
    "SyncBatchNorm": SYNC_BN,
    "DistributedSampler": DISTRIBUTED_SAMPLER,
    "DataLoader": DATA_LOADER,
    "convert_sync_batchnorm": CONVERT_SYNC_BN,
    "convert_syncbn_model": APEX_CONVERT_SYNC_BN,
    "init_process_group": INIT_PROCESS_GROUP,
}
