"""The environment contract of the launcher a script was written for, applied in each rank before the script runs.

The probe starts ranks through torch.distributed.run, whose contract is RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/MASTER_PORT and TORCHELASTIC_*. A Horovod script is written for
`horovodrun -np N`, which starts one process per slot with HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK,
HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE, HOROVOD_HOSTNAME and its gloo controller settings, and
none of torchrun's variables. The difference matters: a script that reads `"WORLD_SIZE" in os.environ` to choose
torch.distributed over Horovod would take the other path under torchrun's contract.

A script written for `fabric run` (Lightning Fabric, no `.launch()`) gets torchrun's contract plus what
`fabric run` adds: LT_CLI_USED=1, LT_DEVICES, LT_NUM_NODES.

`apply(settings)` rewrites this process's environment to the contract of `settings.launcher` ("torchrun": nothing
to do) and returns what it did, for the `launch_env` event. Horovod's gloo rendezvous variables name the port the
probe chose for the script's own rendezvous (settings.rendezvous_port), which ddpdoctor's Horovod stand-in joins.
"""

from __future__ import annotations

import os
from typing import Any

from ddpdoctor.probe.settings import ProbeSettings
from ddpdoctor.records import LaunchMode

TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)

HOROVOD_VARIABLES = (
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE",
    "HOROVOD_HOSTNAME",
)


def horovodrun_environment(env: dict[str, str], rendezvous_port: int) -> dict[str, str]:
    """What `horovodrun -np N -H localhost:N` gives the process torchrun described in `env`."""
    rank = int(env.get("RANK", "0"))
    size = int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", str(rank)))
    local_size = int(env.get("LOCAL_WORLD_SIZE", str(size)))
    out = {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_size),
        "HOROVOD_CROSS_RANK": env.get("GROUP_RANK", str(rank // max(1, local_size))),
        "HOROVOD_CROSS_SIZE": str(max(1, size // max(1, local_size))),
        "HOROVOD_HOSTNAME": "localhost",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
    }
    if rendezvous_port:
        out["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = "127.0.0.1"
        out["HOROVOD_GLOO_RENDEZVOUS_PORT"] = str(rendezvous_port)
    return out


def fabric_run_environment(env: dict[str, str]) -> dict[str, str]:
    """What `fabric run --devices N` adds to torchrun's variables (lightning.fabric.cli._set_env_variables): Fabric
    reads them as its devices and node count, and LT_CLI_USED tells it the processes exist already."""
    return {
        "LT_CLI_USED": "1",
        "LT_DEVICES": env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE") or "1",
        "LT_NUM_NODES": env.get("GROUP_WORLD_SIZE") or "1",
    }


def apply(settings: ProbeSettings) -> dict[str, Any] | None:
    """Give this process the environment of `settings.launcher`; None when nothing changed."""
    if settings.launcher not in ("horovodrun", "fabric-run") or settings.mode is not LaunchMode.TORCHRUN:
        return None
    if "RANK" not in os.environ:
        return None
    if settings.launcher == "fabric-run":
        added = fabric_run_environment(dict(os.environ))
        os.environ.update(added)
        return {"launcher": "fabric-run", "set": added, "removed": []}
    new = horovodrun_environment(dict(os.environ), settings.rendezvous_port)
    removed = [k for k in TORCHRUN_VARIABLES if k in os.environ]
    for key in removed:
        del os.environ[key]
    os.environ.update(new)
    return {"launcher": "horovodrun", "set": new, "removed": removed}
