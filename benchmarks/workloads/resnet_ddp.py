"""A ResNet-style CNN trained with DDP: the probe's cost benchmark workload (benchmarks/bench_overhead.py).

11 BatchNorm layers (a stem and five basic blocks of two), about 1.2 M parameters, synthetic 32×32 images,
DistributedSampler with set_epoch, SGD with momentum: the shape of a real image-classification recipe, small
enough for a 2-core machine. Runs as it is under a bare `torchrun` and under the probe, so the two can be compared
step for step: `--epochs 2 --steps 10` is 20 optimizer steps per rank, and the probe is given the same limits so it
cuts nothing.

    torchrun --nproc-per-node 2 benchmarks/workloads/resnet_ddp.py                     # CPU, gloo
    torchrun --nproc-per-node 2 benchmarks/workloads/resnet_ddp.py --device cuda --sync-bn   # GPUs, NCCL

At the end every rank prints one line `BENCH {json}`: its rank, the steps it took, the wall time of the steady-state
steps (from the third on; on CUDA with a synchronize only at both ends of that window, never per step) and its
peak RSS. With `--sync-debug` (CUDA), torch's sync debug mode is on during that window and the line also counts
the synchronising CUDA calls, and those made from ddpdoctor's own code (the probe's recorders must make none).
"""

import argparse
import json
import os
import resource
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride, bias=False) if (stride != 1 or c_in != c_out) else None

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class ResNetish(nn.Module):
    def __init__(self, width: int = 43, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.stem = nn.Conv2d(3, w, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(w)
        self.blocks = nn.Sequential(
            Block(w, w, 1), Block(w, 2 * w, 2), Block(2 * w, 2 * w, 1), Block(2 * w, 4 * w, 2), Block(4 * w, 4 * w, 1)
        )
        self.head = nn.Linear(4 * w, classes)

    def forward(self, x):
        x = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="steps per epoch")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--sync-bn", action="store_true")
    p.add_argument("--amp", action="store_true", help="autocast to bfloat16 (CUDA)")
    p.add_argument("--sync-debug", action="store_true", help="count synchronising CUDA calls in the timed window")
    args = p.parse_args()

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    torch.manual_seed(0)
    n = world * args.batch_size * args.steps
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True, pin_memory=cuda)

    model = ResNetish()
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * world, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    syncs = {"total": 0, "ddpdoctor": 0, "sites": []}

    def on_warning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if "synchronizing" not in str(message):
            return
        syncs["total"] += 1
        # who made the call: the innermost frame outside torch and this handler (under the probe, the script's
        # own frames run inside ddpdoctor's bootstrap: only a ddpdoctor frame as the caller is ddpdoctor's)
        stack = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}torch{os.sep}" not in f.filename
                 and not f.filename.endswith(f"{os.sep}warnings.py")]
        caller = stack[-1] if stack else None
        if caller is not None and f"{os.sep}ddpdoctor{os.sep}" in caller.filename:
            syncs["ddpdoctor"] += 1
            site = f"{caller.filename.rsplit(os.sep, 3)[-1]}:{caller.lineno} {caller.name}"
            if site not in syncs["sites"] and len(syncs["sites"]) < 8:
                syncs["sites"].append(site)

    steps = 0
    window_start = None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            if steps == 2:  # steady state from the third step: the first ones build caches and buckets
                if cuda:
                    torch.cuda.synchronize()
                    if args.sync_debug:
                        warnings.simplefilter("always")
                        warnings.showwarning = on_warning
                        torch.cuda.set_sync_debug_mode("warn")
                window_start = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.amp):
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            steps += 1
    if cuda:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    window = time.perf_counter() - window_start if window_start is not None else float("nan")
    report = {
        "rank": rank,
        "world": world,
        "steps": steps,
        "window_steps": max(0, steps - 2),
        "window_seconds": round(window, 6),
        "params": sum(p.numel() for p in model.parameters()),
        "bn_layers": sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()),
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    if args.sync_debug:
        report["sync_calls"] = syncs["total"]
        report["sync_calls_ddpdoctor"] = syncs["ddpdoctor"]
        report["sync_sites_ddpdoctor"] = syncs["sites"]
    print("BENCH " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
