"""The probe's cost on a real-sized workload: wall time and peak RSS per rank, probe vs a bare torchrun.

    .venv/bin/python benchmarks/bench_overhead.py [--repeat 5] [--nproc 2]

Workload: benchmarks/workloads/resnet_ddp.py (ResNet-style CNN, 11 BN layers, 1.22 M parameters, batch 32 of
32×32 images per rank), 2 epochs × 10 steps = 20 optimizer steps per rank. The probe is given the same limits
(`--epochs 2 --steps 10`), so both runs do exactly the same training.

- bare: `python -m torch.distributed.run --nproc-per-node N workload` — what the user runs without ddpdoctor.
- probe: ddpdoctor.probe.launcher.run_probe (launch, instrumented ranks, recording, end of the run, sweep);
  check: the whole `ddpdoctor check` command as a user runs it (static analysis, probe, analyses, report).
- peak RSS per rank: the rank processes' VmHWM (peak resident set) from /proc, sampled every 20 ms while they
  live (a rank is a process of the run with LOCAL_RANK in its environment), the largest rank of each run; the
  busiest rank's CPU time (user + system) from the same samples.

Fairness on a shared machine: the three kinds of run are interleaved (bare, probe, check, bare, ...), so a busy
period hurts each alike; each is repeated and the *minimum* is the estimate (noise from other processes only ever
adds time), the median is printed beside it; the load average is printed before and after. Targets (issue 14):
probe ≤ 1.05× bare wall, peak RSS per rank ≤ 1.2× bare. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = "benchmarks/workloads/resnet_ddp.py"
EPOCHS, STEPS = 2, 10
WALL_TARGET, RSS_TARGET = 1.05, 1.2
TICKS = os.sysconf("SC_CLK_TCK")


class PeakRss:
    """Peak resident set (VmHWM, KiB) of every process whose environment holds `LOCAL_RANK` and whose command
    line names the workload, sampled from /proc until stopped."""

    def __init__(self, needle: str, interval: float = 0.02) -> None:
        self.needle = needle.encode()
        self.interval = interval
        self.peaks: dict[int, int] = {}
        self.cpu: dict[int, float] = {}  # user + system CPU seconds of each rank process, last sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _classify(self, pid: str) -> bool | None:
        """True: a rank; False: never one (its command line does not name the workload); None: not yet — a
        process just forked by the agent still shows the agent's command line and environment until it execs."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if self.needle not in fh.read():
                    return False
            with open(f"/proc/{pid}/environ", "rb") as fh:
                return True if b"\0LOCAL_RANK=" in b"\0" + fh.read() else None
        except OSError:
            return False

    def _run(self) -> None:
        ranks: set[str] = set()
        others: set[str] = set()
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit() or pid in others:
                    continue
                if pid not in ranks:
                    kind = self._classify(pid)
                    if kind is True:
                        ranks.add(pid)
                    elif kind is False:
                        others.add(pid)
                if pid in ranks:
                    try:
                        with open(f"/proc/{pid}/status", "rb") as fh:
                            for line in fh:
                                if line.startswith(b"VmHWM:"):
                                    kib = int(line.split()[1])
                                    self.peaks[int(pid)] = max(self.peaks.get(int(pid), 0), kib)
                                    break
                    except OSError:
                        pass
                    try:
                        with open(f"/proc/{pid}/stat", "rb") as fh:
                            fields = fh.read().rsplit(b")", 1)[1].split()
                        self.cpu[int(pid)] = (int(fields[11]) + int(fields[12])) / TICKS
                    except (OSError, IndexError, ValueError):
                        pass
            self._stop.wait(self.interval)

    @property
    def largest_rank_mib(self) -> float:
        return max(self.peaks.values(), default=0) / 1024

    @property
    def busiest_rank_cpu(self) -> float:
        return max(self.cpu.values(), default=0.0)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def bare(nproc: int) -> tuple[float, float, float, list[dict]]:
    from ddpdoctor.probe.launcher import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0", WORKLOAD,
           "--epochs", str(EPOCHS), "--steps", str(STEPS)]
    with PeakRss(WORKLOAD) as rss:
        t0 = time.perf_counter()
        done = subprocess.run(cmd, check=False, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"bare torchrun failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return wall, rss.largest_rank_mib, rss.busiest_rank_cpu, _bench_lines(done.stdout)


def probe(nproc: int) -> tuple[float, float, float, list[dict]]:
    from ddpdoctor.config import CheckConfig
    from ddpdoctor.probe.launcher import run_probe

    cfg = CheckConfig(script=Path(WORKLOAD), script_args=("--epochs", str(EPOCHS), "--steps", str(STEPS)),
                      nproc=nproc, epochs=EPOCHS, steps=STEPS, timeout=900.0, device="cpu")
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-bench-") as d:
        run_dir = Path(d) / "run"
        with PeakRss(WORKLOAD) as rss:
            t0 = time.perf_counter()
            run_probe(cfg, run_dir, [])
            wall = time.perf_counter() - t0
        lines = []
        for log in sorted((run_dir / "logs").glob("rank*.stdout")):
            lines += _bench_lines(log.read_text())
    if len(lines) != nproc:
        sys.exit(f"probe run: {len(lines)} of {nproc} ranks finished the workload")
    return wall, rss.largest_rank_mib, rss.busiest_rank_cpu, lines


def check(nproc: int) -> float:
    cmd = [sys.executable, "-m", "ddpdoctor", "check", WORKLOAD, "--nproc", str(nproc), "--epochs", str(EPOCHS),
           "--steps", str(STEPS), "--device", "cpu", "--timeout", "900", "--format", "json", "--",
           "--epochs", str(EPOCHS), "--steps", str(STEPS)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, check=False, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if done.returncode not in (0, 1):
        sys.exit(f"ddpdoctor check failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return wall


def _bench_lines(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("BENCH ")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--no-check", action="store_true", help="skip the whole-command runs")
    ns = ap.parse_args()
    os.chdir(REPO)
    load_before = os.getloadavg()
    runs: dict[str, list[float]] = {"bare": [], "probe": [], "check": []}
    rss: dict[str, list[float]] = {"bare": [], "probe": []}
    step: dict[str, list[float]] = {"bare": [], "probe": []}
    cpu: dict[str, list[float]] = {"bare": [], "probe": []}
    shape = None
    for _ in range(ns.repeat):
        w, r, c, lines = bare(ns.nproc)
        runs["bare"].append(w)
        rss["bare"].append(r)
        cpu["bare"].append(c)
        step["bare"].append(max(x["window_seconds"] / x["window_steps"] for x in lines))
        shape = lines[0]
        w, r, c, lines = probe(ns.nproc)
        runs["probe"].append(w)
        rss["probe"].append(r)
        cpu["probe"].append(c)
        step["probe"].append(max(x["window_seconds"] / x["window_steps"] for x in lines))
        if not ns.no_check:
            runs["check"].append(check(ns.nproc))
    load_after = os.getloadavg()
    if min(rss["bare"] + rss["probe"]) == 0:
        sys.exit("a run's ranks were never seen in /proc: the RSS and CPU samples are incomplete")
    lo, med = min, statistics.median
    assert shape is not None
    print(f"workload: {WORKLOAD}: {shape['params']:,} parameters, {shape['bn_layers']} BN layers, "
          f"{ns.nproc} ranks x {EPOCHS * STEPS} steps; {ns.repeat} interleaved runs each, {os.cpu_count()} CPUs")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")

    def row(name: str, values: list[float], unit: str, fmt: str = "6.2f") -> None:
        print(f"  {name:<40} min {lo(values):{fmt}} {unit}  median {med(values):{fmt}} {unit}  "
              f"(runs: {', '.join(f'{v:.2f}' for v in values)})")

    row("bare torchrun, wall", runs["bare"], "s")
    row("probe (launch, run, stop), wall", runs["probe"], "s")
    if runs["check"]:
        row("ddpdoctor check (whole command), wall", runs["check"], "s")
    row("bare: CPU time of the busiest rank", cpu["bare"], "s")
    row("probe: CPU time of the busiest rank", cpu["probe"], "s")
    row("bare: steady-state step, slowest rank", [1000 * v for v in step["bare"]], "ms", "6.1f")
    row("probe: steady-state step, slowest rank", [1000 * v for v in step["probe"]], "ms", "6.1f")
    row("bare: peak RSS, largest rank", rss["bare"], "MiB", "6.0f")
    row("probe: peak RSS, largest rank", rss["probe"], "MiB", "6.0f")
    wall_ratio = lo(runs["probe"]) / lo(runs["bare"])
    check_ratio = lo(runs["check"]) / lo(runs["bare"]) if runs["check"] else float("nan")
    cpu_ratio = lo(cpu["probe"]) / lo(cpu["bare"])
    step_ratio = lo(step["probe"]) / lo(step["bare"])
    rss_ratio = lo(rss["probe"]) / lo(rss["bare"])
    ok_wall, ok_rss = wall_ratio <= WALL_TARGET, rss_ratio <= RSS_TARGET
    print("ratios (min / min):")
    verdict = "met" if ok_wall else "MISSED"
    print(f"  probe / bare wall        {wall_ratio:5.2f}x   target <= {WALL_TARGET}x   {verdict}")
    print(f"  check / bare wall        {check_ratio:5.2f}x   (static analysis + analyses + report included)")
    print(f"  probe / bare step        {step_ratio:5.2f}x")
    print(f"  probe / bare rank CPU    {cpu_ratio:5.2f}x   (CPU seconds: what a busy machine distorts least)")
    print(f"  probe / bare peak RSS    {rss_ratio:5.2f}x   target <= {RSS_TARGET}x   {'met' if ok_rss else 'MISSED'}")
    return 0 if ok_wall and ok_rss else 1


if __name__ == "__main__":
    sys.exit(main())
