"""DD403 accumulation-without-no-sync: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import DDP_SET_UP, Rule, prose, snippet

CODE = "DD403"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="accumulation-without-no-sync",
    severity=Severity.LOW,
    summary="gradient accumulation all-reduces on every micro-step",
    what=prose(
        """
        Static analysis looks for a DDP training loop that calls `backward()` every iteration but
        `optimizer.step()` only every k-th (gradient accumulation) without running the other micro-steps
        under `ddp.no_sync()` — also when the step's test is a flag computed first (`last = (i + 1) % k ==
        0`) or passed to a helper that runs backward and the step (an AMP loss scaler called with
        `update_grad=(i + 1) % k == 0`).

        The probe counts DDP gradient all-reduces per optimizer step and fires when there is more than one.
        """
    ),
    why=prose(
        """
        Every backward through DDP all-reduces the gradients unless it runs under `no_sync()`, so k
        micro-steps cost k all-reduces per optimizer step instead of one. The result is numerically the same
        up to float round-off (averaging is linear), so this costs time rather than accuracy, hence the low
        severity: k times the gradient communication per update, which can dominate the step time of a
        large model on a slow interconnect.
        """
    ),
    example=snippet(
        """
        # Bad: an all-reduce after every micro-batch
        for i, (x, y) in enumerate(loader):
            (criterion(ddp(x), y) / accum).backward()
            if (i + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()

        # Good: accumulate locally, reduce once per optimizer step
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % accum == 0
            with contextlib.nullcontext() if last else ddp.no_sync():
                (criterion(ddp(x), y) / accum).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
        """
    ),
    example_context=DDP_SET_UP + snippet(
        """
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        loader = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        criterion = nn.CrossEntropyLoss()
        accum = 4
        """
    ),
    fix="Run the forward and backward of every micro-step except the last under ddp.no_sync().",
    fix_names={"ddp": "wrapper"},
    run_only="all-reducing on every micro-step only costs time",
)
