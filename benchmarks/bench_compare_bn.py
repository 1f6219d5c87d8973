"""Benchmark `ddpdoctor compare-bn` (the built-in demo) end to end, as a user runs it.

    .venv/bin/python benchmarks/bench_compare_bn.py              # 3 runs each of --shard iid and sorted
    .venv/bin/python benchmarks/bench_compare_bn.py --seeds 10   # plus the non-i.i.d. test over 10 seeds

Reports wall-clock time per run (the budget is "well under 30 s on 2 cores"), where the ranks spend it (torch
import dominates), SyncBN's worst relative error against the exact global-batch reference, local BN's worst
error, and the non-i.i.d. p-value. With --seeds it also reports how often the test fires (p < 1e-3) on i.i.d.
and on label-sorted shards across seeds: the real-pipeline counterpart of the numpy calibration tests.
Exits 1 if a run exceeds the budget or SyncBN misses the reference by more than 1e-5.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BUDGET_S = 30.0
SYNC_TOL = 1e-5


def run_once(shard: str, seed: int = 0, extra: list[str] | None = None) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "ddpdoctor", "compare-bn", "--shard", shard, "--seed", str(seed), "--format", "json"]
    cmd += extra or []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"compare-bn failed ({proc.returncode}): {proc.stderr.strip()}")
    return wall, json.loads(proc.stdout)


def worst(doc: dict, key: str) -> float:
    return max(
        max(layer["running_var_rel_err"].get(key) or 0.0, layer["running_mean_rel_err"].get(key) or 0.0)
        for layer in doc["layers"]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=0, help="also run the non-i.i.d. test over this many seeds")
    args = ap.parse_args()

    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    failed = False
    for shard in ("iid", "sorted"):
        walls = []
        doc: dict = {}
        for _ in range(args.runs):
            wall, doc = run_once(shard)
            walls.append(wall)
        rank0 = doc["timings"]["rank0"]
        sync, local = worst(doc, "sync"), worst(doc, "local")
        print(
            f"--shard {shard:<6} wall min {min(walls):.2f} s, median {statistics.median(walls):.2f} s, "
            f"max {max(walls):.2f} s (budget {BUDGET_S:.0f} s) | rank 0: "
            + ", ".join(f"{k} {v:.2f}" for k, v in rank0.items())
        )
        print(
            f"              SyncBN worst rel err {sync:.1e}, local BN worst {local:.3g}, "
            f"non-iid p {doc['noniid']['p_value']:.2g}"
        )
        failed |= max(walls) > BUDGET_S or sync > SYNC_TOL

    if args.seeds:
        for shard in ("iid", "sorted"):
            ps = [run_once(shard, seed)[1]["noniid"]["p_value"] for seed in range(args.seeds)]
            fired = sum(p < 1e-3 for p in ps)
            print(
                f"non-iid test, --shard {shard:<6}: fired (p < 1e-3) on {fired}/{len(ps)} seeds; "
                f"p median {statistics.median(ps):.2g}, min {min(ps):.2g}, max {max(ps):.2g}"
            )
    print("FAIL" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
