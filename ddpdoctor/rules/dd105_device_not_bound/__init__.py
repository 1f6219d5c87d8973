"""DD105 device-not-bound: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD105"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="device-not-bound",
    severity=Severity.HIGH,
    summary="CUDA DDP without set_device/device_ids per local rank; ranks share one device",
    what=prose(
        """
        Static analysis looks for a CUDA DDP script (nccl backend, `.cuda()` or "cuda" devices) that neither
        calls `torch.cuda.set_device(local_rank)` nor places the model with an index derived from the local
        rank and passes `device_ids=[local_rank]` to DDP.

        The probe records which device each rank's DDP replica and its first training batch are on (real GPUs,
        or the emulated ones under CPU emulation, where `.cuda()` without an index means the current device as
        on CUDA) and fires when two ranks of one node share a device; ranks that each hold their own device
        clear the static suspicion.
        """
    ),
    why=prose(
        """
        `.cuda()`, "cuda" and tensors created without an index mean the current device, which is cuda:0 in
        every process until `set_device` changes it. Without it, all ranks of a node put their replica and
        their batches on GPU 0 while the other GPUs idle: recent NCCL versions refuse the setup ("Duplicate
        GPU detected"), otherwise it runs out of memory or crawls. The usual ways around that, a smaller
        per-GPU batch or fewer processes, silently change the normalisation batch and the global batch the
        learning rate was tuned for. A half-bound setup (model on `cuda:local_rank`, but `.cuda()` inputs or
        collectives without `set_device`) creates an extra context on GPU 0 in every process or fails with
        device-mismatch errors.
        """
    ),
    example=snippet(
        """
        # Bad: every process uses the current device, cuda:0
        model = Net().cuda()
        ddp = DDP(model)

        # Good: one GPU per process, chosen by the local rank
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        model = Net().cuda(local_rank)
        ddp = DDP(model, device_ids=[local_rank])
        """
    ),
    example_context=snippet(
        """
        dist.init_process_group("nccl")
        """
    ),
    fix=(
        "Call torch.cuda.set_device(local_rank) before any CUDA work, and wrap with "
        "DDP(model.cuda(local_rank), device_ids=[local_rank])."
    ),
    run_only="ranks sharing a device crash or run slower",
)
