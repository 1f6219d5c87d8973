"""DD502 save-on-every-rank: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import DDP_SET_UP, Rule, prose, snippet

CODE = "DD502"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="save-on-every-rank",
    severity=Severity.LOW,
    summary="torch.save reached by every rank (or by local rank 0 of every node)",
    what=prose(
        """
        Static analysis looks for `torch.save(...)` in a distributed script that is not guarded by a global
        rank check (`dist.get_rank() == 0`, `rank == 0`), including saves guarded by `local_rank == 0`, which
        run once per node.

        The probe records the ranks that called `torch.save` on the same path.
        """
    ),
    why=prose(
        """
        Every rank writes the same file at the same time. On a shared filesystem the writes interleave or
        truncate each other, and the damage shows up later, when loading fails ("PytorchStreamReader failed
        reading zip archive") or a reader picks up a file that another rank is still rewriting.
        A `local_rank == 0` guard still gives one writer per node. It also costs N times the I/O, which
        slows down every checkpoint.
        """
    ),
    example=snippet(
        """
        # Bad: every rank writes the same file
        torch.save(ddp.module.state_dict(), "ckpt.pt")

        # Good: one writer, and nobody reads before it is done
        if dist.get_rank() == 0:
            torch.save(ddp.module.state_dict(), "ckpt.pt")
        dist.barrier()
        """
    ),
    example_context=DDP_SET_UP + snippet(
        """
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        loader = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        """
    ),
    fix="Save on global rank 0 only, then dist.barrier() before any rank reads the file.",
    run_only="concurrent saves put the checkpoint file at risk",
)
