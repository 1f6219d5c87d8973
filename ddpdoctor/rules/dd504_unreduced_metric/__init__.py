"""DD504 unreduced-metric: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD504"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="unreduced-metric",
    severity=Severity.LOW,
    summary="evaluation metric computed per rank and reported without a reduction",
    what=prose(
        """
        Static analysis looks for an evaluation metric (accuracy, loss, counts accumulated in an evaluation
        loop over a distributed loader) that is printed, logged or compared for checkpoint selection without
        an `all_reduce`, `all_gather` or `reduce` on it. Results each rank writes to a file before a barrier
        that the main rank then merges (a gather through the file system) count as reduced.

        The probe catches the Horovod variant: `hvd.allreduce(t)`, `hvd.allgather(t)` and `hvd.broadcast(t)`
        return a new tensor and leave `t` alone (only `hvd.allreduce_` works in place), so a call whose result
        is thrown away (`hvd.allreduce(loss)` as a statement) reduces nothing. It reports the value each rank
        kept and the value the reduction returned.
        """
    ),
    why=prose(
        """
        With a DistributedSampler each rank evaluates 1/N of the validation set. A metric reported by rank 0
        is the score of rank 0's shard: N times fewer samples, so noisier, and not the number a single-GPU
        evaluation of the same model gives. Best-checkpoint selection and early stopping on it follow that
        noise; when each rank decides on its own metric, ranks can disagree about stopping and the job
        hangs.
        """
    ),
    example=snippet(
        """
        # Bad: rank 0 reports the accuracy of its own shard
        if rank == 0:
            print(f"val acc {correct / total:.4f}")

        # Good: sum the counts over ranks first
        totals = torch.tensor([correct, total], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        if rank == 0:
            print(f"val acc {(totals[0] / totals[1]).item():.4f}")
        """
    ),
    example_context=snippet(
        """
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        rank = dist.get_rank()
        ddp = DDP(Net().to(device), device_ids=[local_rank])
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        val_loader = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set, shuffle=False))
        ddp.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                correct += (ddp(x).argmax(1) == y).sum().item()
                total += len(y)
        """
    ),
    fix="All-reduce the metric's sums (e.g. correct and count) across ranks before dividing, logging or comparing.",
)
