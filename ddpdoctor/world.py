"""Who is who in a multi-process launch, read from the launcher's environment variables.

torchrun's contract first (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK = node, GROUP_WORLD_SIZE =
nodes, TORCHELASTIC_RUN_ID), then horovodrun's (HOROVOD_RANK, ..., HOROVOD_CROSS_RANK = node), then SLURM's for
a script started by `srun` without torchrun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_TASKS_PER_NODE /
SLURM_NTASKS_PER_NODE, SLURM_NODEID, SLURM_NNODES, SLURM_JOB_ID.SLURM_STEP_ID), then Open MPI's (`mpirun`:
OMPI_COMM_WORLD_*; no node index, the host stands in).

The probe uses it inside the ranks (attach mode's world size, which process writes the static findings, the
launcher values a hard-coded rank is replaced with, the node of a checkpoint), and the analyses use it on the
recorded `process_start` environments (which node each rank ran on). Pure: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "TORCHELASTIC_RUN_ID")
SLURM_ENV = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
             "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_JOB_ID",
             "SLURM_STEP_ID")
MPI_ENV = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
           "OMPI_COMM_WORLD_LOCAL_SIZE")
HOROVOD_ENV = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
               "HOROVOD_CROSS_SIZE")
# every variable `place_from_env` reads: what each process records of its launcher (probe.session)
WORLD_ENV = TORCHRUN_ENV + HOROVOD_ENV + SLURM_ENV + MPI_ENV


@dataclass(frozen=True, kw_only=True)
class Place:
    """Where one process sits in the launch; None where the launcher does not say."""

    launcher: str  # "torchrun" | "horovod" | "slurm" | "mpi" | "none"
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    node: int | None = None
    nodes: int | None = None
    job: str | None = None


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    m = re.fullmatch(r"\s*(-?\d+)\s*", str(value))
    return int(m.group(1)) if m else None


def tasks_on_node(tasks_per_node: str | None, node: int | None) -> int | None:
    """SLURM_TASKS_PER_NODE ("2(x3),1": two tasks on each of three nodes, then one) → the count on `node`."""
    if not tasks_per_node:
        return None
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    index = node or 0
    return counts[index] if 0 <= index < len(counts) else None


def place_from_env(env: Mapping[str, str]) -> Place:
    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        return Place(
            launcher="torchrun",
            rank=_int(env.get("RANK")),
            world_size=_int(env.get("WORLD_SIZE")),
            local_rank=_int(env.get("LOCAL_RANK")),
            local_world_size=_int(env.get("LOCAL_WORLD_SIZE")),
            node=_int(env.get("GROUP_RANK")),
            nodes=_int(env.get("GROUP_WORLD_SIZE")),
            job=env.get("TORCHELASTIC_RUN_ID"),
        )
    if env.get("HOROVOD_RANK") is not None:  # horovodrun: its own contract, whatever started horovodrun
        return Place(
            launcher="horovod",
            rank=_int(env.get("HOROVOD_RANK")),
            world_size=_int(env.get("HOROVOD_SIZE")),
            local_rank=_int(env.get("HOROVOD_LOCAL_RANK")),
            local_world_size=_int(env.get("HOROVOD_LOCAL_SIZE")),
            node=_int(env.get("HOROVOD_CROSS_RANK")),
            nodes=_int(env.get("HOROVOD_CROSS_SIZE")),
        )
    if env.get("SLURM_PROCID") is not None:
        job = env.get("SLURM_JOB_ID")
        if job is not None and env.get("SLURM_STEP_ID") is not None:
            job = f"{job}.{env['SLURM_STEP_ID']}"
        return Place(
            launcher="slurm",
            rank=_int(env.get("SLURM_PROCID")),
            world_size=_int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")),
            local_rank=_int(env.get("SLURM_LOCALID")),
            local_world_size=tasks_on_node(env.get("SLURM_TASKS_PER_NODE"), _int(env.get("SLURM_NODEID")))
            or _int(env.get("SLURM_NTASKS_PER_NODE")),
            node=_int(env.get("SLURM_NODEID")),
            nodes=_int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")),
            job=job,
        )
    if env.get("OMPI_COMM_WORLD_RANK") is not None:
        return Place(
            launcher="mpi",
            rank=_int(env.get("OMPI_COMM_WORLD_RANK")),
            world_size=_int(env.get("OMPI_COMM_WORLD_SIZE")),
            local_rank=_int(env.get("OMPI_COMM_WORLD_LOCAL_RANK")),
            local_world_size=_int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE")),
        )
    return Place(launcher="none", local_rank=_int(env.get("LOCAL_RANK")))
