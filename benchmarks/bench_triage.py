"""How long `ddpdoctor triage` takes on each fixture scenario, and what it costs against `check`.

    .venv/bin/python benchmarks/bench_triage.py [--only NAME ...] [--cost]

Targets (issue 12): every fixture under fixtures/triage/ on 2 CPU ranks in under 60 s; the cost of a triage at most
(arms + 0.5) x the cost of a `check` of the same script observing the same steps (each arm observes ~30 steps, the
check is run with the same --epochs/--steps so both do the same training per run). --cost also reports the ratio
against a default `check` (2 epochs x 4 steps), which observes fewer steps.
Times are wall-clock seconds on this machine: compare runs on the same machine and load (`uptime` is printed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures" / "triage"
EXTRA = {"lr_not_scaled": ["--base-lr", "0.05", "--base-batch", "16"]}


def timed(argv: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ddpdoctor", *argv], cwd=REPO, capture_output=True, text=True,
                          check=False, timeout=900)
    return time.perf_counter() - t0, done.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--cost", action="store_true", help="also time check runs for the cost ratio")
    args = ap.parse_args()
    names = sorted(p.stem for p in FIXTURES.glob("*.py") if p.stem != "common")
    if args.only:
        names = [n for n in names if n in args.only]
    print(f"load: {os.getloadavg()}")
    worst = 0.0
    for name in names:
        script = str(FIXTURES / f"{name}.py")
        with tempfile.TemporaryDirectory() as tmp:
            wall, rc = timed(["triage", script, *EXTRA.get(name, []), "--format", "json", "-o", f"{tmp}/t.json"])
        worst = max(worst, wall)
        line = f"{name:32s} triage {wall:6.1f} s (exit {rc})"
        if args.cost:
            same, _ = timed(["check", script, *EXTRA.get(name, []), "--epochs", "3", "--steps", "10", "--format",
                             "json"])
            default, _ = timed(["check", script, *EXTRA.get(name, []), "--format", "json"])
            line += (f"   check(3x10) {same:5.1f} s  ratio {wall / same:4.2f} (budget 3.5)"
                     f"   check(default) {default:5.1f} s  ratio {wall / default:4.2f}")
        print(line, flush=True)
    print(f"slowest: {worst:.1f} s (target < 60 s)   load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
