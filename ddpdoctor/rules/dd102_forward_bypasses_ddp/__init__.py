"""DD102 forward-bypasses-ddp: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD102"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="forward-bypasses-ddp",
    severity=Severity.CRITICAL,
    summary="training forward runs through the unwrapped module; DDP forward never runs while steps happen",
    what=prose(
        """
        Static analysis looks for a model passed to `DistributedDataParallel(...)` and then called directly
        (`model(x)`, or `ddp.module(x)`) in the training loop, the code that also calls `backward()` and
        `optimizer.step()`, instead of calling the wrapper.

        The probe counts, per rank, training-mode forwards of the wrapped module that did not go through
        DDP's forward, and fires when optimizer steps happen while DDP's forward never ran in between.
        """
    ),
    why=prose(
        """
        DDP reduces gradients from autograd hooks on the parameters, but the hooks only act after DDP's own
        forward has armed the reducer (`prepare_for_backward`). A forward through the inner module runs the
        same computation, its backward fills `.grad` with this rank's local gradient only, and nothing is
        all-reduced. Each rank then steps on its own shard's gradient: the replicas drift apart from the first
        step (measured on torch 2.13: parameter difference 0.14 after 3 steps), DDP's buffer broadcast never
        runs either, and the run exits 0 without a warning.

        The result is N independent models, each trained on 1/N of the data with a learning rate tuned for
        the global batch; the checkpoint saved from rank 0 is one of them.
        """
    ),
    example=snippet(
        """
        # Bad: the wrapper is built, but the loop calls the inner module
        ddp = DDP(model, device_ids=[local_rank])
        for x, y in loader:
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        # Good: every training forward goes through the wrapper
        for x, y in loader:
            loss = criterion(ddp(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        """
    ),
    fix="Run the training forward through the DDP wrapper (ddp_model(x)), not through the module it wraps.",
    fix_variants={
        "probe": "Call the DDP-wrapped model (ddp_model(x)) in the training loop, not the module you wrapped.",
    },
    cost_note=prose(
        """
        critical although on 2 ranks it costs less than a train-mode evaluation (DD207): each rank trains its own
        model on 1/N of the data, at the per-rank batch, with the learning rate of the global one, so the cost
        grows with the number of ranks (the benchmark's 2 ranks leave each model half of digits).
        """
    ),
)
