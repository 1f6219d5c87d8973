"""`ddpdoctor compare-bn`: local BN vs SyncBN vs the exact global-batch BN, per layer, on the same batches.

The question it answers: how far are the running statistics each rank ends up with from what one process would
have computed over the whole global batch, and is the data on the ranks even drawn from the same distribution?

The command launches N rank processes (`ddpdoctor.bn._worker`: gloo on CPU, NCCL on GPUs). They replay one plan
of global batches through local BN with DDP's default buffer broadcast, local BN without it, and SyncBN; rank 0
then runs the exact reference. The "reduce" mode is per-GPU BN whose running statistics are averaged over the ranks
at the end of the epoch (timm's `--dist-bn reduce`): the ranks' means average correctly, but averaging their
variances drops the spread between their means, so it is biased low whenever the ranks' data differ. This process
never imports torch: it validates options, launches and supervises
the ranks (a rank that fails ends the run with one line; a timeout kills them all), and turns their measurements
into per-layer errors, the non-i.i.d. test, findings (DD201-DD204) and a verdict (`ddpdoctor.bn.analysis`), which
`ddpdoctor.report.compare_bn` renders.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddpdoctor.bn.analysis import CompareConfig, CompareResult, analyse
from ddpdoctor.errors import InternalError, UsageError

__all__ = ["CompareConfig", "CompareResult", "run_compare"]


# ------------------------------------------------------------------------------------------- validation


def _check_factory_spec(spec: str | None, option: str) -> None:
    if spec is None:
        return
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise UsageError(f"{option} {spec!r}: expected MODULE:FACTORY (a dotted module or a .py file)")
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
        path = Path(module_part)
        if not path.exists():
            raise UsageError(f"{option} {spec!r}: {module_part}: no such file")
        if not path.is_file():
            raise UsageError(f"{option} {spec!r}: {module_part}: not a file")


def _validate(cfg: CompareConfig) -> tuple[str, list[list[int]] | None]:
    from ddpdoctor.bn.plan import read_shard_file

    if cfg.nproc < 2:
        raise UsageError("--nproc must be at least 2: compare-bn compares what ranks compute")
    if cfg.batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    if cfg.steps < 1:
        raise UsageError("--steps must be at least 1")
    if not cfg.timeout > 0:
        raise UsageError("--timeout must be positive")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device: {cfg.device!r} is not one of auto, cpu, cuda")
    _check_factory_spec(cfg.model, "--model")
    _check_factory_spec(cfg.data, "--data")
    shard = cfg.shard.strip()
    if shard.lower() in ("iid", "sorted"):
        return shard.lower(), None
    path = Path(shard)
    if not path.is_file():
        raise UsageError(f"--shard {shard!r}: not iid, sorted, or an existing JSON file of per-rank index lists")
    try:
        return "file", read_shard_file(path, cfg.nproc)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# ------------------------------------------------------------------------------------------------ launch


def _loopback_interface() -> str | None:
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except (OSError, AttributeError):
        pass
    return None


class _Ranks:
    """The rank processes of one comparison: started in their own sessions, so killing one kills everything it
    started; always reaped before the command returns."""

    def __init__(self, work: Path, timeout: float) -> None:
        self.work = work
        self.timeout = timeout
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Any] = []
        self.killed: set[int] = set()  # ranks we killed ourselves (their SIGKILL is not their failure)

    def start(self, job_path: Path, nproc: int, threads: int) -> None:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        env["PYTHONUNBUFFERED"] = "1"
        lo = _loopback_interface()
        if lo and "GLOO_SOCKET_IFNAME" not in env:
            env["GLOO_SOCKET_IFNAME"] = lo  # rendezvous and traffic stay on this machine
        for rank in range(nproc):
            log = open(self.work / f"rank{rank}.log", "wb")
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "ddpdoctor.bn._worker", str(job_path), str(rank)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )

    def wait(self, deadline: float) -> None:
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c == 0 for c in codes):
                return
            if any(c not in (None, 0) for c in codes):
                # let the peers that hit the same problem report it (a usage error reaches all ranks at once)
                grace = min(time.monotonic() + 1.0, deadline)
                while time.monotonic() < grace and any(p.poll() is None for p in self.procs):
                    time.sleep(0.02)
                self.kill()
                raise self._failure()
            if time.monotonic() > deadline:
                phases = self._phases()
                self.kill()
                raise UsageError(
                    f"compare-bn did not finish within --timeout {self.timeout:g} s; ranks were at: {phases}"
                )
            time.sleep(0.02)

    def kill(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.poll() is None:
                self.killed.add(rank)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    try:
                        p.kill()
                    except ProcessLookupError:
                        pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not time out in practice
                pass
        for log in self.logs:
            log.close()
        self.logs = []

    def _phases(self) -> str:
        parts = []
        for rank in range(len(self.procs)):
            try:
                text = (self.work / f"rank{rank}.phase").read_text(encoding="utf-8").strip()
            except OSError:
                text = "starting"
            parts.append(f"rank {rank}: {text}")
        return "; ".join(parts)

    def _failure(self) -> Exception:
        errors = []
        for rank in range(len(self.procs)):
            try:
                errors.append(json.loads((self.work / f"rank{rank}.error.json").read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue
        usage = [e for e in errors if e.get("kind") == "usage"]
        if usage:
            return UsageError(usage[0]["message"])
        # A rank that loses its peer reports that, not the cause: first the real errors, then ranks that died
        # without a word (a signal, os._exit), and only then the peers' "connection reset".
        peer_loss = ("Connection closed", "Connection reset", "Broken pipe", "timed out", "Timeout")
        primary = [e for e in errors if not any(s in e.get("message", "") for s in peer_loss)]
        if primary:
            e = primary[0]
            return InternalError(f"compare-bn rank {e['rank']} failed: {e['message']}")
        reported = {e.get("rank") for e in errors}
        for rank, p in enumerate(self.procs):
            code = p.returncode
            if rank not in reported and rank not in self.killed and code not in (None, 0):
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                tail = self._log_tail(rank)
                return InternalError(f"compare-bn rank {rank} {how}" + (f": {tail}" if tail else ""))
        if errors:
            e = errors[0]
            return InternalError(f"compare-bn rank {e['rank']} failed: {e['message']}")
        return InternalError("compare-bn ranks failed without a message")

    def _log_tail(self, rank: int) -> str:
        try:
            lines = (self.work / f"rank{rank}.log").read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        lines = [ln.strip() for ln in lines if ln.strip()]
        return lines[-1][:300] if lines else ""


def _exit_cleanly_on_sigterm() -> Any:
    """`timeout`, CI runners and job schedulers stop a command with SIGTERM, whose default action skips
    `finally`: turn it into SystemExit(143) while the ranks run, so they are killed and the work directory goes.
    (SIGKILL cannot be caught; the ranks then die with their parent through PR_SET_PDEATHSIG.)"""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, previous)


def run_compare(cfg: CompareConfig) -> CompareResult:
    """Launch the ranks, supervise them, and analyse what they measured. UsageError/InternalError: one line."""
    shard, rank_lists = _validate(cfg)
    started = time.monotonic()
    deadline = started + cfg.timeout
    cpus = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="ddpdoctor-compare-"))
    ranks = _Ranks(work, cfg.timeout)
    restore_sigterm = _exit_cleanly_on_sigterm()
    try:
        job = {
            "model": cfg.model,
            "data": cfg.data,
            "nproc": cfg.nproc,
            "batch_size": cfg.batch_size,
            "steps": cfg.steps,
            "shard": shard,
            "rank_lists": rank_lists,
            "seed": cfg.seed,
            "device": cfg.device,
            "timeout": cfg.timeout,
            "init_method": (work / "store").resolve().as_uri(),
            "out_dir": str(work),
            "threads": max(1, cpus // cfg.nproc),
            "reference_threads": cpus,
            "parent_pid": os.getpid(),
        }
        job_path = work / "job.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        ranks.start(job_path, cfg.nproc, job["threads"])
        ranks.wait(deadline)
        metas, arrays = _load_results(work, cfg.nproc)
    finally:
        ranks.kill()  # every rank is reaped, whatever happened (a no-op for ranks that already exited)
        shutil.rmtree(work, ignore_errors=True)
        restore_sigterm()
    result = analyse(cfg, shard, metas, arrays)
    return replace(result, timings={**result.timings, "wall_s": round(time.monotonic() - started, 3)})


def _load_results(work: Path, nproc: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    import numpy as np

    metas, arrays = [], []
    for rank in range(nproc):
        try:
            metas.append(json.loads((work / f"rank{rank}.json").read_text(encoding="utf-8")))
            with np.load(work / f"rank{rank}.npz") as npz:
                arrays.append({k: npz[k] for k in npz.files})
        except (OSError, ValueError) as exc:
            raise InternalError(f"compare-bn rank {rank} left no readable result: {exc}") from None
    return metas, arrays


