"""DD109 single-node-world-size: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD109"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="single-node-world-size",
    severity=Severity.LOW,
    summary="world size taken from torch.cuda.device_count(): correct on one node only",
    what=prose(
        """
        Static analysis looks for `torch.cuda.device_count()` used as the world size: passed as
        `init_process_group(world_size=...)`, as DistributedSampler's `num_replicas`, or in the learning-rate
        or batch-size arithmetic of a distributed script. The probe measures it where it matters: a process
        that passes `init_process_group` a world size equal to its node's `device_count()` while the
        launcher started a different number of processes (several nodes, or `--nproc_per_node` unlike the
        GPU count); the probe then uses the launcher's WORLD_SIZE and goes on measuring.
        """
    ),
    why=prose(
        """
        `device_count()` is the number of GPUs this process can see on this node. On one node with one
        process per visible GPU it happens to equal the world size; on two nodes it is half of it, and with
        CUDA_VISIBLE_DEVICES narrowed per process it is 1. Used in `init_process_group` the group never
        completes; used as `num_replicas`, DistributedSampler refuses ranks at or above it, and a script that
        then takes the local rank as the rank feeds every node the same shards; used for learning-rate
        scaling, the lr follows the GPUs of one node instead of the global batch (see DD401).
        """
    ),
    example=snippet(
        """
        # Bad: 8 on every node, but the job has 16 processes on two nodes
        world_size = torch.cuda.device_count()
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)

        # Good: ask the process group
        world_size = dist.get_world_size()
        sampler = DistributedSampler(dataset)  # num_replicas and rank from the process group
        """
    ),
    example_context=snippet(
        """
        dist.init_process_group("nccl")
        rank = dist.get_rank()
        dataset = TensorDataset(torch.randn(64, 8))
        """
    ),
    fix=(
        "Use dist.get_world_size() (or WORLD_SIZE from the launcher) for the world size, not "
        "torch.cuda.device_count()."
    ),
)
