"""Static analysis speed: one large script and a many-file project, each timed as the user runs it.

Two generated inputs, each in the shape of a research codebase with a few of the bugs the rules look for:

- a single ~4,000-line script: several "experiments", each with its own model classes (with BatchNorm), a Dataset,
  builder helpers, a Trainer class with train/evaluate/checkpoint methods, argparse options and a spawn- or
  torchrun-style entry point, squashed into one file (target: <= 0.3 s wall);
- a project of 25 files / ~10,000 lines: the same experiments spread over modules that import a shared `common`
  module, and an entry script that imports them all (target: <= 1.0 s wall).

Each is timed as a fresh `ddpdoctor check --static` process (interpreter start, imports, analysis, report),
best and median of N runs, beside the floor: a bare interpreter that only reads and `ast.parse`s the same files.
The processes run with compiled bytecode (a temporary PYTHONPYCACHEPREFIX, warmed once), as an installed package
runs: with PYTHONDONTWRITEBYTECODE set, every run would recompile ddpdoctor's own modules first. The benchmark also
checks, in this process, that static analysis never imports torch.

    python benchmarks/bench_static.py [--lines 4000] [--files 25] [--project-lines 10000] [--runs 11]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
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

_SECTION = """

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
"""

_BUGGY = """

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
"""


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
    entry = '\n\nif __name__ == "__main__":\n' + "".join(f"    main_{i}()\n" for i in range(k))
    return _HEADER.format(sections=k) + "".join(parts) + entry


# ---- other shapes of a 4,000-line script (issue 23: a new user's script is not shaped like the one above) ----

_SHAPE_HEADER = _HEADER.format(sections=0)


def generate_small_functions(target_lines: int) -> str:
    """Many small helpers (a utils-heavy script): 6-line functions calling one another, a DDP entry that calls
    them all."""
    parts, k, lines = [], 0, _SHAPE_HEADER.count("\n")
    while lines < target_lines:
        prev = f"helper_{k - 1}(x)" if k else "x"
        part = (f"\n\ndef helper_{k}(x, scale={k % 7 + 1}):\n    y = {prev}\n    if scale > 3:\n"
                f"        y = y * scale\n    return F.relu(y) + {k}\n")
        parts.append(part)
        lines += part.count("\n")
        k += 1
    entry = (
        "\n\ndef main():\n    dist.init_process_group('nccl')\n    rank = dist.get_rank()\n"
        "    model = DDP(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).cuda(), device_ids=[rank])\n"
        "    x = torch.randn(4, 3, 8, 8).cuda()\n"
        + "".join(f"    x = helper_{i}(x)\n" for i in range(0, k, max(1, k // 50)))
        + "    model(x).sum().backward()\n    torch.save(model.state_dict(), 'ckpt.pt')\n\n\n"
        'if __name__ == "__main__":\n    main()\n'
    )
    return _SHAPE_HEADER + "".join(parts) + entry


def generate_straight_line(target_lines: int) -> str:
    """Long straight-line code (a notebook exported as a script): one top-level statement after another."""
    body = [
        "dist.init_process_group('nccl')", "rank = dist.get_rank()", "torch.cuda.set_device(rank)",
        "model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU()).cuda()",
        "model = DDP(model, device_ids=[rank])", "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        "data = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 10, (64,)))",
        "loader = DataLoader(data, batch_size=8, shuffle=True)",
    ]
    lines, k = _SHAPE_HEADER.count("\n") + len(body), 0
    while lines < target_lines:
        body += [f"lr_{k} = 0.1 * ({k} % 5 + 1)", "for g in opt.param_groups:", f"    g['lr'] = lr_{k}",
                 f"x_{k}, y_{k} = data[{k} % 64]", f"out_{k} = model(x_{k}.unsqueeze(0).cuda())",
                 f"loss_{k} = F.cross_entropy(out_{k}, y_{k}.view(1).cuda())", f"loss_{k}.backward()",
                 "opt.step()", "opt.zero_grad()", f"print('step', {k}, loss_{k}.item())"]
        lines += 10
        k += 1
    body.append("torch.save(model.state_dict(), 'ckpt.pt')")
    return _SHAPE_HEADER + "\n" + "\n".join(body) + "\n"


def generate_class_hierarchy(target_lines: int) -> str:
    """Deep class hierarchies (a framework-style model zoo): chains of nn.Module subclasses, each overriding
    __init__ and forward through super(), ten levels deep, every chain's leaf built and wrapped."""
    parts, lines, chains = [], _SHAPE_HEADER.count("\n"), 0
    while lines < target_lines:
        c = chains
        part = (f"\n\nclass Base{c}_0(nn.Module):\n    def __init__(self, width=8):\n        super().__init__()\n"
                f"        self.conv = nn.Conv2d(3, width, 3, padding=1)\n        self.bn = nn.BatchNorm2d(width)\n\n"
                f"    def forward(self, x):\n        return F.relu(self.bn(self.conv(x)))\n")
        for d in range(1, 10):
            part += (f"\n\nclass Base{c}_{d}(Base{c}_{d - 1}):\n    def __init__(self, width=8):\n"
                     f"        super().__init__(width)\n        self.extra{d} = nn.BatchNorm2d(width)\n\n"
                     f"    def forward(self, x):\n        x = super().forward(x)\n"
                     f"        return self.extra{d}(x) + x\n")
        parts.append(part)
        lines += part.count("\n")
        chains += 1
    entry = (
        "\n\ndef main():\n    dist.init_process_group('nccl')\n    rank = dist.get_rank()\n"
        + "".join(f"    m{c} = DDP(Base{c}_9().cuda(), device_ids=[rank])\n"
                  f"    m{c}(torch.randn(2, 3, 8, 8).cuda()).sum().backward()\n" for c in range(chains))
        + "\n\nif __name__ == \"__main__\":\n    main()\n"
    )
    return _SHAPE_HEADER + "".join(parts) + entry


SHAPES = {
    "many small functions": generate_small_functions,
    "long straight-line code": generate_straight_line,
    "deep class hierarchies": generate_class_hierarchy,
}


_COMMON_IMPORTS = """import argparse
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

from common import is_main_process, reduce_mean, save_on_master
"""


def generate_project(target_lines: int, files: int) -> dict[str, str]:
    """{file name: source}: `common.py` (the shared helpers), `files - 2` experiment modules, and `main.py`, about
    `target_lines` lines in all."""
    header = _HEADER.format(sections=0)
    common = header[header.index("import argparse") :]
    modules = files - 2
    file_header = '"""Experiments of module {f}."""\n\n' + _COMMON_IMPORTS
    lines = common.count("\n") + modules * file_header.count("\n")
    sections: list[str] = []
    while lines < target_lines or len(sections) < modules:
        k = len(sections)
        section = _SECTION.format(k=k, width=8 + 4 * (k % 4))
        if k % 3 == 2:
            section += _BUGGY.format(k=k)
        sections.append(section)
        lines += section.count("\n") + 2  # and its import and call in main.py
    out = {"common.py": common}
    for f in range(modules):
        mine = range(f, len(sections), modules)
        out[f"exp{f}.py"] = file_header.format(f=f) + "".join(sections[k] for k in mine)
    imports = "".join(f"from exp{k % modules} import main_{k}\n" for k in range(len(sections)))
    calls = "".join(f"    main_{k}()\n" for k in range(len(sections)))
    out["main.py"] = (
        '"""Entry script: runs every experiment."""\n\n' + imports + '\n\nif __name__ == "__main__":\n' + calls
    )
    return out


def _env(pycache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


def _time(cmd: list[str], runs: int, env: dict[str, str], cwd: Path) -> tuple[float, float, float]:
    """(best wall, median wall, median CPU) of `runs` runs of a command, after one warm-up run."""
    subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, check=False)
    walls, cpus = [], []
    for _ in range(runs):
        before = os.times()
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, check=False)
        walls.append(time.perf_counter() - t0)
        after = os.times()
        cpus.append(after.children_user - before.children_user + after.children_system - before.children_system)
    return min(walls), statistics.median(walls), statistics.median(cpus)


def _parse_floor(files: list[Path]) -> list[str]:
    names = ", ".join(repr(str(f)) for f in files)
    return [sys.executable, "-c", f"import ast\nfor p in [{names}]:\n    ast.parse(open(p, encoding='utf-8').read())"]


def _check(paths: list[Path], cwd: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ddpdoctor",
        "check",
        "--static",
        *map(str, paths),
        "--format",
        "json",
        "--fail-on",
        "critical",
    ]


def _report(label: str, target: float, floor: tuple[float, float, float], run: tuple[float, float, float]) -> bool:
    ok = run[0] <= target
    print(f"{label}")
    print(
        f"  ddpdoctor check --static  best {run[0]:6.3f} s  median {run[1]:6.3f} s  (CPU {run[2]:6.3f} s)  "
        f"target <= {target:.1f} s: {'met' if ok else 'NOT met'}"
    )
    print(f"  floor: python + ast.parse best {floor[0]:6.3f} s  median {floor[1]:6.3f} s  (CPU {floor[2]:6.3f} s)")
    print(f"  over the floor: best +{run[0] - floor[0]:6.3f} s ({run[0] / floor[0]:4.1f}x)  "
          f"room under the target: {target - run[0]:+6.3f} s")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=4000, help="lines of the single script")
    parser.add_argument("--files", type=int, default=25, help="files of the project")
    parser.add_argument("--project-lines", type=int, default=10000, help="lines of the project, all files together")
    parser.add_argument("--runs", type=int, default=11, help="runs per timing (the target: best of 11)")
    parser.add_argument("--keep", type=Path, default=None, help="also write the generated inputs under this directory")
    args = parser.parse_args()

    print("load average at start: {:.2f} {:.2f} {:.2f} (wall times are only comparable on a quiet machine)".format(
        *os.getloadavg()))
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-bench-") as tmp:
        root = Path(tmp)
        pycache = root / "pycache"
        env = _env(pycache)
        script = root / "single" / "train_big.py"
        script.parent.mkdir()
        script.write_text(generate(args.lines), encoding="utf-8")
        project = root / "project"
        project.mkdir()
        for name, text in generate_project(args.project_lines, args.files).items():
            (project / name).write_text(text, encoding="utf-8")
        if args.keep is not None:
            shutil.copytree(root / "single", args.keep / "single", dirs_exist_ok=True)
            shutil.copytree(project, args.keep / "project", dirs_exist_ok=True)
        project_files = sorted(project.glob("*.py"))
        n_script = script.read_text(encoding="utf-8").count("\n") + 1
        n_project = sum(p.read_text(encoding="utf-8").count("\n") + 1 for p in project_files)

        ok = _report(
            f"a single script of {n_script} lines, {args.runs} runs",
            0.3,
            _time(_parse_floor([script]), args.runs, env, root),
            _time(_check([script], root), args.runs, env, root),
        )
        ok = (
            _report(
                f"a project of {len(project_files)} files / {n_project} lines (check --static DIR), {args.runs} runs",
                1.0,
                _time(_parse_floor(project_files), args.runs, env, root),
                _time(_check([project], root), args.runs, env, root),
            )
            and ok
        )

        for shape, make in SHAPES.items():
            path = root / "shapes" / (shape.replace(" ", "_").replace("-", "_") + ".py")
            path.parent.mkdir(exist_ok=True)
            path.write_text(make(args.lines), encoding="utf-8")
            if args.keep is not None:
                (args.keep / "shapes").mkdir(parents=True, exist_ok=True)
                shutil.copy(path, args.keep / "shapes" / path.name)
            n = path.read_text(encoding="utf-8").count("\n") + 1
            ok = (
                _report(f"a script of {n} lines, {shape}, {args.runs} runs", 0.3,
                        _time(_parse_floor([path]), args.runs, env, root),
                        _time(_check([path], root), args.runs, env, root))
                and ok
            )

        from ddpdoctor.static import analyze_paths

        result = analyze_paths([project])
        by_rule: dict[str, int] = {}
        for f in result.findings:
            by_rule[f.rule] = by_rule.get(f.rule, 0) + 1
        print(
            f"  project findings: {len(result.findings)} ({', '.join(f'{r}x{n}' for r, n in sorted(by_rule.items()))}) "
            f"in {len({f.file for f in result.findings})} files"
        )
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    imported = "torch" in sys.modules
    print(f"torch imported by static analysis: {imported}")
    return 1 if imported else (0 if ok else 3)


if __name__ == "__main__":
    sys.exit(main())
