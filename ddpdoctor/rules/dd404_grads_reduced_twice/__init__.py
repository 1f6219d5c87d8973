"""DD404 grads-reduced-twice: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import DDP_SET_UP, Rule, Setting, prose, snippet

CODE = "DD404"

# The probe half's thresholds.
UNCHANGED = 0.05  # |ratio - 1| below this: the script divided again, only the communication is doubled

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("reduced_twice_unchanged", UNCHANGED, "|ratio - 1|",
                "below this the script divided again: only the communication is doubled"),
    ),
    name="grads-reduced-twice",
    severity=Severity.HIGH,
    summary="gradients all-reduced by hand on top of DDP",
    what=prose(
        """
        Static analysis looks for `dist.all_reduce(p.grad, ...)` (or an `average_gradients` helper that does
        it) over the parameters of a model that is wrapped in DDP.

        The probe records collectives on parameter gradients after DDP's own reduction in the same step, and
        the ratio of the gradient the optimizer used to the one DDP produced.
        """
    ),
    why=prose(
        """
        DDP already averages gradients during backward, so after `loss.backward()` every rank holds the same
        averaged gradient. A second `all_reduce` with the default SUM multiplies it by the world size, which
        multiplies the effective learning rate by N (8x on 8 GPUs): training diverges or converges to a
        worse solution, and the damage grows with the number of GPUs. Followed by a division by the world
        size it is numerically redundant but doubles the communication.
        """
    ),
    example=snippet(
        """
        # Bad: DDP already averaged the gradients; this sums them again (x world size)
        loss.backward()
        for p in ddp.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()

        # Good
        loss.backward()
        optimizer.step()
        """
    ),
    example_context=DDP_SET_UP + snippet(
        """
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        loader = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            ...
        """
    ),
    fix="Remove the manual all_reduce of gradients; DDP already averages them during backward.",
)
