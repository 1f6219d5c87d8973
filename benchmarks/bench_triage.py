"""What `ddpdoctor triage` costs against a `check` of the same steps, side by side in one run.

    .venv/bin/python benchmarks/bench_triage.py [--only NAME ...] [--no-resnet] [--repeat N]

For every fixture under fixtures/triage/ and the ResNet-18-shaped workload (benchmarks/workloads/resnet_ddp.py,
11 BatchNorm layers converted to SyncBN with --sync-bn), on 2 CPU ranks: a `check --epochs 3 --steps 10` (what
each triage arm observes; 2 x 5 for the ResNet, both commands) and a `triage` with its default arms (A, L, P), one
right after the other so both see the same load; with --repeat N each pair is timed N times and the medians are
kept. Prints triage s / check s per script, the median ratio (target, issue 23: <= 1.5), whether the arms shared
one launch (triage.json `launch`), and the load average before and after.
Times are wall-clock seconds of the whole command, as the user waits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures" / "triage"
RESNET = REPO / "benchmarks" / "workloads" / "resnet_ddp.py"
EXTRA = {"lr_not_scaled": ["--base-lr", "0.05", "--base-batch", "16"]}
SAME_STEPS = ["--epochs", "3", "--steps", "10"]  # triage's default per arm


def timed(argv: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ddpdoctor", *argv], cwd=REPO, capture_output=True, text=True,
                          check=False, timeout=900)
    return time.perf_counter() - t0, done.returncode


def pair(script: Path, options: list[str], script_args: list[str], steps: list[str]) -> tuple[float, float, dict]:
    tail = ["--", *script_args] if script_args else []
    check, _ = timed(["check", str(script), *options, *steps, "--format", "json", "-q", *tail])
    with tempfile.TemporaryDirectory() as tmp:
        keep = Path(tmp) / "keep"
        triage, _ = timed(["triage", str(script), *options, *steps, "--format", "json", "-o", f"{tmp}/t.json", "-q",
                           "--keep-run", str(keep), *tail])
        try:
            launch = json.loads((keep / "triage.json").read_text(encoding="utf-8"))["layout"].get("launch") or {}
        except (OSError, ValueError, KeyError):
            launch = {}
    return triage, check, launch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--no-resnet", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    names = sorted(p.stem for p in FIXTURES.glob("*.py") if p.stem != "common")
    if args.only:
        names = [n for n in names if n in args.only]
    jobs = [(n, FIXTURES / f"{n}.py", EXTRA.get(n, []), [], SAME_STEPS) for n in names]
    if not args.no_resnet and (not args.only or "resnet" in args.only):
        # 11 SyncBN layers emulated on CPU cost ~1 s a step per rank: 2 x 5 steps per arm (and for the check)
        # --timeout 600 for both: on a loaded 2-core machine an arm of it can pass the default 120 s
        jobs.append(("resnet18_syncbn", RESNET, ["--timeout", "600"], ["--sync-bn", "--epochs", "2", "--steps", "5"],
                     ["--epochs", "2", "--steps", "5"]))
    print(f"load before: {tuple(round(x, 2) for x in os.getloadavg())}", flush=True)
    ratios = []
    for name, script, options, script_args, steps in jobs:
        runs = [pair(script, options, script_args, steps) for _ in range(args.repeat)]
        tri = statistics.median(r[0] for r in runs)
        chk = statistics.median(r[1] for r in runs)
        launch = runs[-1][2]
        ratios.append(tri / chk)
        how = "one launch" if launch.get("shared") and not launch.get("separate") else \
            f"separate: {','.join(launch.get('separate') or []) or '?'} ({launch.get('why')})"
        print(f"{name:32s} triage {tri:6.1f} s  check {chk:5.1f} s  ratio {tri / chk:4.2f}  [{how}]  "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"median ratio: {statistics.median(ratios):.2f} (target <= 1.5) over {len(ratios)} scripts   "
          f"load after: {tuple(round(x, 2) for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
