"""Time the static analysis on a realistic ~2,000-line training script, and check it never imports torch.

The script is generated: several "experiments", each with its own model classes (with BatchNorm), a Dataset,
builder helpers, a Trainer class with train/evaluate/checkpoint methods, argparse options and a spawn- or
torchrun-style entry point — the shape of a research codebase squashed into one file, with a few of the bugs the
rules look for. Prints the best and median of N runs of `analyze_file` and the number of findings.

    python benchmarks/bench_static.py [--lines 2000] [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HEADER = '''"""Generated benchmark script: {sections} experiments in one file."""

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset


def is_main_process():
    return not dist.is_initialized() or dist.get_rank() == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def reduce_mean(value):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()

'''

_SECTION = '''

class Block{k}(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Net{k}(nn.Module):
    def __init__(self, num_classes=10, width={width}):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = Block{k}(width, width)
        self.layer2 = Block{k}(width, width * 2, stride=2)
        self.layer3 = Block{k}(width * 2, width * 4, stride=2)
        self.head = nn.Linear(width * 4, num_classes)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class Synthetic{k}(Dataset):
    def __init__(self, n, seed={k}):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def parse_args_{k}(argv=None):
    parser = argparse.ArgumentParser(description="experiment {k}")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--base-lr", type=float, default=0.1)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--out", default="")
    parser.add_argument("--sync-bn", action="store_true")
    return parser.parse_args(argv)


def build_model_{k}(args, device):
    model = Net{k}()
    if args.sync_bn and torch.cuda.is_available():
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model.to(device)


def build_loaders_{k}(args, world_size):
    train_set = Synthetic{k}(512)
    val_set = Synthetic{k}(128, seed=1000 + {k})
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=0)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, num_workers=0)
    return train_loader, val_loader, train_sampler


def build_optimizer_{k}(model, args, steps_per_epoch, world_size):
    lr = args.base_lr * args.batch_size * world_size / 256
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD(
        [{{"params": decay, "weight_decay": 5e-4}}, {{"params": no_decay, "weight_decay": 0.0}}], lr=lr, momentum=0.9
    )
    warmup = LinearLR(optimizer, start_factor=0.1, total_iters=args.warmup_epochs * steps_per_epoch)
    cosine = CosineAnnealingLR(optimizer, T_max=max(1, (args.epochs - args.warmup_epochs) * steps_per_epoch))
    scheduler = SequentialLR(optimizer, [warmup, cosine], milestones=[args.warmup_epochs * steps_per_epoch])
    return optimizer, scheduler


class AverageMeter{k}:
    def __init__(self):
        self.sum = 0.0
        self.count = 0

    def update(self, value, n=1):
        self.sum += value * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(1, self.count)

    def all_reduce(self):
        t = torch.tensor([self.sum, self.count], dtype=torch.float64)
        dist.all_reduce(t)
        self.sum, self.count = t.tolist()


class Trainer{k}:
    def __init__(self, args, rank, local_rank, world_size):
        self.args = args
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.model = build_model_{k}(args, self.device)
        self.model = DDP(self.model, device_ids=[local_rank] if torch.cuda.is_available() else None)
        self.train_loader, self.val_loader, self.train_sampler = build_loaders_{k}(args, world_size)
        self.optimizer, self.scheduler = build_optimizer_{k}(self.model, args, len(self.train_loader), world_size)
        self.criterion = nn.CrossEntropyLoss()
        self.best = 0.0

    def train_one_epoch(self, epoch):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        loss_meter = AverageMeter{k}()
        for step, (images, labels) in enumerate(self.train_loader):
            images, labels = images.to(self.device), labels.to(self.device)
            logits = self.model(images)
            loss = self.criterion(logits, labels) / self.args.accum_steps
            loss.backward()
            if (step + 1) % self.args.accum_steps == 0:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
            loss_meter.update(loss.item(), labels.size(0))
        return loss_meter.avg

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        correct = AverageMeter{k}()
        for images, labels in self.val_loader:
            images, labels = images.to(self.device), labels.to(self.device)
            pred = self.model(images).argmax(1)
            correct.update((pred == labels).float().mean().item(), labels.size(0))
        correct.all_reduce()
        return correct.avg

    def save(self, epoch, acc):
        if not self.args.out:
            return
        state = {{"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(), "epoch": epoch}}
        save_on_master(state, os.path.join(self.args.out, "exp{k}_last.pt"))
        if acc > self.best and is_main_process():
            self.best = acc
            torch.save(state, os.path.join(self.args.out, "exp{k}_best.pt"))

    def fit(self):
        for epoch in range(self.args.epochs):
            t0 = time.time()
            loss = self.train_one_epoch(epoch)
            acc = self.evaluate()
            self.save(epoch, acc)
            if self.rank == 0:
                print(f"exp{k} epoch {{epoch}} loss {{loss:.4f}} acc {{acc:.3f}} {{time.time() - t0:.1f}}s")


def main_{k}(argv=None):
    args = parse_args_{k}(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    trainer = Trainer{k}(args, dist.get_rank(), local_rank, dist.get_world_size())
    trainer.fit()
    dist.destroy_process_group()
'''

_BUGGY = '''

def buggy_worker_{k}(rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29600")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    net = Net{k}()
    model = DDP(net)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    data = Synthetic{k}(256)
    loader = DataLoader(data, batch_size=32, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for images, labels in loader:
            optimizer.zero_grad()
            F.cross_entropy(net(images), labels).backward()
            optimizer.step()
        torch.save(model.state_dict(), os.path.join("/tmp", "buggy{k}.pt"))


def buggy_main_{k}():
    world_size = torch.cuda.device_count() or 2
    mp.spawn(buggy_worker_{k}, args=(world_size,), nprocs=world_size)
'''


def generate(target_lines: int) -> str:
    parts = []
    k = 0
    lines = _HEADER.count("\n")
    while lines < target_lines:
        section = _SECTION.format(k=k, width=8 + 4 * (k % 4))
        if k % 3 == 2:
            section += _BUGGY.format(k=k)
        parts.append(section)
        lines += section.count("\n")
        k += 1
    entry = "\n\nif __name__ == \"__main__\":\n" + "".join(f"    main_{i}()\n" for i in range(k))
    return _HEADER.format(sections=k) + "".join(parts) + entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--keep", type=Path, default=None, help="also write the generated script here")
    args = parser.parse_args()

    source = generate(args.lines)
    if args.keep is not None:
        args.keep.write_text(source, encoding="utf-8")
    from ddpdoctor.static import analyze_file

    with tempfile.TemporaryDirectory(prefix="ddpdoctor-bench-") as tmp:
        path = Path(tmp) / "train_big.py"
        path.write_text(source, encoding="utf-8")
        times = []
        findings = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            findings = analyze_file(path)
            times.append(time.perf_counter() - t0)
    n_lines = source.count("\n") + 1
    imported = "torch" in sys.modules
    by_rule: dict[str, int] = {}
    for f in findings:
        by_rule[f.rule] = by_rule.get(f.rule, 0) + 1
    print(f"static analysis of a {n_lines}-line script ({len(source)} chars), {args.runs} runs")
    print(f"  best   {min(times) * 1000:8.1f} ms")
    print(f"  median {statistics.median(times) * 1000:8.1f} ms")
    print(f"  findings: {len(findings)} ({', '.join(f'{r}×{n}' for r, n in sorted(by_rule.items()))})")
    print(f"  torch imported: {imported}")
    return 1 if imported else 0


if __name__ == "__main__":
    sys.exit(main())
