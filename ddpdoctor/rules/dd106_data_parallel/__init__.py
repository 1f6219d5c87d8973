"""DD106 data-parallel: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD106"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="data-parallel",
    severity=Severity.MEDIUM,
    summary="nn.DataParallel used (single process; BN statistics from replica 0 only)",
    what=prose(
        """
        Static analysis looks for `nn.DataParallel(...)` (through any import alias), alone or inside a
        DistributedDataParallel script.

        The probe runs a script that trains with DataParallel and never forms a process group the way it runs
        on a GPU machine: one process (`python train.py`), N GPUs (emulated on CPU: the batch is split into
        chunks, each replica runs its chunk, replica 0 is the module itself). It measures whether DataParallel
        actually split the batch (how many replicas, how many samples each), how many samples every BatchNorm
        layer normalised over per replica, and how far the statistics of replica 0's chunk (the only ones that
        reach the running statistics) were from those of the whole batch the optimizer steps on. The severity
        follows: medium when BatchNorm normalised chunks smaller than DD202's threshold, low when the chunks are
        large, when the model has no BatchNorm (only speed is lost) or when DataParallel never split a batch.
        """
    ),
    why=prose(
        """
        DataParallel runs one process: every forward replicates the module onto each GPU, splits the batch
        along dimension 0 and gathers the outputs on device 0. The loss on the gathered outputs gives the
        full-batch gradient, so the optimisation itself is right; BatchNorm is not. Each replica normalises
        over its own chunk (batch / number of GPUs), exactly like per-GPU BatchNorm under DDP, and the
        replicas are thrown away after the forward: only the replica on device_ids[0] shares storage with the
        real module, so the running mean and variance are estimated from GPU 0's chunk alone, an N-times
        smaller sample than the batch. On top, the replicate/scatter/gather round trip through one Python
        process makes it slower than DDP, which PyTorch recommends instead.
        """
    ),
    example=snippet(
        """
        # Bad: one process, four replicas; BN running stats come from replica 0 only
        model = nn.DataParallel(Net().cuda())

        # Good: torchrun --nproc_per_node 4 train.py, one process per GPU
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        model = DDP(Net().cuda(local_rank), device_ids=[local_rank])
        """
    ),
    fix=(
        "Replace nn.DataParallel with one process per GPU and DistributedDataParallel (add SyncBatchNorm if "
        "the per-GPU batch is small)."
    ),
)
