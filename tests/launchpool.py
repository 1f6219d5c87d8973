"""One running launch per pytest worker for the probe runs that tests make in this process.

A probe run launched alone pays, per rank, the interpreter, `import torch` and torch._dynamo (which
DistributedDataParallel imports), and torchrun's agent pays its own interpreter and torch: about 10 s of CPU on
this 2-core machine for a few seconds of script, most of `make test`. `ddpdoctor triage` already runs its arms as
orders of one launch (ddpdoctor.probe.shared.SharedLaunch, ddpdoctor.probe.zygote: the ranks import once, then
fork one child per run, which runs the script instrumented as a rank torchrun started would). Here the same launch
is kept for the worker's whole session and serves every run a test makes through `run_check`/`run_cli`/`run_triage`
in this process: each run is still a real multi-rank run of the script — real processes, a real gloo group, its
own rendezvous, environment, working directory, run directory, timeout — only the imports are not repeated.

What is NOT pooled, and so still launched exactly as a user's `ddpdoctor check` launches it:
- every run of a `ddpdoctor` started as a subprocess (the CLI, signal, process-lifecycle and CI tests);
- a test marked `own_launch` (its subject is the launch itself);
- a run that torchrun does not start (a script that spawns its own ranks, or runs as one process), a run on
  another number of ranks or with --device cuda, a run under another TMPDIR than the pool's (a test that
  watches where the run's temporary files go);
- everything, with DDPDOCTOR_TEST_POOL=0 in the environment (the suite as every user's check runs).

A run that times out or is interrupted ends the launch (as in triage); the next run starts a new one. So does a run
whose environment differs from the launch's in what an interpreter or torch reads as it starts (PYTHONPATH,
OMP_NUM_THREADS...: a forked child keeps what its zygote read)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from typing import Any

POOL_ENV = "DDPDOCTOR_TEST_POOL"
# read when an interpreter starts or torch is imported: a forked child keeps what its zygote read
_STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH", "LD_", "CUDA_", "NCCL_", "GLOO_", "MALLOC")


def _startup_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_STARTUP_PREFIXES)}


_TEST_ENV_PREFIX = "DDPD_TEST_"  # marks a test gives the processes of its own runs (not the pool's)


class Pool:
    def __init__(self, home: str) -> None:
        self.shared_launch = _originals()["SharedLaunch"]
        self.home = home  # the working directory the launch starts in (each run has its own)
        self.launch: Any = None
        self.started_with: dict[str, str] = {}
        # the pool's launch keeps its scratch folder (and each run's TMPDIR) in the session's temporary directory
        self.tmpdir = (tempfile.gettempdir(), os.environ.get("TMPDIR"))

    def for_run(self, cfg: Any) -> Any:
        """The running launch for a run of `cfg`, started if needed; None where the run must be launched alone."""
        from ddpdoctor.records import LaunchMode

        if cfg.nproc != 2 or cfg.device == "cuda" or (tempfile.gettempdir(), os.environ.get("TMPDIR")) != self.tmpdir:
            return None
        launch = self.launch
        if launch is not None and (launch.ended is not None or launch.supervisor is None):
            self.close()  # a run timed out or was interrupted: that launch is over
        elif launch is not None and _startup_env() != self.started_with:
            self.close()  # e.g. a test's own PYTHONPATH: the ranks start with it, in a launch started with it
        if self.launch is None:
            self.launch = self._start(cfg)
            self.started_with = _startup_env()
        return self.launch if self.launch.usable(LaunchMode.TORCHRUN, cfg) else None

    def _start(self, cfg: Any) -> Any:
        saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith(_TEST_ENV_PREFIX)]}
        cwd = os.getcwd()
        try:  # the launch outlives the test that started it: none of that test's marks, nor its folder
            os.chdir(self.home)
            return self.shared_launch(replace(cfg, timeout=3600.0, keep_run=None), runs=10**4).start()
        finally:
            os.chdir(cwd)
            os.environ.update(saved)

    def close(self) -> None:
        launch, self.launch = self.launch, None
        if launch is not None:
            launch.close()


class Lease:
    """What ddpdoctor.probe.armlaunch.ArmLaunch gets in place of a SharedLaunch of its own: the pool's launch, which
    its `close` leaves running."""

    def __init__(self, launch: Any) -> None:
        self._launch = launch

    def start(self) -> Lease:
        return self

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._launch, name)


_ORIGINALS: dict[str, Any] = {}


def _originals() -> dict[str, Any]:
    from ddpdoctor.probe import launcher, shared

    if not _ORIGINALS:  # first called before any `install`
        _ORIGINALS.update(run_probe=launcher.run_probe, SharedLaunch=shared.SharedLaunch)
    return _ORIGINALS


def uninstall(monkeypatch: Any) -> None:
    """Undo `install` for one test (the module's patch comes back after it)."""
    from ddpdoctor.probe import launcher, shared

    originals = _originals()
    monkeypatch.setattr(launcher, "run_probe", originals["run_probe"])
    monkeypatch.setattr(shared, "SharedLaunch", originals["SharedLaunch"])


def install(pool: Pool, monkeypatch: Any) -> None:
    """Route the in-process probe runs through `pool` (check's run, the conversion check's and triage's arms)."""
    from ddpdoctor.probe import launcher, shared

    originals = _originals()
    run_probe, own = originals["run_probe"], originals["SharedLaunch"]

    def pooled_run_probe(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("shared") is None:
            kwargs["shared"] = pool.for_run(cfg)
        return run_probe(cfg, *args, **kwargs)

    def pooled_shared_launch(cfg: Any, runs: int) -> Any:
        launch = pool.for_run(cfg)
        return Lease(launch) if launch is not None else own(cfg, runs)

    monkeypatch.setattr(launcher, "run_probe", pooled_run_probe)
    monkeypatch.setattr(shared, "SharedLaunch", pooled_shared_launch)
