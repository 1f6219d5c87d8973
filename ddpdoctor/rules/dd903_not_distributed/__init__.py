"""DD903 not-distributed: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD903"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="not-distributed",
    severity=Severity.INFO,
    summary="the script never initialised a process group / never built DDP",
    what=prose(
        """
        The probe fires when the run ended without any rank initialising a process group or constructing
        DistributedDataParallel.
        """
    ),
    why=prose(
        """
        Launched with N processes, a script that never joins a process group runs N independent single-GPU
        trainings on the whole dataset, all writing the same outputs; if it was meant to be distributed,
        nothing is. If the script is deliberately single-process, the distributed checks do not apply and
        the static findings are what remains; the probe's other findings describe N unrelated runs.
        """
    ),
    example=snippet(
        """
        # Bad: launched with torchrun, but every process trains alone
        model = Net().cuda()
        loader = DataLoader(train_set, batch_size=32, shuffle=True)

        # Good: join the job, wrap the model, shard the data
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        model = DDP(Net().cuda(local_rank), device_ids=[local_rank])
        loader = DataLoader(train_set, batch_size=32, sampler=DistributedSampler(train_set))
        """
    ),
    fix=(
        "Initialise the process group from the launcher's environment and wrap the model in "
        "DistributedDataParallel; for a single-process script use --static."
    ),
    fix_variants={
        "no_process_group": (
            "Call torch.distributed.init_process_group() and wrap the model in DistributedDataParallel."
        ),
        "no_ddp": "Wrap the model in DistributedDataParallel (or check that its replacement, e.g. FSDP, is intended).",
    },
)
