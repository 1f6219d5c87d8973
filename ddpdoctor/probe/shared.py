"""One torchrun launch for several probe runs of the same script (`ddpdoctor triage`'s arms): the caller's side
of ddpdoctor.probe.zygote. Each run keeps what ddpdoctor.probe.launcher gives a run of its own (run directory,
settings, timeout, rendezvous, TMPDIR, launcher.json); `run_probe(..., shared=SharedLaunch)` uses it."""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddpdoctor.config import CheckConfig
from ddpdoctor.events import LOGS_DIR
from ddpdoctor.live import Neighbours
from ddpdoctor.probe.launcher import _command, _environment, free_port, scratch_dir
from ddpdoctor.probe.settings import ProbeSettings
from ddpdoctor.probe.supervisor import Command, Supervisor
from ddpdoctor.probe.watch import STACK_LEAD, STACK_WAIT, drop_empty_stacks, watch
from ddpdoctor.records import LaunchEnd, LaunchMode, LaunchRecord


class SharedLaunch:
    """One torchrun launch for several runs of the same script (`ddpdoctor triage`'s arms): every rank's process
    imports what every run imports once (ddpdoctor.probe.zygote), then forks one child per run. Each run keeps
    everything a run of its own has — its run directory and settings, its own timeout counted from its own start,
    its own rendezvous, its own TMPDIR, launcher.json with the ranks' exit codes as torchrun's agent reports them —
    so the analysis cannot tell the two apart, except by launcher.json `shared_launch`.

    A run that times out, is interrupted, or finds the launch gone ends the launch (`ended` says why): the runs
    after it are launched alone. The supervisor's own deadline covers every run the launch may hold. `close` stops
    whatever is left and removes the launch's files (the control folder lives in its scratch folder, which the
    supervisor removes even when ddpdoctor is killed)."""

    def __init__(self, cfg: CheckConfig, runs: int) -> None:
        self.cfg = cfg
        self.runs = runs
        self.k = 0
        self.ended: str | None = None
        self.supervisor: Supervisor | None = None
        self.scratch = ""
        self.ctrl = Path()
        self.command: list[str] = []
        self.tag = uuid.uuid4().hex
        self.in_flight = False  # a run's children may still be running: `close` does not wait for the zygotes

    def start(self) -> SharedLaunch:
        self.scratch = scratch_dir()
        try:
            return self._start()
        except BaseException:  # before the supervisor owns it, the scratch folder is ours to remove
            if self.supervisor is None or not self.supervisor.running:
                shutil.rmtree(self.scratch, ignore_errors=True)
            raise

    def _start(self) -> SharedLaunch:
        from ddpdoctor.probe.zygote import SHARED_ENV, launch_env_file, write_atomic

        cfg = self.cfg
        self.ctrl = Path(self.scratch) / "ctrl"
        self.ctrl.mkdir()
        port = free_port()
        settings = ProbeSettings(run_dir=str(self.ctrl), run_tag=self.tag, mode=LaunchMode.TORCHRUN, epochs=cfg.epochs,
                                 steps=cfg.steps, device=cfg.device, nproc=cfg.nproc, timeout=cfg.timeout,
                                 script=str(cfg.script), scratch=self.scratch)
        self.command = _command(LaunchMode.TORCHRUN, cfg, self.ctrl, port, rank_module="ddpdoctor.probe.zygote",
                                log_dir=self.ctrl / "elastic")
        env = _environment(settings, port, self.scratch)
        env[SHARED_ENV] = "1"
        # what the agent starts from: the zygotes tell torchrun's own variables (RANK, WORLD_SIZE...) from it
        write_atomic(launch_env_file(self.ctrl), env)
        # the last-resort deadline: every run it may hold, each with its own timeout
        deadline = time.time() + self.runs * (cfg.timeout + STACK_WAIT + 5.0)
        self.supervisor = Supervisor(
            [Command(argv=self.command, stdout=str(self.ctrl / "agent.stdout"),
                     stderr=str(self.ctrl / "agent.stderr"))],
            env=env, cwd=os.getcwd(), tag=self.tag, deadline=deadline, scratch=[self.scratch],
            log=str(self.ctrl / "supervisor.stderr"),
        )
        self.supervisor.start()
        return self

    def usable(self, mode: LaunchMode, cfg: CheckConfig | None = None) -> bool:
        """Whether a run in `mode` (of `cfg`, when given) can be the launch's next order: torchrun's mode on as
        many ranks and the same device, while the launch lasts."""
        return self.ended is None and self.supervisor is not None and mode is LaunchMode.TORCHRUN \
            and self.k < self.runs and (cfg is None or (cfg.nproc == self.cfg.nproc and cfg.device == self.cfg.device))

    def _alive(self) -> bool:
        sup = self.supervisor
        return sup is not None and sup.running and sup.poll()[0] is None

    def run(self, run_dir: Path, settings: ProbeSettings, deadline: float, progress: Any = None,
            neighbours: Neighbours | None = None, cfg: CheckConfig | None = None) -> LaunchRecord | None:
        """The run (of `cfg`'s script and arguments; the launch's own by default) as one order of this launch;
        None when the launch had ended before any rank started it (the agent failed to start, e.g. its port was
        taken): the caller launches it alone. The order carries the run's whole environment and working directory,
        as a launch of its own would give them to its agent, so a run is the same whatever ran before it."""
        from ddpdoctor.probe.zygote import done_file, order_file, read_json, started_file, write_atomic

        cfg, k, ctrl = cfg or self.cfg, self.k, self.ctrl
        self.k += 1
        port = free_port()
        timeout_at = time.time() + max(0.0, deadline - time.monotonic())
        scratch = Path(self.scratch) / str(k)
        scratch.mkdir()
        settings = replace(settings, run_tag=self.tag, rendezvous_port=free_port(avoid=port),
                           stacks_at=timeout_at - STACK_LEAD, scratch=str(scratch))
        env = _environment(settings, port, str(scratch))
        started = time.time()
        t0 = time.monotonic()
        self.in_flight = True
        write_atomic(order_file(ctrl, k), {"env": env, "cwd": os.getcwd(), "script": str(cfg.script),
                                           "args": list(cfg.script_args), "logs": str(run_dir / LOGS_DIR)})
        ends: dict[int, dict[str, Any]] = {}
        failures: list[dict[str, Any]] = []
        stopping_at: float | None = None

        def ended() -> LaunchEnd | None:
            for rank in range(cfg.nproc):
                if rank not in ends:
                    done = read_json(done_file(ctrl, k, rank)) if done_file(ctrl, k, rank).exists() else None
                    if done is not None:
                        ends[rank] = done
            if len(ends) == cfg.nproc:
                self.in_flight = False
                return LaunchEnd.EXITED
            if not self._alive():
                self.ended = "the shared launch ended before the run did"
                return LaunchEnd.EXITED
            return None

        def stop_peers_of_failed(_polls: int) -> None:
            nonlocal failures, stopping_at
            failed = [r for r, d in ends.items() if d.get("exitcode")]
            if failed and stopping_at is None:
                # as torchrun's agent does: a failed rank ends the run; the others are stopped (SIGTERM, then
                # SIGKILL after the agent's --shutdown-timeout), and only the failed ones are its failures
                failures = [self._failure(ends[r]) for r in sorted(failed)]
                stopping_at = time.monotonic()
                self._signal_children(k, signal.SIGTERM, ends)
            elif stopping_at is not None and time.monotonic() - stopping_at > 3.0:
                self._signal_children(k, signal.SIGKILL, ends)
                stopping_at = float("inf")

        def clean_up(end: LaunchEnd | None) -> dict[str, Any] | None:
            if end is LaunchEnd.TIMED_OUT:
                self.ended = "a run timed out"
            elif end is LaunchEnd.INTERRUPTED:
                self.ended = "interrupted"
            return self.close() if self.ended is not None else None

        watched = watch(run_dir=run_dir, deadline=deadline, scratch=str(scratch), ended=ended,
                        tick=stop_peers_of_failed, clean_up=clean_up, progress=progress, neighbours=neighbours)
        end, dumped, final = watched.end, watched.dumped, watched.stopped
        timed_out, interrupted = watched.timed_out, end is LaunchEnd.INTERRUPTED
        if interrupted:
            self.ended = self.ended or "interrupted"
        pids = {r: (read_json(started_file(ctrl, k, r)) or {}).get("pid") for r in range(cfg.nproc)} \
            if ctrl.is_dir() else {}
        if not any(pids.values()) and not ends and not timed_out and not interrupted:
            self.k -= 1  # nothing of it ran here
            return None
        drop_empty_stacks(run_dir)
        if not failures:
            failures = [self._failure(d) for _, d in sorted(ends.items()) if d.get("exitcode")]
        complete = len(ends) == cfg.nproc
        ok = complete and not failures
        agent: dict[str, Any] = {"ok": ok, "started": started, "ended": time.time()}
        if failures:
            agent["failures"] = failures
        elif not complete and not timed_out and not interrupted:
            agent["error"] = "the shared launch (torch.distributed.run's agent) ended before the ranks did"
        returncode = 0 if ok else 1
        if final is not None and not complete and not timed_out and not interrupted:
            returncode = (final.get("returncodes") or [1])[0]
        return LaunchRecord(
            mode=LaunchMode.TORCHRUN,
            command=tuple(self.command),
            port=port,
            rendezvous_port=settings.rendezvous_port,
            returncode=returncode,
            stopped_by_probe=timed_out or interrupted,
            **end.flags(timed_out=watched.timed_out),
            timeout=cfg.timeout,
            started=started,
            ended=time.time(),
            wall_seconds=round(time.monotonic() - t0, 3),
            stack_dumps=tuple(dumped),
            killed=tuple((final or {}).get("killed", ())),
            supervisor={"reason": (final or {}).get("reason"), "subreaper": (final or {}).get("subreaper")},
            agent=agent,
            extra={"shared_launch": {"run": k + 1, "ranks": pids}},
        )

    @staticmethod
    def _failure(done: dict[str, Any]) -> dict[str, Any]:
        return {"rank": done.get("rank"), "local_rank": done.get("rank"), "pid": done.get("pid"),
                "exitcode": done.get("exitcode"), "signal": done.get("signal"), "timestamp": done.get("t"),
                "message": ""}

    def _signal_children(self, k: int, sig: int, ends: dict[int, Any]) -> None:
        from ddpdoctor.probe.zygote import read_json, started_file

        for rank in range(self.cfg.nproc):
            if rank in ends:
                continue
            pid = (read_json(started_file(self.ctrl, k, rank)) or {}).get("pid")
            if pid:
                try:
                    os.kill(int(pid), sig)
                except OSError:
                    pass

    def close(self) -> dict[str, Any] | None:
        """Stop the launch (the zygotes are told to leave first, so a finished launch ends cleanly) and wait until
        nothing of it is left. Idempotent."""
        sup, self.supervisor = self.supervisor, None
        if sup is None:
            return None
        self.ended = self.ended or "closed"
        from ddpdoctor.probe.zygote import left_file, order_file, write_atomic

        try:
            if self.ctrl.is_dir() and sup.running and not self.in_flight:
                write_atomic(order_file(self.ctrl, self.k), {"stop": True})
                end = time.monotonic() + 5.0
                # every zygote has left: the agent's own shutdown (its interpreter's teardown, seconds) tells us
                # nothing more, as for a run launched alone (launcher: the ranks exited)
                while sup.running and sup.poll()[0] is None and time.monotonic() < end and not all(
                        left_file(self.ctrl, r).exists() for r in range(self.cfg.nproc)):
                    time.sleep(0.05)
        except OSError:
            pass
        finally:
            final = sup.stop()  # a second Ctrl-C during the wait above still stops everything
        return final
