"""The probe's per-step overhead on GPUs, with real CUDA tensors (runs only where CUDA is visible).

    .venv/bin/python benchmarks/bench_gpu_step.py [--repeat 3] [--nproc N] [--no-sync-bn] [--no-amp]

Workload: benchmarks/workloads/resnet_ddp.py --device cuda (SyncBN and bfloat16 autocast by default), 2 epochs ×
10 steps per rank, N = min(visible GPUs, 2) ranks under torchrun with NCCL; the steady-state window is steps 3–20,
timed with a synchronize only at its two ends. Compared: a bare torchrun, and the same command with
`-m ddpdoctor.probe --out DIR` (attach mode: real devices, nothing emulated) limited to the same 2 × 10 steps.
Also reported: synchronising CUDA calls made from ddpdoctor's code inside the window (torch's sync debug mode;
the recorders read device values back through ddpdoctor.probe.readback and should make none). Minimum of N
interleaved runs as the estimate, median beside it. Target: per-step overhead within 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = "benchmarks/workloads/resnet_ddp.py"
TARGET = 1.05


def _env() -> dict[str, str]:
    from ddpdoctor.world import WORLD_ENV

    return {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_") and k not in WORLD_ENV}


def run(nproc: int, workload_args: list[str], probe_dir: Path | None) -> list[dict]:
    from ddpdoctor.probe.launcher import free_port

    probe = ["-m", "ddpdoctor.probe", "--out", str(probe_dir), "--epochs", "2", "--steps", "10"] if probe_dir else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0", *probe, WORKLOAD, *workload_args]
    done = subprocess.run(cmd, check=False, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"{'probe' if probe_dir else 'bare'} run failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("BENCH ")]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device visible: the GPU benchmark runs only on a GPU machine")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=min(torch.cuda.device_count(), 2))
    ap.add_argument("--no-sync-bn", action="store_true")
    ap.add_argument("--no-amp", action="store_true")
    ns = ap.parse_args()
    args = ["--device", "cuda", "--epochs", "2", "--steps", "10", "--sync-debug"]
    args += [] if ns.no_sync_bn else ["--sync-bn"]
    args += [] if ns.no_amp else ["--amp"]
    step: dict[str, list[float]] = {"bare": [], "probe": []}
    ours: list[int] = []
    sites: set[str] = set()
    for _ in range(ns.repeat):
        lines = run(ns.nproc, args, None)
        step["bare"].append(max(x["window_seconds"] / x["window_steps"] for x in lines) * 1000)
        with tempfile.TemporaryDirectory(prefix="ddpdoctor-gpu-bench-") as d:
            lines = run(ns.nproc, args, Path(d) / "run")
        step["probe"].append(max(x["window_seconds"] / x["window_steps"] for x in lines) * 1000)
        ours.append(max(x.get("sync_calls_ddpdoctor", 0) for x in lines))
        sites.update(s for x in lines for s in x.get("sync_sites_ddpdoctor", []))
    name = torch.cuda.get_device_name(0)
    print(f"workload: {WORKLOAD} {' '.join(args)}; {ns.nproc} x {name}; {ns.repeat} interleaved runs each")
    for key in ("bare", "probe"):
        med = statistics.median(step[key])
        print(f"  {key:<6} steady-state step  min {min(step[key]):8.2f} ms  median {med:8.2f} ms"
              f"  (runs: {', '.join(f'{v:.2f}' for v in step[key])})")
    ratio = min(step["probe"]) / min(step["bare"])
    print(f"  probe / bare step   {ratio:5.3f}x   target <= {TARGET}x   {'met' if ratio <= TARGET else 'MISSED'}")
    print(f"  synchronising CUDA calls from ddpdoctor's code in the window: {max(ours)}"
          + (f" ({', '.join(sorted(sites))})" if sites else ""))
    return 0 if ratio <= TARGET and max(ours) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
