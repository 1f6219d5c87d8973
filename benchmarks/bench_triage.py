"""What `ddpdoctor triage` costs against a `check` of the same steps, side by side in one run.

    .venv/bin/python benchmarks/bench_triage.py [--only NAME ...] [--no-resnet] [--repeat N] [--baseline TREE]

For every fixture under fixtures/triage/ and the ResNet-18-shaped workload (benchmarks/workloads/resnet_ddp.py,
11 BatchNorm layers converted to SyncBN with --sync-bn), on 2 CPU ranks: a `check --epochs 3 --steps 10` (what
each triage arm observes; 2 x 5 for the ResNet, both commands) and a `triage` with its default arms (A, L, P), one
right after the other so both see the same load; with --repeat N each pair is timed N times and the medians are
kept. Prints triage s / check s per script, the median ratio (target, issue 23: <= 1.5), whether the arms shared
one launch (triage.json `launch`), and the load average before and after.
Times are wall-clock seconds of the whole command, as the user waits; beside them the CPU seconds (user + system)
of the command and every process of it that was waited for (its ranks included), which depend far less on what
else loads the machine: on a machine loaded by others the wall-clock ratio approaches the CPU ratio, on a quiet
one the serial parts (start-up, the agent, analysis) weigh more. --baseline TREE (another checkout of ddpdoctor,
e.g. `git worktree add /tmp/base main`) adds a triage run by that tree's code right after each pair, so a change is
measured against the code before it under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(argv: list[str], tree: Path = REPO) -> tuple[float, float, int]:
    """(wall s, CPU s, exit code) of `python -m ddpdoctor ARGV` run by the ddpdoctor of `tree`."""
    cpu = _cpu()
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ddpdoctor", *argv], cwd=tree, capture_output=True, text=True,
                          check=False, timeout=900)
    return time.perf_counter() - t0, _cpu() - cpu, done.returncode


def run_triage(script: Path, options: list[str], steps: list[str], tail: list[str],
               tree: Path = REPO) -> tuple[float, float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        keep = Path(tmp) / "keep"
        wall, cpu, rc = timed(["triage", str(script), *options, *steps, "--format", "json", "-o", f"{tmp}/t.json",
                              "-q", "--keep-run", str(keep), *tail], tree)
        try:
            launch = json.loads((keep / "triage.json").read_text(encoding="utf-8"))["layout"].get("launch") or {}
        except (OSError, ValueError, KeyError):
            launch = {}
    if rc not in (0, 1):  # 2: it could not analyse (or it crashed): this time is not a triage's
        launch["exit"] = rc
    return wall, cpu, launch


def pair(script: Path, options: list[str], script_args: list[str], steps: list[str],
         baseline: Path | None) -> dict:
    tail = ["--", *script_args] if script_args else []
    check, check_cpu, check_rc = timed(["check", str(script), *options, *steps, "--format", "json", "-q", *tail])
    triage, triage_cpu, launch = run_triage(script, options, steps, tail)
    out = {"check": check, "check_cpu": check_cpu, "triage": triage, "triage_cpu": triage_cpu, "launch": launch}
    if check_rc not in (0, 1):
        launch["check_exit"] = check_rc
    if baseline is not None:
        out["base"], out["base_cpu"], _ = run_triage(script, options, steps, tail, baseline)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--no-resnet", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--baseline", type=Path, default=None, help="another ddpdoctor tree: its triage, timed too")
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
    if not jobs:
        sys.exit("no script selected: --only takes fixture names of fixtures/triage/ and resnet")
    baseline = args.baseline.resolve() if args.baseline is not None else None
    print(f"load before: {tuple(round(x, 2) for x in os.getloadavg())}", flush=True)
    ratios: dict[str, list[float]] = {"wall": [], "cpu": [], "base": [], "base_cpu": []}
    for name, script, options, script_args, steps in jobs:
        runs = [pair(script, options, script_args, steps, baseline) for _ in range(args.repeat)]
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "launch"}
        launch = runs[-1]["launch"]
        ratios["wall"].append(m["triage"] / m["check"])
        ratios["cpu"].append(m["triage_cpu"] / m["check_cpu"])
        how = "one launch" if launch.get("shared") and not launch.get("separate") else \
            f"separate: {','.join(launch.get('separate') or []) or '?'} ({launch.get('why')})"
        failed = " ".join(f"{k}={launch[k]}" for k in ("exit", "check_exit") if k in launch)
        if failed:
            how += f" EXIT CODE {failed}: not comparable"
        base = ""
        if baseline is not None:
            ratios["base"].append(m["base"] / m["check"])
            ratios["base_cpu"].append(m["base_cpu"] / m["check_cpu"])
            base = f"  baseline triage {m['base']:6.1f} s ratio {m['base'] / m['check']:4.2f} " \
                   f"(cpu {m['base_cpu'] / m['check_cpu']:4.2f})"
        print(f"{name:26s} triage {m['triage']:6.1f} s (cpu {m['triage_cpu']:5.1f})  check {m['check']:5.1f} s "
              f"(cpu {m['check_cpu']:5.1f})  ratio {m['triage'] / m['check']:4.2f} "
              f"(cpu {m['triage_cpu'] / m['check_cpu']:4.2f}){base}  [{how}]  load {os.getloadavg()[0]:.2f}",
              flush=True)
    print(f"median ratio: {statistics.median(ratios['wall']):.2f} (target <= 1.5), CPU "
          f"{statistics.median(ratios['cpu']):.2f}, over {len(ratios['wall'])} scripts"
          + (f"; baseline {statistics.median(ratios['base']):.2f} (CPU {statistics.median(ratios['base_cpu']):.2f})"
             if baseline is not None else "")
          + f"   load after: {tuple(round(x, 2) for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
