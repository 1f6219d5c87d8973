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
into per-layer errors, the non-i.i.d. test, findings (DD201-DD204) and a verdict (`ddpdoctor.comparebn.analysis`), which
`ddpdoctor.report.compare_bn` renders.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddpdoctor.comparebn.analysis import CompareConfig, CompareResult, analyse
from ddpdoctor.errors import InternalError, UsageError, is_peer_error
from ddpdoctor.probe.progress import REFRESH_S
from ddpdoctor.probe.supervisor import (
    Command,
    Stopped,
    Supervisor,
    hold_signals,
    restore_signals,
    trap_stop_signals,
)

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
    from ddpdoctor.config import check_count, check_nproc, check_seconds, check_seed

    if isinstance(cfg.nproc, int) and cfg.nproc < 2:
        raise UsageError("--nproc must be at least 2: compare-bn compares what ranks compute")
    check_nproc(cfg.nproc, low=2)  # the same bounds as every command that launches ranks
    check_count("--batch-size", cfg.batch_size)
    check_count("--steps", cfg.steps)
    check_seconds("--timeout", cfg.timeout)
    check_seed(cfg.seed)
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


def _factory_file(spec: str | None) -> Path | None:
    """The file a MODULE:FACTORY names, found without importing it: a .py path, else the dotted module's file
    under the current directory or sys.path (a package's __init__.py)."""
    if spec is None:
        return None
    module_part, sep, _ = spec.rpartition(":")
    if not sep or not module_part:
        return None
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
        return Path(module_part)
    rel = Path(*module_part.split("."))
    for base in (Path.cwd(), *(Path(p) for p in sys.path if p)):
        for candidate in (base / rel.with_suffix(".py"), base / rel / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def output_guards(cfg: CompareConfig) -> list[tuple[Path, str]]:
    """What `compare-bn --output` must never overwrite: the model's and the data's modules, the shard file."""
    protect: list[tuple[Path, str]] = []
    for spec, what in ((cfg.model, "the --model module"), (cfg.data, "the --data module")):
        path = _factory_file(spec)
        if path is not None:
            protect.append((path, what))
    if cfg.shard.strip().lower() not in ("iid", "sorted"):
        protect.append((Path(cfg.shard.strip()), "the --shard file"))
    return protect


def validate(cfg: CompareConfig) -> CompareConfig:
    """Everything a comparison checks before it launches anything (one-line UsageError)."""
    _validate(cfg)
    return cfg


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
    """The rank processes of one comparison, started and stopped by the probe's supervisor
    (`ddpdoctor.probe.supervisor`): the same kill, timeout and signal path as a probe run, so no rank outlives the
    command however it ends, and the work directory goes with them."""

    def __init__(self, work: Path, timeout: float) -> None:
        self.work = work
        self.timeout = timeout
        self.supervisor: Supervisor | None = None
        self.killed: set[int] = set()  # ranks we stopped ourselves (their SIGKILL is not their failure)
        self.returncodes: list[int | None] = []

    def start(self, job_path: Path, nproc: int, threads: int, deadline: float) -> None:
        from ddpdoctor.probe.launcher import scratch_dir

        env = dict(os.environ)
        # the ranks' temporary files (multiprocessing's pymp-* folders of a model factory's forkserver pool, which
        # a rank ending with os._exit never removes) go to a folder of ours, removed with the ranks
        scratch = scratch_dir()
        for key in ("TMPDIR", "TEMP", "TMP"):
            env[key] = scratch
        env.setdefault("OMP_NUM_THREADS", str(threads))
        env["PYTHONUNBUFFERED"] = "1"
        lo = _loopback_interface()
        if lo and "GLOO_SOCKET_IFNAME" not in env:
            env["GLOO_SOCKET_IFNAME"] = lo  # rendezvous and traffic stay on this machine
        logs = [str(self.work / f"rank{rank}.log") for rank in range(nproc)]
        commands = [
            Command(argv=[sys.executable, "-m", "ddpdoctor.bn._worker", str(job_path), str(rank)], stdout=log,
                    stderr=log)
            for rank, log in enumerate(logs)
        ]
        self.supervisor = Supervisor(
            commands, env=env, cwd=os.getcwd(), tag=uuid.uuid4().hex,
            deadline=time.time() + max(0.0, deadline - time.monotonic()), scratch=[str(self.work), scratch],
        ).start()
        self.returncodes = [None] * nproc

    def wait(self, deadline: float, progress: Any = None) -> None:
        """Until every rank exited 0 (else one-line errors); `progress` (ddpdoctor.comparebn.progress.PhaseDisplay) is
        updated with the ranks' phases every REFRESH_S."""
        assert self.supervisor is not None
        shown = 0.0
        while True:
            codes = self.supervisor.poll()
            if progress is not None and time.monotonic() - shown >= REFRESH_S:
                progress.update(self.phase_list())
                shown = time.monotonic()
            if all(c == 0 for c in codes):
                return
            if any(c not in (None, 0) for c in codes) or not self.supervisor.running:
                # let the peers that hit the same problem report it (a usage error reaches all ranks at once)
                grace = min(time.monotonic() + 1.0, deadline)
                while time.monotonic() < grace and any(c is None for c in self.supervisor.poll()):
                    time.sleep(0.02)
                said = self._said()  # before stop: the supervisor removes the work directory with the ranks
                raise self._failure(self.stop(), *said)
            if time.monotonic() > deadline:
                phases = self._phases()
                self.stop()
                raise UsageError(
                    f"compare-bn did not finish within --timeout {self.timeout:g} s; ranks were at: {phases}"
                )
            time.sleep(0.02)

    def stop(self) -> list[int | None]:
        """Stop whatever still runs (a no-op once stopped); the ranks' return codes."""
        if self.supervisor is not None:
            final = self.supervisor.stop()
            killed = set(final.get("killed") or ())
            self.killed = {rank for rank, pid in enumerate(final.get("pids") or ()) if pid in killed}
            self.returncodes = list(final.get("returncodes") or self.returncodes)
            self.supervisor = None
        return self.returncodes

    def phase_list(self) -> list[str]:
        """What each rank says it is doing (its `rank{r}.phase` file); "" before it says, or while it rewrites it."""
        out = []
        for rank in range(len(self.returncodes)):
            try:
                text = (self.work / f"rank{rank}.phase").read_text(encoding="utf-8").strip()
            except OSError:
                text = ""
            out.append(text)
        return out

    def _phases(self) -> str:
        return "; ".join(f"rank {rank}: {text or 'starting'}" for rank, text in enumerate(self.phase_list()))

    def _said(self) -> tuple[list[dict[str, Any]], dict[int, str]]:
        """What the ranks left to read: their one-line errors, and the last line of each rank's log."""
        errors = []
        for rank in range(len(self.returncodes)):
            try:
                errors.append(json.loads((self.work / f"rank{rank}.error.json").read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue
        return errors, {rank: self._log_tail(rank) for rank in range(len(self.returncodes))}

    def _failure(self, returncodes: list[int | None], errors: list[dict[str, Any]], tails: dict[int, str]) -> Exception:
        usage = [e for e in errors if e.get("kind") == "usage"]
        if usage:
            return UsageError(usage[0]["message"])
        # A rank that loses its peer reports that, not the cause: first the real errors, then ranks that died
        # without a word (a signal, os._exit), and only then the peers' "connection reset".
        primary = [e for e in errors if not is_peer_error(e.get("message", ""))]
        if primary:
            e = primary[0]
            return InternalError(f"compare-bn rank {e['rank']} failed: {e['message']}")
        reported = {e.get("rank") for e in errors}
        for rank, code in enumerate(returncodes):
            if rank not in reported and rank not in self.killed and code not in (None, 0):
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                tail = tails.get(rank, "")
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


def run_compare(cfg: CompareConfig, *, quiet: bool = True) -> CompareResult:
    """Launch the ranks, supervise them, and analyse what they measured. UsageError/InternalError: one line;
    Ctrl-C, SIGTERM or SIGHUP stop the ranks and end as KeyboardInterrupt. Unless `quiet`, the ranks' phases
    are shown on stderr while they run (ddpdoctor.comparebn.progress)."""
    shard, rank_lists = _validate(cfg)
    progress = None
    started = time.monotonic()
    deadline = started + cfg.timeout
    cpus = os.cpu_count() or 1
    previous = trap_stop_signals()
    try:
        # removed even if this process is killed: the guard runs before the folder exists
        work, guard = Supervisor.guarded_tempdir("ddpdoctor-compare-")
    except BaseException:
        restore_signals(previous)
        raise
    ranks = _Ranks(work, cfg.timeout)
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
        }
        job_path = work / "job.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        if not quiet:
            from ddpdoctor.comparebn.progress import PhaseDisplay

            progress = PhaseDisplay(f"compare-bn: {cfg.nproc} ranks × batch {cfg.batch_size}, {cfg.steps} steps per "
                                    f"BN mode, {shard} shards",
                                    nproc=cfg.nproc, timeout=cfg.timeout)
        ranks.start(job_path, cfg.nproc, job["threads"], deadline)
        ranks.wait(deadline, progress)
        if progress is not None:
            progress.close()
        metas, arrays = _load_results(work, cfg.nproc)
    except Stopped:
        raise KeyboardInterrupt from None
    finally:
        if progress is not None:
            progress.close(ok=False)  # a failure: its one-line error says the rest
        held = hold_signals(previous)  # a Ctrl-C or SIGTERM during the clean-up is kept for after it
        try:
            ranks.stop()  # every rank is gone, whatever happened (a no-op for ranks that already exited)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            guard.stop()
            held.release()
    held.raise_received()
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


