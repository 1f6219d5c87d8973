"""DD104 hardcoded-rank: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD104"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="hardcoded-rank",
    severity=Severity.CRITICAL,
    summary="init_process_group with a literal rank (or literal world_size) that cannot differ per process",
    what=prose(
        """
        Static analysis looks for `init_process_group(..., rank=<literal>)` or `world_size=<literal>`, directly
        or through a variable only ever assigned a constant, so the value cannot differ between processes or
        follow the launcher.

        The probe compares the rank and world size the script passed with the launcher's RANK and
        WORLD_SIZE. Where they disagree it overrides them with the launcher's values, says so in the finding,
        and goes on measuring the rest of the run.
        """
    ),
    why=prose(
        """
        Every process of a job must join with a distinct rank and the same, true world size. Two processes
        claiming rank 0 cannot form a group: depending on the backend and the rendezvous store, init fails
        (address in use, duplicate rank) or waits until the timeout. A literal world size that does not match
        the launch leaves the group waiting for ranks that never come.

        The silent variant is a literal `world_size=1` (a single-GPU script wrapped in a launcher): every
        process forms its own one-rank group, DDP's all-reduce is a no-op, DistributedSampler hands every
        process the whole dataset, and N independent copies of single-GPU training run side by side and
        write the same files.
        """
    ),
    example=snippet(
        """
        # Bad: every process claims rank 0 of a 4-process job
        dist.init_process_group("nccl", init_method="tcp://10.0.0.1:23456", rank=0, world_size=4)

        # Good: the launcher's environment decides (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
        dist.init_process_group("nccl")
        """
    ),
    fix=(
        "Take rank and world size from the launcher: call init_process_group(backend) with the env:// "
        "defaults, or pass int(os.environ[\"RANK\"]) and int(os.environ[\"WORLD_SIZE\"])."
    ),
    fix_variants={
        "probe": (
            "Take rank and world size from the launcher (init_process_group() reads RANK/WORLD_SIZE), or from "
            "mp.spawn's process index."
        ),
    },
    run_only="a hard-coded rank stops the rendezvous",
)
