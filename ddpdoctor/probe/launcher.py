"""Launch the probe: the user's unmodified script on N ranks through torch.distributed.run (or once, for a script
that spawns its own ranks), instrumented, into a run directory — within a timeout, leaving no process behind.

    ddpdoctor process ──► python -m ddpdoctor.probe.agent  (torch.distributed.run's elastic agent, own session)
                              └─► N × python -m ddpdoctor.probe.bootstrap SCRIPT ARGS   (RANK, LOCAL_RANK, ...)
    or, for a self-spawning script:
    ddpdoctor process ──► python -m ddpdoctor.probe.bootstrap SCRIPT ARGS ──► its mp.spawn children
    or, for a single-process script (nn.DataParallel, mode "single"): the bootstrap once, as `python train.py`
                                                                              (instrumented by sitecustomize)

Decisions:
- `-m ddpdoctor.probe.bootstrap` under torchrun (not --no-python, not --run-path): a fresh interpreter per rank,
  the real env contract, runpy semantics inside; rendezvous on 127.0.0.1 with a free port chosen here
  (`--master_port 0` hangs), `--max_restarts 0`.
- The user's output never reaches our stdout (it would garble the report, JSON included): elastic redirects each
  rank's stdout/stderr into RUN/logs/rank<r>.{stdout,stderr}; the report shows tails in DD902/DD901 evidence.
- Timeout: every instrumented process dumps its Python stacks into the run directory a moment before it
  (faulthandler's timer: no signal), then the supervisor (ddpdoctor.probe.supervisor) stops the whole run. The
  timeout covers everything from the start of `run_probe`, a relaunch included. The poll loop that watches a
  launch (timeout, stack dumps, signals held during the clean-up) is ddpdoctor.probe.watch, shared with
  ddpdoctor.probe.shared.
- The mode follows what the script does with the given arguments (ddpdoctor.probe.plan). A script started once
  whose main process turns out to need a launcher leaves with launch_check.RELAUNCH_EXIT_CODE before any
  rendezvous; it is started again under torchrun (the first launch's events and output are dropped, its
  decision is kept in meta.json `plan.runtime_decision` and launcher.json `first_launch`).
- The script's own rendezvous (a `tcp://host:port` init method, MASTER_PORT set by a self-spawning script) is
  moved to a free port chosen here (settings.rendezvous_port): a fixed port could collide with another job on
  the machine, or join its rendezvous.
- The run directory is a complete input: the script is copied into RUN/source/ before the launch, and every user
  file the run names (sites, tracebacks, stacks) after it (ddpdoctor.probe.sources), so `ddpdoctor report RUN`
  reads the same source on a machine where the user's tree is not.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from ddpdoctor import WITHOUT_CWD
from ddpdoctor.config import CheckConfig
from ddpdoctor.errors import InternalError, UsageError
from ddpdoctor.events import (
    EVENTS_DIR,
    LAUNCHER_FILE,
    LOGS_DIR,
    META_FILE,
    SCHEMA,
    STATIC_FILE,
    default_host,
)
from ddpdoctor.findings import Finding
from ddpdoctor.live import Neighbours
from ddpdoctor.probe.agent import AGENT_FILE
from ddpdoctor.probe.plan import LaunchPlan, plan_for_file
from ddpdoctor.probe.rundir import RunDirClaim, claim_for_check
from ddpdoctor.probe.settings import RUN_TAG_ENV, ProbeSettings
from ddpdoctor.probe.site import site_dir
from ddpdoctor.probe.sources import snapshot, snapshot_run
from ddpdoctor.probe.supervisor import Command, Supervisor
from ddpdoctor.probe.usertree import changes as tree_changes
from ddpdoctor.probe.usertree import fingerprint
from ddpdoctor.probe.watch import (
    STACK_LEAD,
    STACK_WAIT,
    drop_empty_stacks,
    dumped_stacks,
    ranks_exited,
    watch,
)
from ddpdoctor.records import LaunchEnd, LaunchMode, LaunchRecord, RunMeta, StaticRecord
from ddpdoctor.world import WORLD_ENV


@dataclass(frozen=True, kw_only=True)
class ProbeOutcome:
    run_dir: Path
    mode: LaunchMode
    returncode: int | None
    end: LaunchEnd
    wall_seconds: float

    @property
    def timed_out(self) -> bool:
        return self.end is LaunchEnd.TIMED_OUT


def free_port(avoid: int | None = None) -> int:
    for _ in range(16):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != avoid:
            return port
    return port


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)


def meta_for(cfg: CheckConfig, plan: LaunchPlan, mode: LaunchMode) -> RunMeta:
    return RunMeta(
        keep_run=str(cfg.keep_run) if cfg.keep_run is not None else None,
        schema=SCHEMA,
        mode=mode,
        script=str(cfg.script),
        script_abs=str(Path(cfg.script).resolve()),
        args=tuple(cfg.script_args),
        cwd=os.getcwd(),
        nproc=cfg.nproc,
        epochs=cfg.epochs,
        steps=cfg.steps,
        timeout=cfg.timeout,
        device=cfg.device,
        base_lr=cfg.base_lr,
        base_batch=cfg.base_batch,
        lr_scaling=cfg.lr_scaling,
        small_bn_batch=cfg.small_bn_batch,
        legacy_local_rank_arg=plan.local_rank_option,
        plan=plan.to_json(),
        python=sys.version.split()[0],
        host=default_host(),
        started=time.time(),
    )


def _require_cuda(ranks: int, timeout: float = 120.0) -> None:
    """--device cuda runs each rank on a GPU of its own (NCCL refuses two ranks on one device): this node must see
    one per rank, else a one-line usage error before anything is launched."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", WITHOUT_CWD + "import torch; print(torch.cuda.device_count())"],
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise UsageError(f"--device cuda: checking for CUDA devices took more than {timeout:.0f} s") from None
    if probe.returncode != 0 or not probe.stdout.strip().isdigit() or int(probe.stdout.strip()) == 0:
        raise UsageError("--device cuda: no CUDA device is visible (use --device cpu to emulate CUDA on CPU)")
    visible = int(probe.stdout.strip())
    if visible < ranks:
        raise UsageError(f"--device cuda --nproc {ranks}: {visible} CUDA device(s) visible, one per rank is needed "
                         f"(use --nproc {visible}, or --device cpu/auto to emulate CUDA on CPU)")


def _command(mode: LaunchMode, cfg: CheckConfig, run_dir: Path, port: int,
             rank_module: str = "ddpdoctor.probe.bootstrap", log_dir: Path | None = None) -> list[str]:
    script_args = [str(cfg.script), *cfg.script_args]
    if mode.starts_once:
        return [sys.executable, "-u", "-m", "ddpdoctor.probe.bootstrap", *script_args]
    return [
        sys.executable, "-m", "ddpdoctor.probe.agent",
        "--nnodes", "1",
        "--nproc-per-node", str(cfg.nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(port),
        "--max-restarts", "0",
        "--monitor-interval", "0.05",
        "--shutdown-timeout", "3",
        "--log-dir", str(log_dir or run_dir / LOGS_DIR / "elastic"),
        "--redirects", "3",
        "-m", rank_module,
        *script_args,
    ]


def _environment(settings: ProbeSettings, port: int, scratch: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("DDPDOCTOR_")]:
        del env[key]
    # a launcher contract inherited from an outer job (torchrun, an srun allocation, mpirun) must not leak into ours
    for key in WORLD_ENV:
        env.pop(key, None)
    env.update(settings.to_env())
    env[RUN_TAG_ENV] = settings.run_tag
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(port)
    # the run's temporary files (multiprocessing's pymp-* folders and sockets, elastic's error files, the
    # script's own tempfile use) go to a folder of the run, removed with it whatever happens
    for key in ("TMPDIR", "TEMP", "TMP"):
        env[key] = scratch
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([site_dir(), *entries])
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a segfaulting rank leaves its Python stack in its stderr
    return env


def _collect_logs(run_dir: Path) -> None:
    """Elastic writes logs/elastic/<run id>/attempt_0/<local rank>/{stdout,stderr}.log; keep them as
    logs/rank<r>.{stdout,stderr} (one node: global rank = local rank)."""
    base = run_dir / LOGS_DIR / "elastic"
    if not base.is_dir():
        return
    for log in base.glob("*/attempt_*/*/*.log"):
        local_rank = log.parent.name
        if local_rank.isdigit() and log.stem in ("stdout", "stderr"):
            os.replace(log, run_dir / LOGS_DIR / f"rank{local_rank}.{log.stem}")
    shutil.rmtree(base, ignore_errors=True)


# AF_UNIX socket paths hold 107 bytes; multiprocessing puts its listeners at TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX
# (33 more), and DataLoader workers sharing tensors use them. The run's TMPDIR is our scratch folder inside the
# user's: a long TMPDIR that works for the script alone must still work under the probe (a 58-character one made
# the workers hang until the timeout).
_SOCKET_PATH_MAX = 107
_MP_SOCKET_TAIL = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def scratch_dir() -> str:
    """The run's TMPDIR: a short-named folder in the user's temporary directory, or in /tmp when that would make
    multiprocessing's socket paths too long (the folder is removed with the run either way). compare-bn's ranks
    get one too."""
    prefix = "ddpd-"
    base = tempfile.gettempdir()
    if len(os.path.join(base, prefix + "x" * 8)) + _MP_SOCKET_TAIL > _SOCKET_PATH_MAX and os.access("/tmp", os.W_OK):
        base = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def _launch_once(
    cfg: CheckConfig, run_dir: Path, settings: ProbeSettings, deadline: float, progress: Any = None,
    neighbours: Neighbours | None = None,
) -> LaunchRecord:
    mode = settings.mode
    port = free_port()
    if mode.starts_once:
        # nothing of ours listens on MASTER_PORT in spawn mode: the script's own rendezvous may use it
        settings = replace(settings, rendezvous_port=port)
    else:  # torchrun's agent hosts its store on MASTER_PORT: the script's tcp:// rendezvous needs another port
        settings = replace(settings, rendezvous_port=free_port(avoid=port))
    # wall-clock moment of the timeout, for the processes of the run (they do not share our monotonic clock)
    timeout_at = time.time() + max(0.0, deadline - time.monotonic())
    scratch = scratch_dir()
    try:  # until `watch` owns it (it removes it however the run ends), the scratch folder is ours to remove
        settings = replace(settings, stacks_at=timeout_at - STACK_LEAD, scratch=scratch)
        cmd = _command(mode, cfg, run_dir, port)
        env = _environment(settings, port, scratch)
        logs = run_dir / LOGS_DIR
        who = "main" if mode.starts_once else "agent"
        started = time.time()
        t0 = time.monotonic()
        supervisor = Supervisor(
            [Command(argv=cmd, stdout=str(logs / f"{who}.stdout"), stderr=str(logs / f"{who}.stderr"))],
            env=env,
            cwd=os.getcwd(),
            tag=settings.run_tag,
            deadline=timeout_at + STACK_WAIT,
            scratch=[scratch],
            log=str(logs / "supervisor.stderr"),
        )
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise

    def ended() -> LaunchEnd | None:
        return None if supervisor.poll()[0] is None and supervisor.running else LaunchEnd.EXITED

    def all_ranks_gone(polls: int) -> LaunchEnd | None:
        if not mode.starts_once and polls % 4 == 0 and ranks_exited(run_dir, cfg.nproc):
            # every rank recorded its exit and is gone: the agent's own shutdown (rendezvous teardown, ~1 s)
            # tells us nothing more
            return LaunchEnd.RANKS_EXITED
        return None

    watched = watch(run_dir=run_dir, deadline=deadline, scratch=scratch, start=supervisor.start, ended=ended,
                    tick=all_ranks_gone, clean_up=lambda _end: supervisor.stop(), progress=progress,
                    neighbours=neighbours)
    end, dumped, stopped = watched.end, watched.dumped, watched.stopped
    finished_early = end is LaunchEnd.RANKS_EXITED
    if not end.stopped and stopped.get("reason") == "deadline":
        # the supervisor's own deadline ended the run while this process was not looking (stopped with Ctrl-Z or
        # SIGSTOP past the timeout, then resumed): the ranks ran on meanwhile, so the run timed out all the same
        end = LaunchEnd.TIMED_OUT
        dumped = dumped_stacks(run_dir)
    _collect_logs(run_dir)
    drop_empty_stacks(run_dir)
    supervisor_log = logs / "supervisor.stderr"
    if supervisor_log.is_file() and supervisor_log.stat().st_size == 0:
        supervisor_log.unlink()
    agent = None
    agent_file = run_dir / AGENT_FILE
    if agent_file.is_file():
        try:
            agent = json.loads(agent_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            agent = None
        agent_file.unlink(missing_ok=True)
    returncode = stopped["returncodes"][0]
    return LaunchRecord(
        mode=mode,
        command=tuple(cmd),
        port=port,
        rendezvous_port=settings.rendezvous_port,
        returncode=returncode,
        stopped_by_probe=stopped["pids"][0] in stopped.get("killed", ()),
        **end.flags(timed_out=watched.timed_out),
        timeout=cfg.timeout,
        started=started,
        ended=time.time(),
        wall_seconds=round(time.monotonic() - t0, 3),
        stack_dumps=tuple(dumped),
        agent_stopped_after_ranks_exited=finished_early,
        killed=tuple(stopped.get("killed", ())),
        supervisor={k: stopped.get(k) for k in ("reason", "subreaper")},
        agent=agent,
    )


def _port_clash(record: LaunchRecord, run_dir: Path) -> bool:
    """The rendezvous port was taken between choosing it and binding it (nothing ran yet)."""
    error = str((record.agent or {}).get("error") or "")
    if any((run_dir / EVENTS_DIR).glob("*.jsonl")):
        return False
    return "address already in use" in error.lower() or "EADDRINUSE" in error


def _relaunch_request(run_dir: Path, record: LaunchRecord) -> dict[str, Any] | None:
    """The main process of a single launch asked for torchrun (ddpdoctor.probe.launch_check): its decision."""
    from ddpdoctor.probe.launch_check import RELAUNCH_EXIT_CODE

    if record.returncode != RELAUNCH_EXIT_CODE or record.end.stopped:
        return None
    for log in (run_dir / EVENTS_DIR).glob("*.jsonl"):
        try:
            lines = log.read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        for line in lines:
            if '"launch_decision"' in line:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("kind") == "launch_decision" and LaunchMode.of(event.get("mode")) is LaunchMode.TORCHRUN:
                    return {k: event.get(k) for k in ("mode", "reason", "site")}
    return None


def _clear_attempt(run_dir: Path) -> None:
    """Forget a launch that only decided the mode: its events and the script's output."""
    for name in (EVENTS_DIR, LOGS_DIR):
        shutil.rmtree(run_dir / name, ignore_errors=True)
        (run_dir / name).mkdir(exist_ok=True)


def run_probe(
    cfg: CheckConfig,
    run_dir: Path,
    static_findings: Sequence[Finding] = (),
    progress: Any = None,
    arm: dict[str, Any] | None = None,
    claim: RunDirClaim | None = None,
    static_notes: Sequence[str] = (),
    shared: Any = None,  # ddpdoctor.probe.shared.SharedLaunch (which imports this module)
) -> ProbeOutcome:
    """Run the probe into `run_dir` (meta.json, static.json, events/, logs/, source/, writes/, launcher.json).
    `progress` (ddpdoctor.probe.progress.ProgressDisplay) is updated from the wait loop and closed when the launch
    is over. `claim`: the caller already holds the directory (ddpdoctor.probe.rundir); else it is claimed here.
    `static_findings`/`static_notes`: the check's static analysis, kept in static.json for `ddpdoctor report`.

    `arm`: ProbeSettings fields of a `ddpdoctor triage` arm (arm, bn_mode, bn_convert, bn_group_size, seed),
    also kept in meta.json `arm`. `shared`: a launch already running for several runs of this script
    (ddpdoctor.probe.shared.SharedLaunch): the run is one of its orders, unless the script needs a launch of its
    own (not torchrun's mode) or the shared launch has ended; then it is launched alone, as `check` does."""
    deadline = time.monotonic() + cfg.timeout  # everything below, a relaunch and the CUDA check included
    own_claim = claim is None
    claim = claim or claim_for_check(Path(run_dir))
    try:
        static = StaticRecord(findings=tuple(static_findings), notes=tuple(static_notes))
        return _run_probe(cfg, claim.path.resolve(), static, deadline, progress, arm, shared)
    finally:
        if own_claim:
            claim.release()


def _run_probe(
    cfg: CheckConfig,
    run_dir: Path,
    static: StaticRecord,
    deadline: float,
    progress: Any,
    arm: dict[str, Any] | None,
    shared: Any = None,  # ddpdoctor.probe.shared.SharedLaunch (which imports this module)
) -> ProbeOutcome:
    if cfg.device == "cuda":
        _require_cuda(cfg.nproc, max(1.0, deadline - time.monotonic()))
    plan = plan_for_file(Path(cfg.script), cfg.script_args, cfg.nproc)
    settings = ProbeSettings(
        run_dir=str(run_dir),
        run_tag=uuid.uuid4().hex,
        mode=plan.mode,
        epochs=cfg.epochs,
        steps=cfg.steps,
        device=cfg.device,
        nproc=cfg.nproc,
        timeout=cfg.timeout,
        script=str(cfg.script),
        local_rank_arg=plan.local_rank_option or "",
        launch_check=1 if plan.mode.starts_once else 0,
        launcher=plan.launcher,
    )
    if arm:
        settings = replace(settings, **arm)
    meta = meta_for(cfg, plan, plan.mode)
    if arm:
        meta = meta.updated(arm=dict(arm))
    # the ranks record the script as os.path.abspath gives it; meta's script_abs is resolved (symlinks)
    script_as_run = os.path.abspath(cfg.script)
    meta = meta.updated(sources=snapshot(run_dir, [script_as_run, meta.script_abs], cwd=meta.cwd))
    write_json(run_dir / META_FILE, meta.to_json())
    write_json(run_dir / STATIC_FILE, static.to_json())
    # the safety net under the write redirection: which of the user's files changed anyway (probe.usertree)
    roots = [meta.cwd, os.path.dirname(script_as_run)]
    # the output files of other ddpdoctor runs beside this one are theirs, not the script's (ddpdoctor.live)
    neighbours = Neighbours()
    neighbours.look()
    before = fingerprint(roots, skip=[str(run_dir)])
    record = shared.run(run_dir, settings, deadline, progress, neighbours, cfg=cfg) \
        if shared is not None and shared.usable(settings.mode, cfg) else None
    if record is None:  # launched alone (or the shared launch was gone before this run started)
        record = _launch(cfg, run_dir, settings, deadline, progress, neighbours)
    relaunch = _relaunch_request(run_dir, record) if plan.mode.starts_once else None
    if relaunch is not None:
        # the script's main process needs a launcher: start it again under torchrun, within the same timeout
        first = record
        _clear_attempt(run_dir)
        settings = replace(settings, mode=LaunchMode.TORCHRUN, launch_check=0,
                           local_rank_arg=plan.local_rank_option or "")
        meta = meta.updated(
            mode=LaunchMode.TORCHRUN,
            legacy_local_rank_arg=plan.local_rank_option,
            plan={**plan.to_json(), "mode": LaunchMode.TORCHRUN.value, "runtime_decision": relaunch},
        )
        write_json(run_dir / META_FILE, meta.to_json())
        if progress is not None:
            progress.relaunched()
        record = _launch(cfg, run_dir, settings, deadline, progress, neighbours)
        record = record.updated(
            first_launch={"mode": first.mode, "returncode": first.returncode, "wall_seconds": first.wall_seconds},
            wall_seconds=round(float(record.wall_seconds or 0.0) + float(first.wall_seconds or 0.0), 3),
        )
    if record.end is not LaunchEnd.INTERRUPTED:
        # every user file the run names, so that `ddpdoctor report` elsewhere reads the same source
        meta = meta.updated(sources=snapshot_run(run_dir, cwd=meta.cwd, script=script_as_run, taken=meta.sources))
        write_json(run_dir / META_FILE, meta.to_json())
    record = record.updated(user_tree=tree_changes(before, skip=[str(run_dir)], others=neighbours))
    write_json(run_dir / LAUNCHER_FILE, record.to_json())
    if progress is not None:
        progress.close(timed_out=record.timed_out, interrupted=record.end is LaunchEnd.INTERRUPTED)
    if record.end is LaunchEnd.INTERRUPTED:
        raise KeyboardInterrupt
    return ProbeOutcome(
        run_dir=run_dir,
        mode=settings.mode,
        returncode=record.returncode,
        end=record.end,
        wall_seconds=record.wall_seconds,
    )


def _launch(
    cfg: CheckConfig, run_dir: Path, settings: ProbeSettings, deadline: float, progress: Any = None,
    neighbours: Neighbours | None = None,
) -> LaunchRecord:
    for _attempt in range(2):
        record = _launch_once(cfg, run_dir, settings, deadline, progress, neighbours)
        if not _port_clash(record, run_dir) or record.end is LaunchEnd.INTERRUPTED:
            break
    if (record.agent or {}).get("launch_args_rejected"):  # nothing ran: ddpdoctor's fault, not a rank's failure
        raise InternalError(str(record.agent.get("error")))
    return record

