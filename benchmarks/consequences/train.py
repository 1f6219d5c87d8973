"""The one training script every arm of the consequences benchmark runs: scikit-learn's digits, a small MLP with
BatchNorm, SGD with momentum and a cosine schedule, ported to DDP the way a user ports a single-GPU recipe.

Every defect is a flag of `Config`: the arm with the flag set runs the rule's bug class in its smallest faithful
form, its fixed twin differs by exactly that flag (see `benchmarks/consequences/run.py` for the pairs). With
`world=1` the same code is the single-process recipe (no process group, no DDP, no sampler).

SyncBatchNorm on CPU: torch's own refuses CPU tensors, so `enable_cpu_syncbn` installs what ddpdoctor's CUDA
emulation installs in the probe (`ddpdoctor.probe.emulation`): `nn.SyncBatchNorm.forward` runs
`ddpdoctor.bn.syncbn.sync_batch_norm_forward` (exact global-batch statistics over gloo, the backward all-reducing
like the CUDA kernel) and DDP's CPU refusal of SyncBatchNorm layers is skipped. Nothing else is patched.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, random_split

INSTALL_HINT = (
    "the consequences benchmark needs scikit-learn (its digits data set ships inside the package): "
    "pip install 'ddpdoctor[bench]'  (or: pip install scikit-learn==1.9.1)"
)


@dataclass(frozen=True)
class Config:
    """One arm. Defaults are the correct 2-rank port of the recipe (batch 64, lr 0.1) with per-rank BatchNorm."""

    world: int = 2  # ranks; 1 = the single-process recipe (no DDP)
    batch: int = 32  # per-rank (micro-)batch
    lr: float = 0.1
    epochs: int = 10
    warmup_epochs: float = 0.0  # linear warmup from the recipe's lr (lr / scale) to lr
    accum: int = 1  # micro-batches per optimizer step
    weight_decay: float = 5e-4
    # BatchNorm
    sync_bn: str = "none"  # none | before (convert, then wrap) | after (wrap, then convert: DD101)
    converter: str = "torch"  # torch | timm (keeps BatchNormAct) | clone (apex-style: new Parameters)
    clone_keeps_frozen: bool = True  # clone converter copies requires_grad and training (DD210's fix)
    fused_act: bool = False  # BN layers are a BatchNorm subclass applying ReLU in its forward (timm BatchNormAct)
    no_decay_exact_class: bool = False  # no-weight-decay set picked by isinstance(m, nn.BatchNorm2d) (DD209)
    optimizer_before_convert: bool = False  # optimizer built before the conversion (DD216)
    # fine-tuning a pretrained network with frozen BN (DD210)
    finetune: bool = False  # start from the seed's recipe weights, fresh head, BN frozen (eval, no grad)
    # the training loop
    bypass_ddp: bool = False  # the loop calls the inner module instead of the wrapper (DD102)
    no_sync: bool = True  # accumulation micro-steps under ddp.no_sync() (DD403: False)
    # data
    dist_sampler: bool = True  # DistributedSampler (DD302: False, every rank a shuffled DataLoader)
    set_epoch: bool = True  # sampler.set_epoch(epoch) (DD301: False)
    rank_seeds: bool = True  # torch.manual_seed(seed + rank) for augmentation/dropout (DD304: False)
    split_fixed: bool = True  # train/val split with a generator seeded by the seed only (DD305: False)
    # evaluation and checkpoint
    eval_mode: bool = True  # model.eval() before evaluating (DD207: False)
    ckpt_unwrapped: bool = True  # torch.save(ddp.module.state_dict()) (DD501: False, the wrapper's keys)
    load_strict: bool = True  # the evaluation program loads strictly (DD503: False)

    def key(self) -> str:
        """A stable short name: the fields that differ from the defaults."""
        base = Config()
        diff = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                if getattr(self, f.name) != getattr(base, f.name)]
        return ",".join(diff) or "port"

    @property
    def global_batch(self) -> int:
        return self.world * self.batch * self.accum

    def with_(self, **changes: Any) -> Config:
        return replace(self, **changes)


# ---------------------------------------------------------------------------------------------------- data

TEST_FRACTION = 0.3  # a fixed stratified hold-out: what every arm is scored on
VAL_FRACTION = 0.1  # the script's own validation split of the rest (per-epoch validation)


@lru_cache(maxsize=1)
def load_data() -> tuple[TensorDataset, TensorDataset]:
    """(pool, test): digits scaled to [0, 1] as 1x8x8 images; the test split is fixed (random_state 0)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:  # pragma: no cover - the driver checks first
        raise SystemExit(INSTALL_HINT) from exc
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    idx_pool, idx_test = train_test_split(
        list(range(len(y))), test_size=TEST_FRACTION, stratify=digits.target, random_state=0
    )
    return TensorDataset(x[idx_pool], y[idx_pool]), TensorDataset(x[idx_test], y[idx_test])


def augment(x: torch.Tensor) -> torch.Tensor:
    """Random shifts of up to one pixel, drawn from the training process's default generator (what a
    DataLoader with num_workers=0 draws augmentations from)."""
    n = x.size(0)
    padded = F.pad(x, (1, 1, 1, 1))
    dy = torch.randint(0, 3, (n, 1, 1)) + torch.arange(8).view(1, 8, 1)
    dx = torch.randint(0, 3, (n, 1, 1)) + torch.arange(8).view(1, 1, 8)
    return padded[torch.arange(n).view(n, 1, 1), 0, dy, dx].unsqueeze(1)


# ---------------------------------------------------------------------------------------------------- model


class BatchNormAct1d(nn.BatchNorm1d):
    """timm's BatchNormAct2d in miniature: a BatchNorm subclass whose forward applies its activation child."""

    def __init__(self, num_features: int, **kwargs: Any) -> None:
        super().__init__(num_features, **kwargs)
        self.act = nn.ReLU()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(input))


class SyncBatchNormAct(nn.SyncBatchNorm):
    """timm's SyncBatchNormAct: the synchronised layer keeps the activation."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(input))


class Net(nn.Module):
    """An MLP with BatchNorm over the 64 pixels: two hidden layers of 128, dropout before the classifier (a CNN
    costs a hundred times the arithmetic on 8x8 images and learns the same 97-98%)."""

    def __init__(self, fused_act: bool = False, dropout: float = 0.2, hidden: int = 128) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            linear = nn.Linear(cin, cout, bias=False)
            return [linear, BatchNormAct1d(cout)] if fused_act else [linear, nn.BatchNorm1d(cout), nn.ReLU()]

        self.features = nn.Sequential(nn.Flatten(), *block(64, hidden), *block(hidden, hidden))
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def train(self, mode: bool = True) -> Net:
        # detectron2/mmdet's norm_eval: a BN layer whose parameters are frozen stays in eval mode
        super().train(mode)
        for m in self.modules():
            if isinstance(m, _BatchNorm) and m.weight is not None and not m.weight.requires_grad:
                m.eval()
        return self


def freeze_bn(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.eval()
            m.weight.requires_grad_(False)
            m.bias.requires_grad_(False)


def convert(module: nn.Module, how: str, keeps_frozen: bool = True) -> nn.Module:
    """Replace BatchNorm layers by SyncBatchNorm: torch's converter, timm's (keeps BatchNormAct), or an apex-style
    clone (new Parameter objects; with `keeps_frozen` False it drops requires_grad and the training mode)."""
    if how == "torch":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, nn.SyncBatchNorm):
        if how == "timm":
            if isinstance(module, BatchNormAct1d):
                out = SyncBatchNormAct(module.num_features, module.eps, module.momentum)
                out.act = module.act
            else:
                out = nn.SyncBatchNorm(module.num_features, module.eps, module.momentum)
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        elif how == "clone":
            out = nn.SyncBatchNorm(module.num_features, module.eps, module.momentum)
            with torch.no_grad():
                out.weight.copy_(module.weight)
                out.bias.copy_(module.bias)
                out.running_mean.copy_(module.running_mean)
                out.running_var.copy_(module.running_var)
            if keeps_frozen:
                out.weight.requires_grad_(module.weight.requires_grad)
                out.bias.requires_grad_(module.bias.requires_grad)
                out.train(module.training)
        else:
            raise ValueError(how)
    for name, child in module.named_children():
        out.add_module(name, convert(child, how, keeps_frozen))
    return out


def enable_cpu_syncbn() -> None:
    """SyncBatchNorm on CPU ranks exactly as ddpdoctor's CUDA emulation runs it (see the module docstring)."""
    from ddpdoctor.bn.syncbn import sync_batch_norm_forward

    def forward(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
        return sync_batch_norm_forward(self, input, self.process_group)

    nn.SyncBatchNorm.forward = forward  # type: ignore[method-assign]
    DDP._passing_sync_batchnorm_handle = lambda self, module: None  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------------- training


def evaluate(model: nn.Module, data: TensorDataset, eval_mode: bool) -> float:
    """Accuracy in percent over `data`, batches of 100, under no_grad (model.eval() first unless DD207)."""
    if eval_mode:
        model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=100):
            correct += int((model(x).argmax(1) == y).sum())
    model.train()
    return 100.0 * correct / len(data)


def lr_factor(step: int, total: int, warmup: int, start: float) -> float:
    """Linear warmup from `start` x lr over `warmup` steps, then cosine to 0."""
    if step < warmup:
        return start + (1.0 - start) * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def train(cfg: Config, seed: int, rank: int = 0, pretrained: dict | None = None, save_to: str | None = None) -> float:
    """Train one arm on this rank (the process group of `cfg.world` ranks already initialised when world > 1);
    returns rank 0's test accuracy in percent (other ranks return their own)."""
    distributed = cfg.world > 1
    torch.manual_seed(seed + rank if cfg.rank_seeds else seed)
    pool, test = load_data()
    split_gen = torch.Generator().manual_seed(seed if cfg.split_fixed else seed * 1000 + 1 + rank)
    train_set, val_set = random_split(pool, [1.0 - VAL_FRACTION, VAL_FRACTION], generator=split_gen)

    model = Net(fused_act=cfg.fused_act)
    if cfg.finetune:
        assert pretrained is not None, "finetune needs the recipe's weights"
        model.load_state_dict(pretrained)
        model.head[1].reset_parameters()  # a fresh head on the pretrained backbone
        freeze_bn(model)

    def make_optimizer(net: nn.Module) -> torch.optim.Optimizer:
        bn_class = nn.BatchNorm1d if cfg.no_decay_exact_class else _BatchNorm
        no_decay = {id(p) for m in net.modules() if isinstance(m, bn_class) for p in m.parameters(recurse=False)}
        params = list(net.parameters())
        groups = [
            {"params": [p for p in params if id(p) not in no_decay], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
        ]
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9)

    if cfg.optimizer_before_convert:
        optimizer = make_optimizer(model)
    if cfg.sync_bn == "before":
        model = convert(model, cfg.converter, cfg.clone_keeps_frozen)
    if not cfg.optimizer_before_convert:
        optimizer = make_optimizer(model)
    wrapped: nn.Module = DDP(model) if distributed else model
    if cfg.sync_bn == "after":
        wrapped = convert(wrapped, cfg.converter, cfg.clone_keeps_frozen)
    inner = wrapped.module if distributed else wrapped
    forward = inner if cfg.bypass_ddp else wrapped

    if distributed and cfg.dist_sampler:
        sampler = DistributedSampler(train_set, num_replicas=cfg.world, rank=rank, shuffle=True, seed=seed)
        loader = DataLoader(train_set, batch_size=cfg.batch, sampler=sampler, drop_last=True)
    else:
        sampler = None
        loader = DataLoader(train_set, batch_size=cfg.batch, shuffle=True, drop_last=True)
    steps_per_epoch = len(loader) // cfg.accum
    total = steps_per_epoch * cfg.epochs
    warmup = int(cfg.warmup_epochs * steps_per_epoch)
    recipe_scale = cfg.global_batch / 64 if cfg.warmup_epochs else 1.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, warmup, min(1.0, 1.0 / recipe_scale))
    )

    wrapped.train()
    for epoch in range(cfg.epochs):
        if sampler is not None and cfg.set_epoch:
            sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i >= steps_per_epoch * cfg.accum:
                break
            x = augment(x)
            last = (i + 1) % cfg.accum == 0
            if distributed and not last and cfg.no_sync and not cfg.bypass_ddp:
                with wrapped.no_sync():
                    (F.cross_entropy(forward(x), y) / cfg.accum).backward()
            else:
                (F.cross_entropy(forward(x), y) / cfg.accum).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
        evaluate(forward, val_set, cfg.eval_mode)  # the script's per-epoch validation, on every rank

    if cfg.world > 1:
        dist.barrier()
    if save_to is not None:
        torch.save(inner.state_dict(), save_to)
    if cfg.sync_bn != "none":
        # SyncBN arms are scored as trained (a plain network would not compute what the converted one does: DD208)
        return evaluate(inner, test, cfg.eval_mode)
    # the evaluation program: the checkpoint the script saves, loaded into a plain network
    state = inner.state_dict() if cfg.ckpt_unwrapped or not distributed else wrapped.state_dict()  # "module.…"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    evaluated = Net(fused_act=cfg.fused_act)
    evaluated.load_state_dict(torch.load(buffer), strict=cfg.load_strict)
    return evaluate(evaluated, test, cfg.eval_mode)
