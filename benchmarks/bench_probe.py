"""How long the probe takes against a bare `torchrun` of the same work, and where the time goes.

    .venv/bin/python benchmarks/bench_probe.py [--repeat 3] [--nproc 2]

Workload: fixtures/probe/unscaled_lr.py, 2 epochs × 4 steps per rank (the probe's default limit cuts nothing, so
both runs do exactly the same training). Both runs start the same way: a launcher process, an elastic agent, one
interpreter per rank that imports torch. The probe adds: the CUDA emulation and the recorders (installed when
the script imports torch), the events each rank writes, the wait for peers at the end, the analysis.
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
SCRIPT = "fixtures/probe/unscaled_lr.py"


def bare(nproc: int) -> tuple[float, str | None]:
    """Wall time of a bare torchrun, and how it failed if it did (gloo aborts at interpreter exit now and then:
    "terminate called without an active exception")."""
    from ddpdoctor.probe.launcher import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0", SCRIPT]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    if done.returncode == 0:
        return wall, None
    lines = [ln for ln in done.stderr.splitlines() if "terminate called" in ln or "Error" in ln]
    return wall, (lines[0].strip() if lines else f"exit {done.returncode}")


def probed(nproc: int, run_dir: Path) -> tuple[float, float, dict]:
    from ddpdoctor.analyses import analyze_run
    from ddpdoctor.config import CheckConfig
    from ddpdoctor.probe.launcher import run_probe

    cfg = CheckConfig(script=Path(SCRIPT), nproc=nproc, timeout=300.0)
    t0 = time.perf_counter()
    run_probe(cfg, run_dir, [])
    t1 = time.perf_counter()
    analyze_run(run_dir)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, phases(run_dir)


def phases(run_dir: Path) -> dict[str, float]:
    """Where the probe's time went, from its own records (seconds, the slowest rank for each phase)."""
    launch = json.loads((run_dir / "launcher.json").read_text())
    t0 = launch["started"]
    per_rank: dict[str, list[float]] = {}
    steps: list[float] = []
    for log in (run_dir / "events").glob("*.jsonl"):
        ev = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        t = {e["kind"]: e["t"] for e in reversed(ev)}  # first occurrence of each kind
        ready = next(e for e in ev if e["kind"] == "torch_ready")
        step_t = [e["t"] for e in ev if e["kind"] == "optimizer_step"]
        steps.extend(b - a for a, b in zip(step_t, step_t[1:]))
        marks = {
            "launcher + agent start, until the rank's interpreter runs": t["process_start"] - t0,
            "rank: import torch (the script's own import)": (
                t["torch_ready"] - t["script_start"] - ready["install_seconds"]
            ),
            "rank: CUDA emulation + recorders installed": ready["install_seconds"],
            "rank: script until its first optimizer step (rendezvous, DDP, first batch)": step_t[0] - t["torch_ready"],
            "rank: training steps": step_t[-1] - step_t[0],
            "rank: end hooks, wait for peers, exit": t["exit"] - step_t[-1],
            "agent shutdown and the launcher's sweep": launch["ended"] - t["exit"],
        }
        for k, v in marks.items():
            per_rank.setdefault(k, []).append(v)
    out = {k: max(v) for k, v in per_rank.items()}
    out["median step (ms)"] = 1000 * statistics.median(steps) if steps else float("nan")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ns = ap.parse_args()
    os.chdir(REPO)
    bare_t, probe_t, analysis_t, breakdowns, bare_failures = [], [], [], [], []
    for _ in range(ns.repeat):  # interleaved, so a busy machine affects both alike
        wall, failure = bare(ns.nproc)
        bare_t.append(wall)
        if failure:
            bare_failures.append(failure)
        with tempfile.TemporaryDirectory(prefix="ddpdoctor-bench-") as d:
            p, a, ph = probed(ns.nproc, Path(d) / "run")
        probe_t.append(p)
        analysis_t.append(a)
        breakdowns.append(ph)
    med = statistics.median
    print(f"workload: {SCRIPT}, {ns.nproc} ranks, 2 epochs x 4 steps; {ns.repeat} runs each, medians")
    print(f"  bare torchrun                      {med(bare_t):6.2f} s   "
          f"(runs: {', '.join(f'{x:.2f}' for x in bare_t)})")
    print(f"  probe (launch + run + stop)        {med(probe_t):6.2f} s   "
          f"(runs: {', '.join(f'{x:.2f}' for x in probe_t)})")
    print(f"  analysis of the recorded run       {med(analysis_t):6.2f} s")
    print(f"  probe / bare                       {med(probe_t) / med(bare_t):6.2f} x")
    if bare_failures:
        print(f"  bare torchrun failed {len(bare_failures)} of {ns.repeat} times: {bare_failures[0][:120]}")
    print("where the probe's time goes (median over runs, slowest rank):")
    for key in breakdowns[0]:
        unit = "" if key.endswith("(ms)") else " s"
        print(f"  {key:<75} {med(b[key] for b in breakdowns):7.3f}{unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
