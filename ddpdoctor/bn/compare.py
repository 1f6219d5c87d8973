"""`ddpdoctor compare-bn`: local BN vs SyncBN vs the exact global-batch BN, per layer, on the same batches.

The question it answers: how far are the running statistics each rank ends up with from what one process would
have computed over the whole global batch, and is the data on the ranks even drawn from the same distribution?

The command launches N rank processes (`ddpdoctor.bn._worker`: gloo on CPU, NCCL on GPUs). They replay one plan
of global batches through local BN with DDP's default buffer broadcast, local BN without it, and SyncBN; rank 0
then runs the exact reference. This process never imports torch: it validates options, launches and supervises
the ranks (a rank that fails ends the run with one line; a timeout kills them all), and turns their measurements
into per-layer errors, the non-i.i.d. test, findings (DD201-DD204) and a verdict.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from ddpdoctor import __version__
from ddpdoctor.errors import InternalError, UsageError
from ddpdoctor.findings import Confidence, Finding, Severity, new_finding, rank_findings
from ddpdoctor.rules.dd202_small_bn_batch import SMALL_BN_BATCH
from ddpdoctor.rules.dd204_syncbn_large_batch import LARGE_SYNC_BATCH

COMPARE_SCHEMA = "ddpdoctor.compare-bn/1"
MODES = ("local", "local_no_broadcast", "sync")
MODE_LABELS = {
    "local": "local BN (DDP default)",
    "local_no_broadcast": "local BN, no broadcast",
    "sync": "SyncBN",
}
# Local running stats this far from the global-batch value are a finding (DD201). Below it, the gap is the
# sampling noise of a per-rank batch, which compare-bn reports in the table without alarm.
LOCAL_ERROR_ALARM = 0.10
SYNC_MATCH = 1e-4  # SyncBN within this of the reference "matches" (float32 round-off is ~1e-7)


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """Options of one comparison (the CLI's flags). `model`/`data` are `MODULE:FACTORY` or None for the demo;
    `shard` is "iid", "sorted" or a path to a JSON file of per-rank index lists."""

    model: str | None = None
    data: str | None = None
    nproc: int = 2
    batch_size: int = 16
    steps: int = 20
    shard: str = "iid"
    seed: int = 0
    device: str = "auto"
    timeout: float = 300.0


@dataclass(frozen=True, kw_only=True)
class LayerComparison:
    layer: str
    kind: str
    features: int
    momentum: float | None
    tracked: bool
    norm_batch: dict[str, int]
    running_mean_rel_err: dict[str, float | None]
    running_var_rel_err: dict[str, float | None]
    # RMS over channels of (running_mean - reference) / sqrt(reference running_var): how far eval-mode outputs
    # shift, in standard deviations. Unlike the relative error it stays meaningful when the means sit near zero.
    running_mean_shift_sd: dict[str, float | None]
    rank_spread: dict[str, dict[str, float | None]]
    noniid_p: float | None = None
    noniid_channel: int | None = None

    def to_json(self) -> dict[str, Any]:
        return _finite(
            {
                "layer": self.layer,
                "kind": self.kind,
                "features": self.features,
                "momentum": self.momentum,
                "track_running_stats": self.tracked,
                "norm_batch": self.norm_batch,
                "running_mean_rel_err": self.running_mean_rel_err,
                "running_var_rel_err": self.running_var_rel_err,
                "running_mean_shift_sd": self.running_mean_shift_sd,
                "rank_spread": self.rank_spread,
                "noniid": {"p_value": self.noniid_p, "channel": self.noniid_channel},
            }
        )


@dataclass(frozen=True, kw_only=True)
class CompareResult:
    config: CompareConfig
    environment: dict[str, Any]
    plan: dict[str, Any]
    layers: tuple[LayerComparison, ...]
    noniid: Any  # ddpdoctor.bn.stats.NonIIDResult
    findings: tuple[Finding, ...]
    verdict: tuple[str, ...]
    timings: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        config = asdict(self.config)
        return _finite(
            {
                "schema": COMPARE_SCHEMA,
                "tool": {"name": "ddpdoctor", "version": __version__},
                "config": config,
                "environment": self.environment,
                "plan": self.plan,
                "layers": [layer.to_json() for layer in self.layers],
                "noniid": self.noniid.to_json(),
                "findings": [f.to_json() for f in rank_findings(self.findings)],
                "verdict": list(self.verdict),
                "timings": self.timings,
            }
        )


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite numbers become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


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


# ---------------------------------------------------------------------------------------------- analysis


def _typical(values: Iterable[int]) -> int:
    counts = Counter(values)
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0] if counts else 0


def analyse(
    cfg: CompareConfig, shard: str, metas: list[dict[str, Any]], arrays: list[dict[str, Any]]
) -> CompareResult:
    """Errors against the reference, rank spread, the non-i.i.d. test, findings and the verdict (numpy only)."""
    import numpy as np

    from ddpdoctor.bn.stats import noniid_test, relative_error

    nproc = len(metas)
    sizes = metas[0]["plan_sizes"]  # [rank][step] samples
    local_sizes = [n for per_rank in sizes for n in per_rank]
    global_sizes = [sum(col) for col in zip(*sizes)]
    ref_arrays = arrays[0]

    layer_means: dict[str, np.ndarray] = {}
    layer_counts: dict[str, np.ndarray] = {}
    n_steps = len(sizes[0])
    for info in metas[0]["layers"]:
        name = info["layer"]
        key = f"moments|{name}|mean"
        if all(key in a and a[key].size for a in arrays):
            calls = min(a[key].shape[0] for a in arrays)
            # A layer called k times per forward (shared BN) records k moments per step; the calls of one step
            # see the same batch, so only the first is an independent replicate.
            stride = calls // n_steps if calls % n_steps == 0 and calls >= n_steps else 1
            layer_means[name] = np.stack([a[key][:calls:stride] for a in arrays])
            layer_counts[name] = np.stack([a[f"moments|{name}|count"][:calls:stride] for a in arrays])
    noniid = noniid_test(layer_means, layer_counts)
    per_layer_test = {t.layer: t for t in noniid.layers}

    layers = []
    for info in metas[0]["layers"]:
        name = info["layer"]
        tracked = f"reference|{name}|running_var" in ref_arrays
        mean_err: dict[str, float | None] = {}
        var_err: dict[str, float | None] = {}
        shift: dict[str, float | None] = {}
        spread: dict[str, dict[str, float | None]] = {"running_mean": {}, "running_var": {}}
        if tracked:
            for stat, errs in (("running_mean", mean_err), ("running_var", var_err)):
                ref = ref_arrays[f"reference|{name}|{stat}"]
                for mode in MODES:
                    per_rank = [a[f"{mode}|{name}|{stat}"] for a in arrays]
                    rel = [relative_error(v, ref) for v in per_rank]
                    worst = max(rel)
                    if mode == "sync":
                        errs["sync"] = worst
                    else:
                        errs[mode] = rel[0]  # rank 0's: what a checkpoint saved by rank 0 holds
                        errs[f"{mode}_worst"] = worst
                    centre = np.mean(per_rank, axis=0)
                    spread[stat][mode] = max(relative_error(v, centre) for v in per_rank)
            ref_mean = ref_arrays[f"reference|{name}|running_mean"]
            ref_sd = np.sqrt(np.maximum(ref_arrays[f"reference|{name}|running_var"], 1e-30))
            for mode in MODES:
                per_rank = [
                    float(np.sqrt(np.mean(((a[f"{mode}|{name}|running_mean"] - ref_mean) / ref_sd) ** 2)))
                    for a in arrays
                ]
                if mode == "sync":
                    shift["sync"] = max(per_rank)
                else:
                    shift[mode] = per_rank[0]
                    shift[f"{mode}_worst"] = max(per_rank)
        spatial = None
        if name in layer_counts and layer_counts[name].shape[1] == n_steps:
            per_sample = layer_counts[name][0] / np.maximum(np.asarray(sizes[0], dtype=float), 1.0)
            spatial = int(round(float(np.median(per_sample))))
        test = per_layer_test.get(name)
        layers.append(
            LayerComparison(
                layer=name,
                kind=info["kind"],
                features=int(info["features"]),
                momentum=info["momentum"],
                tracked=tracked,
                norm_batch={
                    "local": _typical(local_sizes),
                    "sync": _typical(global_sizes),
                    "local_min": min(local_sizes),
                    "sync_min": min(global_sizes),
                    **({"values_per_sample": spatial} if spatial is not None else {}),
                },
                running_mean_rel_err=mean_err,
                running_var_rel_err=var_err,
                running_mean_shift_sd=shift,
                rank_spread=spread,
                noniid_p=None if test is None else test.p_value,
                noniid_channel=None if test is None else test.channel,
            )
        )

    environment = {
        "device": metas[0]["device"],
        "backend": metas[0]["backend"],
        "torch": metas[0]["torch"],
        "nproc": nproc,
        "samples": metas[0]["n_items"],
        "model": cfg.model or "demo (ddpdoctor.bn.demo:demo_model)",
        "data": cfg.data or "demo (ddpdoctor.bn.demo:demo_data)",
    }
    plan = {
        "shard": shard,
        "steps": len(global_sizes),
        "local_batch": _typical(local_sizes),
        "global_batch": _typical(global_sizes),
        "uneven_steps": sum(1 for col in zip(*sizes) if len(set(col)) > 1),
        "global_batch_sizes": global_sizes,
    }
    timings = {f"rank{m['rank']}": m.get("timings", {}) for m in metas}
    findings = tuple(_findings(layers, noniid, plan))
    verdict = tuple(_verdict(layers, noniid, plan))
    return CompareResult(
        config=cfg,
        environment=environment,
        plan=plan,
        layers=tuple(layers),
        noniid=noniid,
        findings=findings,
        verdict=verdict,
        timings=timings,
    )


def _worst(
    layers: Iterable[LayerComparison], key: str, metric: str = "running_var_rel_err"
) -> tuple[LayerComparison | None, float]:
    """The layer where `metric[key]` is largest, and that value (None, 0.0 when no layer has it)."""
    best: tuple[LayerComparison | None, float] = (None, 0.0)
    for layer in layers:
        v = getattr(layer, metric).get(key)
        if v is not None and (best[0] is None or v > best[1]):
            best = (layer, v)
    return best


def fmt_err(x: float | None) -> str:
    """Relative errors the way people read them: percentages when large, powers of ten when tiny."""
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    if x >= 1e-3:
        return f"{100 * x:.3g}%"
    return f"{x:.1e}"


def fmt_p(p: float | None) -> str:
    if p is None:
        return "-"
    if p == 0:
        return "<1e-300"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


@dataclass(frozen=True)
class _Summary:
    """The headline numbers every part of the output quotes, computed once."""

    var_layer: LayerComparison | None
    var_local: float  # rank 0 under DDP's default broadcast
    var_no_broadcast: float  # worst rank without broadcast
    shift_layer: LayerComparison | None
    shift_local: float  # worst of rank 0 / no-broadcast ranks, in reference standard deviations
    mean_layer: LayerComparison | None
    mean_local: float
    sync: float  # worst SyncBN relative error over layers, mean and var
    spread_no_broadcast: float
    broadcast_is_rank0: bool  # DDP's broadcast leaves rank 0 with exactly its own local statistics

    @property
    def local_worst(self) -> float:
        return max(self.var_local, self.var_no_broadcast)


def _summary(layers: list[LayerComparison]) -> _Summary:
    tracked = [layer for layer in layers if layer.tracked]
    var_layer, var_local = _worst(tracked, "local")
    _, var_nb = _worst(tracked, "local_no_broadcast_worst")
    shift_layer, shift = _worst(tracked, "local_no_broadcast_worst", "running_mean_shift_sd")
    _, shift0 = _worst(tracked, "local", "running_mean_shift_sd")
    mean_layer, mean_local = _worst(tracked, "local", "running_mean_rel_err")
    _, sync_var = _worst(tracked, "sync")
    _, sync_mean = _worst(tracked, "sync", "running_mean_rel_err")
    spread = max((lay.rank_spread["running_var"].get("local_no_broadcast") or 0.0 for lay in tracked), default=0.0)
    same = bool(tracked) and all(
        lay.running_var_rel_err.get("local") == lay.running_var_rel_err.get("local_no_broadcast")
        and lay.running_mean_rel_err.get("local") == lay.running_mean_rel_err.get("local_no_broadcast")
        for lay in tracked
    )
    return _Summary(
        var_layer=var_layer, var_local=var_local, var_no_broadcast=var_nb,
        shift_layer=shift_layer, shift_local=max(shift, shift0),
        mean_layer=mean_layer, mean_local=mean_local,
        sync=max(sync_var, sync_mean), spread_no_broadcast=spread, broadcast_is_rank0=same,
    )


def _findings(layers: list[LayerComparison], noniid: Any, plan: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    s = _summary(layers)
    local_batch, global_batch = plan["local_batch"], plan["global_batch"]
    sources = ("compare-bn",)

    if s.var_layer is not None and (s.local_worst >= LOCAL_ERROR_ALARM or s.shift_local >= LOCAL_ERROR_ALARM):
        big = s.local_worst >= 2.5 * LOCAL_ERROR_ALARM or s.shift_local >= 2.5 * LOCAL_ERROR_ALARM
        mean_part = (
            f"; running_mean is off by {s.shift_local:.2g} standard deviations in {s.shift_layer.layer}"
            if s.shift_layer is not None and s.shift_local >= LOCAL_ERROR_ALARM / 2
            else ""
        )
        out.append(
            new_finding(
                "DD201",
                severity=Severity.MEDIUM if big or noniid.non_iid else Severity.LOW,
                confidence=Confidence.CERTAIN,
                sources=sources,
                message=(
                    f"local BN running_var is {fmt_err(s.var_local)} off the global-batch value in "
                    f"{s.var_layer.layer} (rank 0's, which DDP's buffer broadcast hands to every rank; without "
                    f"the broadcast ranks differ by {fmt_err(s.spread_no_broadcast)} and the worst is "
                    f"{fmt_err(s.var_no_broadcast)} off){mean_part}; SyncBN matches to {fmt_err(s.sync)}"
                ),
                evidence={
                    "layer": s.var_layer.layer,
                    "running_var_rel_err": s.var_layer.running_var_rel_err,
                    "running_mean_rel_err": s.var_layer.running_mean_rel_err,
                    "running_mean_shift_sd": s.var_layer.running_mean_shift_sd,
                    "rank_spread_running_var_no_broadcast": s.spread_no_broadcast,
                    "local_batch": local_batch,
                    "global_batch": global_batch,
                },
                fix_variant="compare_bn",
                magnitude=min(1e9, max(s.local_worst, s.shift_local)),
            )
        )
    if local_batch < SMALL_BN_BATCH:
        out.append(
            new_finding(
                "DD202",
                confidence=Confidence.CERTAIN,
                sources=sources,
                message=(
                    f"local BN normalises over {local_batch} samples per rank (global batch {global_batch}): "
                    f"statistics of so few samples are noisy; SyncBN would normalise over {global_batch}"
                ),
                evidence={"local_batch": local_batch, "global_batch": global_batch, "threshold": SMALL_BN_BATCH},
                fix_variant="compare_bn",
                magnitude=float(SMALL_BN_BATCH - local_batch),
            )
        )
    if noniid.non_iid:
        out.append(
            new_finding(
                "DD203",
                confidence=Confidence.CERTAIN if noniid.p_value < 1e-6 else Confidence.LIKELY,
                sources=sources,
                message=(
                    f"shards are not i.i.d.: per-rank BN input means differ beyond sampling noise "
                    f"(p={fmt_p(noniid.p_value)}, strongest in {noniid.layer} channel {noniid.channel}, "
                    f"{plan['shard']} shards)"
                ),
                evidence=_finite(noniid.to_json()),
                fix_variant="compare_bn",
                magnitude=min(300.0, -math.log10(max(noniid.p_value, 1e-300))),
            )
        )
    if local_batch >= LARGE_SYNC_BATCH and noniid.p_value is not None and not noniid.non_iid:
        out.append(
            new_finding(
                "DD204",
                confidence=Confidence.LIKELY,
                sources=sources,
                message=(
                    f"per-rank batch {local_batch} >= {LARGE_SYNC_BATCH} on i.i.d. shards "
                    f"(p={fmt_p(noniid.p_value)}): local BN running_var is within {fmt_err(s.local_worst)} of "
                    f"the global-batch value, so SyncBN adds communication and removes BN's regularising batch "
                    f"noise for no statistical gain"
                ),
                evidence={"local_batch": local_batch, "global_batch": global_batch,
                          "noniid_p": noniid.p_value, "local_running_var_rel_err": s.local_worst},
                fix_variant="compare_bn",
                magnitude=float(local_batch),
            )
        )
    return rank_findings(out)


def _verdict(layers: list[LayerComparison], noniid: Any, plan: dict[str, Any]) -> list[str]:
    """Plain words: the headline sentence first, then what explains it."""
    s = _summary(layers)
    parts: list[str] = []
    if s.var_layer is None:
        parts.append("no BN layer tracks running statistics (track_running_stats=False), so nothing accumulates")
    else:
        parts.append(f"local BN running_var is {fmt_err(s.var_local)} off the global-batch value in {s.var_layer.layer}")
        if s.sync <= SYNC_MATCH:
            parts.append(f"SyncBN matches to {fmt_err(s.sync)}")
        else:
            parts.append(f"SyncBN is {fmt_err(s.sync)} off (the model's forward is not deterministic across processes)")
    if noniid.p_value is None:
        parts.append(f"the non-i.i.d. test could not run ({noniid.reason})")
    elif noniid.non_iid:
        parts.append(f"shards are not i.i.d. (p={fmt_p(noniid.p_value)}): use SyncBN or fix the sharding")
    else:
        parts.append(f"shards look i.i.d. (p={fmt_p(noniid.p_value)})")
    lines = ["; ".join(parts) + "."]
    if s.var_layer is not None:
        if s.shift_layer is not None and s.shift_local >= LOCAL_ERROR_ALARM / 2:
            lines.append(
                f"local running_mean is off by {s.shift_local:.2g} standard deviations in {s.shift_layer.layer}: "
                "eval-mode outputs of that layer shift by that much."
            )
        if s.broadcast_is_rank0:
            lines.append(
                "DDP's buffer broadcast does not average anything: rank 0 ends with exactly the statistics of its "
                "own batches, and every other rank gets them at the next forward."
            )
        if noniid.p_value is not None and not noniid.non_iid and s.local_worst < LOCAL_ERROR_ALARM:
            lines.append(
                f"the local error is the sampling noise of {plan['local_batch']}-sample batches; SyncBN is not "
                "needed for the statistics at this batch size."
                if plan["local_batch"] >= SMALL_BN_BATCH
                else f"the local error is the sampling noise of {plan['local_batch']}-sample batches."
            )
    return lines


# -------------------------------------------------------------------------------------------- rendering


def render_compare(result: CompareResult, fmt: str, *, color: bool = False) -> str:
    """`text`: a table per layer, a bar chart of running_var errors, findings and the verdict; `json`: the
    `ddpdoctor.compare-bn/1` document."""
    if fmt == "json":
        return json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n"
    if fmt != "text":
        raise UsageError(f"--format: {fmt!r} is not one of text, json")
    return _render_text(result, color=color)


def _bar(x: float | None, width: int, lo: float = 1e-8, hi: float = 1.0) -> str:
    """A log-scale bar from `lo` (empty) to `hi` (full), in eighths of a cell."""
    if x is None or not x > 0:
        return ""
    frac = (math.log10(max(min(x, hi), lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    eighths = max(1, round(frac * width * 8))
    full, rest = divmod(eighths, 8)
    return "█" * full + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[rest]


def _describe(spec: str | None, demo: str) -> str:
    return spec if spec else demo


def _render_text(result: CompareResult, *, color: bool) -> str:
    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    width = max(100, min(160, shutil.get_terminal_size((132, 24)).columns)) if color else 132
    buf = io.StringIO()
    console = Console(
        file=buf, width=width, color_system="standard" if color else None, force_terminal=color,
        highlight=False, emoji=False, markup=False,
    )
    env, plan = result.environment, result.plan
    n_bn = len(result.layers)
    console.print(
        Text.assemble(
            ("compare-bn ", "bold"),
            f"{_describe(result.config.model, 'demo model')} ({n_bn} BN layers) on "
            f"{_describe(result.config.data, 'demo data')} ({env['samples']} samples): {env['nproc']} ranks x "
            f"batch {plan['local_batch']} = global batch {plan['global_batch']}, {plan['steps']} train-mode "
            f"forwards, {plan['shard']} shards, {env['device']}/{env['backend']}",
        )
    )
    if plan.get("uneven_steps"):
        console.print(f"{plan['uneven_steps']} of {plan['steps']} steps had uneven per-rank batch sizes.")

    table = Table(
        title="running statistics vs the exact global-batch BN (relative L2 error over channels)",
        title_justify="left", header_style="bold",
    )
    for header, justify in (
        ("layer", "left"), ("C", "right"), ("batch\nloc/sync", "right"),
        ("var err\nlocal", "right"), ("var err\nno-bcast", "right"), ("var err\nSyncBN", "right"),
        ("mean err\nlocal", "right"), ("mean err\nno-bcast", "right"), ("mean err\nSyncBN", "right"),
        ("mean shift\nlocal (sd)", "right"), ("var spread\nno-bcast", "right"), ("non-iid\np", "right"),
    ):
        table.add_column(header, justify=justify, no_wrap=True)
    for layer in result.layers:
        m, v, sh = layer.running_mean_rel_err, layer.running_var_rel_err, layer.running_mean_shift_sd
        shift = max((x for x in (sh.get("local"), sh.get("local_no_broadcast_worst")) if x is not None), default=None)
        table.add_row(
            layer.layer,
            str(layer.features),
            f"{layer.norm_batch['local']}/{layer.norm_batch['sync']}",
            _styled(v.get("local")),
            _styled(v.get("local_no_broadcast_worst")),
            _styled(v.get("sync")),
            fmt_err(m.get("local")),
            fmt_err(m.get("local_no_broadcast_worst")),
            fmt_err(m.get("sync")),
            "-" if shift is None else f"{shift:.2g}",
            fmt_err(layer.rank_spread["running_var"].get("local_no_broadcast")),
            Text(fmt_p(layer.noniid_p), style="bold red" if (layer.noniid_p is not None and layer.noniid_p < 1e-3) else ""),
        )
    console.print(table)
    console.print(
        Padding(
            "local = rank 0 under DDP's default buffer broadcast (what a rank-0 checkpoint holds); no-bcast = the "
            "worst rank with broadcast_buffers=False; SyncBN = the worst rank; mean shift = RMS over channels of "
            "the running_mean error in reference standard deviations; spread = the largest distance of a rank "
            "from the ranks' average.",
            (0, 0, 1, 0),
        )
    )

    console.print(Text("running_var error vs the global batch (log scale: empty = 1e-8, full = 100%)", style="bold"))
    name_w = max((len(layer.layer) for layer in result.layers), default=5)
    bar_w = 32
    for layer in result.layers:
        if not layer.tracked:
            console.print(f"  {layer.layer:<{name_w}}  (no running statistics)")
            continue
        for i, (label, key) in enumerate((("local", "local"), ("no-bcast", "local_no_broadcast_worst"), ("SyncBN", "sync"))):
            x = layer.running_var_rel_err.get(key)
            style = "green" if key == "sync" else ("red" if (x or 0) >= LOCAL_ERROR_ALARM else "yellow")
            console.print(
                Text.assemble(
                    f"  {layer.layer if i == 0 else '':<{name_w}}  {label:<8} ",
                    (f"{_bar(x, bar_w):<{bar_w + 1}}", style),
                    f" {fmt_err(x)}",
                )
            )

    n = result.noniid
    console.print()
    console.print(Text("non-i.i.d. test", style="bold"))
    if n.p_value is None:
        console.print(Padding(f"not run: {n.reason}", (0, 0, 0, 2)))
    else:
        strongest = next((t for t in n.layers if t.layer == n.layer), None)
        f_text = ""
        if strongest is not None and strongest.channel_f is not None:
            f_text = f", F({strongest.df_rank}, {strongest.df_residual}) = {strongest.channel_f:.3g}"
        console.print(
            Padding(
                f"p = {fmt_p(n.p_value)} over {len(n.layers)} layers, {n.ranks} ranks x {n.steps} steps; strongest: "
                f"{n.layer} channel {n.channel}{f_text}\nmethod: {n.method}",
                (0, 0, 0, 2),
            )
        )

    if result.findings:
        console.print()
        console.print(Text("findings", style="bold"))
        for f in rank_findings(result.findings):
            console.print(
                Padding(Text.assemble((f"{f.rule} {f.name}", "bold"), f" ({f.severity.label}): ", f.message), (0, 0, 0, 2))
            )
            console.print(Padding(f"fix: {f.fix}", (0, 0, 0, 4)))
    console.print()
    console.print(Text("verdict", style="bold"))
    for line in result.verdict:
        console.print(Padding(line, (0, 0, 0, 2)))
    # rich pads every line to the console width; trailing blanks only get in the way of diffs and pagers
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def _styled(x: float | None) -> Any:
    from rich.text import Text

    if x is None:
        return "-"
    style = "red" if x >= LOCAL_ERROR_ALARM else ("green" if x <= SYNC_MATCH else "")
    return Text(fmt_err(x), style=style)
