"""DD205 syncbn-needs-cuda: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD205"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="syncbn-needs-cuda",
    severity=Severity.INFO,
    summary="SyncBatchNorm with a CPU/gloo setup raises in plain PyTorch",
    what=prose(
        """
        Static analysis looks for SyncBatchNorm (`nn.SyncBatchNorm(...)` or `convert_sync_batchnorm`) in a
        script whose process group uses gloo or whose model stays on CPU.

        The probe records SyncBatchNorm layers that ran on CPU tensors. Under ddpdoctor's CPU emulation they
        compute exact global-batch statistics over gloo, so the rest of the run can be measured; the finding
        says that plain PyTorch would have raised.
        """
    ),
    why=prose(
        """
        Not an accuracy problem by itself: PyTorch's SyncBatchNorm only runs on CUDA (and XPU or PrivateUse1)
        devices. On CPU, DDP's constructor raises "SyncBatchNorm layers only work with GPU modules", and
        SyncBatchNorm.forward raises "SyncBatchNorm expected input tensor to be on GPU ..." once a process
        group with more than one rank exists. Without a process group it quietly behaves like plain
        BatchNorm, so a single-process CPU smoke test says nothing about the synchronised run. Scripts that
        swap SyncBN out for CPU tests train a different model there than on the cluster.
        """
    ),
    example=snippet(
        """
        # Bad: SyncBN on CPU with gloo
        dist.init_process_group("gloo")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(Net())
        ddp = DDP(model)  # ValueError: SyncBatchNorm layers only work with GPU modules

        # Good: SyncBN where it can run, the same code path otherwise
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        model = Net()
        if torch.cuda.is_available():
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(local_rank)
        """
    ),
    example_context=snippet(
        """
        local_rank = int(os.environ["LOCAL_RANK"])
        """
    ),
    fix=(
        "Run SyncBatchNorm on CUDA with the NCCL backend; for CPU/gloo runs keep nn.BatchNorm, or let "
        "ddpdoctor's CPU emulation stand in for it."
    ),
)
