"""DD107 moved-after-wrap: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD107"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="moved-after-wrap",
    severity=Severity.MEDIUM,
    summary=".to()/.cuda() on the model after DDP wrapping",
    what=prose(
        """
        Static analysis looks for `.to(...)`, `.cuda(...)` (and dtype casts such as `.half()`) called on a
        model, or on its DDP wrapper, after the model was passed to `DistributedDataParallel(...)`.
        """
    ),
    why=prose(
        """
        DDP's constructor fixes its view of the model: it broadcasts rank 0's parameters and buffers, records
        the device (`device_ids`, inputs are moved there in every forward) and builds the gradient buckets and
        autograd hooks for the parameters as they are at that moment. PyTorch documents changing the
        parameters afterwards as unsupported ("you should never try to change your model's parameters after
        wrapping"). Moving or casting the model later leaves the reducer and the recorded device describing a
        model that no longer exists: depending on torch version and backend it fails at the first forward or
        backward with device or dtype mismatches, or runs with inputs placed for the old device.
        """
    ),
    example=snippet(
        """
        # Bad: moved after wrapping
        ddp = DDP(model)
        ddp.to(device)

        # Good: place (and cast) first, then wrap
        model = model.to(device)
        ddp = DDP(model, device_ids=[device.index])
        """
    ),
    example_context=snippet(
        """
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        model = Net()
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        loader = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set))
        ...
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        """
    ),
    fix=(
        "Move and cast the model to its device and dtype before wrapping it in DistributedDataParallel; do not "
        "call .to()/.cuda() on it afterwards."
    ),
    run_only="moving the model after wrapping breaks or slows the run",
)
