"""DD303 eval-sampler-padding: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD303"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="eval-sampler-padding",
    severity=Severity.LOW,
    summary="DistributedSampler on evaluation data pads duplicates (len % world != 0)",
    what=prose(
        """
        Static analysis looks for a DistributedSampler over an evaluation dataset (used under `no_grad()`, in
        an evaluation function, or named like val/test/eval).

        The probe fires when an evaluation sampler's dataset length is not a multiple of the world size, with
        the number of duplicated (or, with `drop_last=True`, dropped) samples.
        """
    ),
    why=prose(
        """
        DistributedSampler gives every rank the same number of samples. With `drop_last=False` (the default)
        it pads the index list by repeating indices from its start until the length is divisible by the
        world size; with `drop_last=True` it drops the tail. Evaluated this way, up to N - 1 samples count
        twice (or are skipped): 50,000 validation images on 3 ranks are scored as 50,001. The reported
        accuracy then differs from a single-GPU evaluation and changes with the world size, and close model
        comparisons or best-checkpoint choices can flip on it.
        """
    ),
    example=snippet(
        """
        # Bad: 50,000 images on 3 ranks: one image is scored twice
        val_sampler = DistributedSampler(val_set, shuffle=False)
        val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler)

        # Good: unpadded shards, then sum the counts over ranks
        val_shard = Subset(val_set, range(rank, len(val_set), world_size))
        val_loader = DataLoader(val_shard, batch_size=256)
        correct, count = evaluate(ddp.module, val_loader)
        totals = torch.tensor([correct, count], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        accuracy = (totals[0] / totals[1]).item()
        """
    ),
    example_context=snippet(
        """
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        ddp = DDP(Net().to(device), device_ids=[local_rank])
        val_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))


        @torch.no_grad()
        def evaluate(model, loader):
            model.eval()
            correct = count = 0
            for x, y in loader:
                correct += (model(x).argmax(1) == y).sum().item()
                count += len(y)
            return correct, count


        ...
        print(evaluate(ddp.module, val_loader))
        """
    ),
    fix=(
        "Evaluate without padding: shard with range(rank, len(dataset), world_size) and all-reduce the "
        "(correct, count) sums, or evaluate the full set on one rank."
    ),
)
