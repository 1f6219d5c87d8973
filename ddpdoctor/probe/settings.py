"""The probe's settings as every instrumented process sees them: passed through environment variables, so that
children started by the script itself (mp.spawn, multiprocessing) read the same values as the ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

from ddpdoctor.records import LaunchMode

ENV_PREFIX = "DDPDOCTOR_"
# Gate for the sitecustomize hook: set only inside a probe run.
RUN_DIR_ENV = "DDPDOCTOR_RUN_DIR"
# Tag inherited by every process of a run, so the launcher can find and stop all of them.
RUN_TAG_ENV = "DDPDOCTOR_RUN_TAG"


@dataclass(frozen=True, kw_only=True)
class ProbeSettings:
    run_dir: str
    run_tag: str = ""
    mode: LaunchMode = LaunchMode.TORCHRUN  # an environment variable holds its string
    epochs: int = 2  # 0 = no limit
    steps: int = 4  # 0 = no limit
    device: str = "auto"  # auto | cpu | cuda
    nproc: int = 2
    timeout: float = 120.0
    script: str = ""
    local_rank_arg: str = ""  # "--local_rank" for legacy scripts: the bootstrap passes it as the old launcher did
    stall_timeout: float = 0.0  # attach mode: dump stacks when no step happened for this long (0 = off)
    # launcher modes: the time (seconds since the epoch) at which every process still running dumps the Python
    # stacks of all its threads (faulthandler's own timer thread: no signal the script could own); a moment before
    # the probe's timeout, so the launcher finds them written when it stops the run (0 = off)
    stacks_at: float = 0.0
    # launcher modes: the run's own temporary directory (TMPDIR of every process, removed with the run); writes
    # there are real, everything else the script writes is redirected into the run directory (probe.fsview)
    scratch: str = ""
    # spawn mode: the main process may ask to be relaunched under torchrun (ddpdoctor.probe.launch_check); 0/1
    launch_check: int = 0
    # a free port on 127.0.0.1 the launcher chose for the script's own rendezvous (tcp://host:port init methods,
    # MASTER_PORT set by a self-spawning script): a fixed port could collide with another job; 0 = leave it alone
    rendezvous_port: int = 0
    # the launcher whose environment contract the ranks get: torchrun | horovodrun | fabric-run (probe.launch_env)
    launcher: str = "torchrun"
    # `ddpdoctor triage` arms (ddpdoctor.probe.arms); all empty/0 for `check`.
    arm: str = ""  # the arm's name: "A" | "L" | "P" | "G" ("" = not a triage arm)
    # what the arm changes about BatchNorm: "" as written | "local" SyncBN normalises with per-rank statistics |
    # "plain" the conversion to SyncBN undone | "group" SyncBN over subgroups of `bn_group_size` ranks
    bn_mode: str = ""
    bn_convert: int = 0  # 1: plain BN converted to SyncBN when DDP wraps the model (the mirror arms of a plain script)
    bn_group_size: int = 0
    seed: int = -1  # >= 0: every rank's generators seeded with seed + rank before the script runs (same in every arm)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", LaunchMode(self.mode))  # given as its string: the member

    def to_env(self) -> dict[str, str]:
        return {ENV_PREFIX + f.name.upper(): str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ProbeSettings | None":
        env = os.environ if env is None else env
        if not env.get(RUN_DIR_ENV):
            return None
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            if f.type in ("int", int):
                values[f.name] = int(raw)
            elif f.type in ("float", float):
                values[f.name] = float(raw)
            else:
                values[f.name] = raw
        return cls(**values)  # type: ignore[arg-type]

    @property
    def limited(self) -> bool:
        return self.epochs > 0 and self.steps > 0
