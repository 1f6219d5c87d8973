"""DD301 sampler-not-reshuffled: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import DDP_SET_UP, Rule, prose, snippet

CODE = "DD301"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="sampler-not-reshuffled",
    severity=Severity.HIGH,
    summary="DistributedSampler(shuffle=True) whose order repeats across epochs (set_epoch missing/constant)",
    what=prose(
        """
        Static analysis looks for a DistributedSampler with `shuffle=True` (the default) iterated in an epoch
        loop where `sampler.set_epoch(...)` is never called, is called with a constant, or is called outside
        the loop.

        The probe records the index order each rank's sampler yields in every epoch and the epochs passed to
        `set_epoch`, and fires when two epochs produce the same order.
        """
    ),
    why=prose(
        """
        DistributedSampler shuffles with a generator seeded with `seed + epoch`, where `seed` defaults to 0
        and `epoch` changes only when `set_epoch` is called. Without it every epoch uses the same
        permutation: each sample stays on the same rank, in the same batch with the same batch-mates, at the
        same position in the epoch. Training becomes a fixed cyclic pass over frozen batches instead of
        stochastic gradient descent over fresh ones; with per-GPU BatchNorm every sample is also always
        normalised with the same neighbours. Losing the reshuffle costs accuracy, and since a single-GPU
        DataLoader with `shuffle=True` reshuffles by itself, the problem appears only after the port.
        """
    ),
    example=snippet(
        """
        # Bad: the same permutation every epoch
        sampler = DistributedSampler(train_set, shuffle=True)
        loader = DataLoader(train_set, batch_size=32, sampler=sampler)
        for epoch in range(epochs):
            for x, y in loader:
                train_step(x, y)

        # Good: a new permutation per epoch, the same on every rank
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                train_step(x, y)
        """
    ),
    example_context=DDP_SET_UP + snippet(
        """
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        epochs = 3


        def train_step(x, y):
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()


        sampler = DistributedSampler(train_set, shuffle=True)
        loader = DataLoader(train_set, batch_size=32, sampler=sampler)
        """
    ),
    fix="Call sampler.set_epoch(epoch) at the start of every epoch, before iterating the DataLoader.",
)
