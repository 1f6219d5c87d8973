"""Emulated mixed precision: the cost of one autocast training step beside the float32 step (issue 23).

Under the probe, `autocast("cuda", float16)` runs as CPU autocast in bfloat16 (ddpdoctor/probe/emulation.py):
CPU float16 kernels are far slower than float32 (86x measured for a ResNet-shaped step on an AVX512-FP16/AMX CPU),
bfloat16 ones about as fast. This times one training step (forward, cross-entropy, backward, SGD) of the ResNet
workload (benchmarks/workloads/resnet_ddp.py's model) and of a ResNet-18 (torchvision's layout) in one process under
the CUDA emulation, as the probe runs a rank: float32, autocast(cuda) as the emulation maps it (bfloat16), and
with --float16 also CPU float16 autocast (the exact dtype; minutes per step). Target: emulated AMP step <= 2x the
float32 step. Best of --runs steps after one warm-up; wall time, so run it on a quiet machine.

    python benchmarks/bench_autocast.py [--batch 16] [--size 32] [--runs 3] [--threads 1] [--float16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent / "workloads"))
from resnet_ddp import ResNetish  # noqa: E402

TARGET = 2.0


class _Basic(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
        self.down = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):  # noqa: ANN001, ANN201
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.down(x))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, c = [], 64
        for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_Basic(c, out, stride), _Basic(out, out, 1)]
            c = out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def _step_time(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None, runs: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    step()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=32, help="image side for the ResNet workload (ResNet-18: x2)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--float16", action="store_true", help="also time CPU float16 autocast (slow)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from ddpdoctor.probe.emulation import install_cuda_emulation

    used: dict[str, object] = {}
    undo = install_cuda_emulation(1, notify=lambda what, detail: used.setdefault(what, detail))
    ok = True
    try:
        print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
              f"{args.threads} thread(s), batch {args.batch}, best of {args.runs}")
        for name, build, side in (("ResNet workload", ResNetish, args.size), ("ResNet-18", ResNet18, 2 * args.size)):
            torch.manual_seed(0)
            model = build().to("cuda")
            x = torch.randn(args.batch, 3, side, side, device="cuda")
            y = torch.randint(0, 10, (args.batch,), device="cuda")
            fp32 = _step_time(model, x, y, None, args.runs)
            amp = _step_time(model, x, y, torch.float16, args.runs)
            ratio = amp / fp32
            ok = ok and ratio <= TARGET
            print(f"{name} ({side}x{side}): float32 step {fp32 * 1000:8.1f} ms   emulated AMP step "
                  f"{amp * 1000:8.1f} ms ({used.get('autocast_cuda', {}).get('used')})  ratio {ratio:5.2f}  "
                  f"target <= {TARGET:.1f}: {'met' if ratio <= TARGET else 'NOT met'}")
            if args.float16:
                undo()
                model_cpu = model.to("cpu")
                with_fp16 = _cpu_float16(model_cpu, x, y, args.runs)
                print(f"  CPU float16 autocast (the exact dtype): {with_fp16 * 1000:8.1f} ms, "
                      f"{with_fp16 / fp32:5.1f}x float32")
                undo = install_cuda_emulation(1, notify=lambda what, detail: used.setdefault(what, detail))
    finally:
        undo()
    return 0 if ok else 3


def _cpu_float16(model: nn.Module, x: torch.Tensor, y: torch.Tensor, runs: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    best = float("inf")
    for i in range(runs + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    sys.exit(main())
