"""DD110 model-not-wrapped: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run).
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD110"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="model-not-wrapped",
    severity=Severity.CRITICAL,
    summary=(
        "ranks share a process group and (sharded) data and take optimizer steps, but the model is never "
        "wrapped in DDP/FSDP and gradients are never averaged: each rank trains its own model"
    ),
    what=prose(
        """
        Static analysis looks for a script that initialises a process group and steps an optimizer but never
        wraps its model in DistributedDataParallel or FSDP and never averages gradients itself (an
        all_reduce over `p.grad`, Horovod's DistributedOptimizer); and for scripts whose only DDP wrap sits in
        a branch on the device (`if device.type == "cuda":`) while the process group and the training loop
        run on every path, so the other path trains unwrapped models.

        The probe observes it: the ranks initialised a process group and stepped an optimizer, and no DDP,
        FSDP/fully_shard, gradient-averaging optimizer or collective on the gradients ran. It measures the
        consequence from the parameter digests recorded after every step: the first step at which the
        ranks' models differ and by how much, and whether the data was sharded across the ranks.
        """
    ),
    why=prose(
        """
        DistributedDataParallel is what makes N processes one training: it broadcasts rank 0's weights at
        construction and averages the gradients in every backward, so every replica takes the same step on
        the gradient of the global batch. Without it the process group and the DistributedSampler still
        split the data, but each rank steps its own copy of the model on its own 1/N of the data: N
        independent trainings, each with the per-rank batch and 1/N of the epoch, and the model that is
        saved and evaluated (usually rank 0's) never saw the other ranks' data. Symptoms elsewhere in the
        report follow from it: the replicas diverge (DD103), their BatchNorm statistics differ (DD201) and
        their BN inputs look non-i.i.d. (DD203) because the models differ, not the data.
        """
    ),
    example=snippet(
        """
        # Bad: the CPU path of a DDP script forgets the wrap
        dist.init_process_group("gloo")
        model = Net().to(device)
        if device.type == "cuda":
            model = DDP(model, device_ids=[local_rank])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        # Good: wrap on every path that trains in the process group
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
        """
    ),
    example_context=snippet(
        """
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        loader = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set))
        ...
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        """
    ),
    fix=(
        "Wrap the model in DistributedDataParallel (or FSDP) on every path that trains inside the process "
        "group, before building the optimizer."
    ),
)
