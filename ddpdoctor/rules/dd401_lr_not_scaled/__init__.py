"""DD401 lr-not-scaled: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.dd402_no_warmup import SCALE_THRESHOLD
from ddpdoctor.rules.rule import DDP_SET_UP, Rule, Setting, prose, snippet

CODE = "DD401"

# The probe half's thresholds.
TOLERANCE = 1.25  # an lr within this factor of the scaled reference is not a finding
CLEAR_WITHIN = 1.1  # an lr this close to the scaled reference clears the static finding (a measured match)

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("lr_tolerance", TOLERANCE, "factor",
                "an lr within this factor of the scaled reference is not a finding"),
        Setting("lr_clear_within", CLEAR_WITHIN, "factor",
                "an lr this close to the scaled reference clears the static finding (a measured match)"),
    ),
    name="lr-not-scaled",
    severity=Severity.HIGH,
    summary="lr does not follow the global batch vs the reference recipe (linear/sqrt rule)",
    what=prose(
        """
        Static analysis flags an optimizer of a DDP-trained model whose learning rate is a literal, an
        argparse default or the optimizer's default while nothing in the file scales it by the world size:
        `possible` at low severity, since the value may already be tuned for this world size; `likely` and
        high where the file itself shows the single-process recipe (the lr scaled with the per-process batch
        only). The same lr also training the script's non-DDP run is said in the message but stays low: nothing
        says which of the two runs it was tuned for.

        The probe, given the single-process recipe the script was ported from (`--base-lr` and
        `--base-batch`, or `base_lr`/`base_batch` in `[tool.ddpdoctor]`), measures the real global batch (per-rank
        batch × world size × accumulation) and the learning rate in the optimizer's param_groups at the first
        step; it confirms the static finding or clears it, and fires when the learning rate differs from
        base_lr × (global batch / base batch) under the linear rule or base_lr × sqrt(global batch / base
        batch) under the square-root rule (`--lr-scaling auto` picks sqrt for Adam-family, LAMB, Adagrad and
        RMSprop, linear otherwise), with the expected and actual values in evidence.
        """
    ),
    why=prose(
        """
        DDP averages gradients over ranks, so one step with a per-rank batch b on N ranks is one step on a
        global batch of N × b. A recipe tuned at batch B with learning rate lr takes (N × b) / B times fewer
        steps per epoch after the port; keeping lr unchanged makes each epoch cover less distance and the run
        underfits in the recipe's epoch budget. The linear scaling rule for SGD (lr × N × b / B, Goyal et
        al., 2017) keeps the progress per sample; for adaptive optimisers the square-root rule is the one
        that preserves the update noise (Malladi et al., 2022). The opposite mistakes are as common:
        multiplying lr by the world size after dividing the per-GPU batch so that the global batch stayed B,
        and dividing lr by the world size in the belief that DDP sums gradients (it averages them).
        """
    ),
    example=snippet(
        """
        # Bad: recipe tuned at batch 256 with lr 0.1; now 8 GPUs x 128 = 1024 per step
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        # Good: linear scaling for SGD (square root of the ratio for Adam-family optimisers)
        global_batch = 128 * dist.get_world_size()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * global_batch / 256, momentum=0.9)
        """
    ),
    example_context=DDP_SET_UP + snippet(
        """
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        loader = DataLoader(train_set, batch_size=128, sampler=DistributedSampler(train_set))
        ...
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        """
    ),
    fix=(
        "Scale the learning rate with the global batch: lr = base_lr * global_batch / base_batch for SGD, "
        "the square root of that ratio for Adam-family optimisers."
    ),
    fix_variants={
        "probe": (
            f"Set lr = {{base_lr}} × {{ratio}} = {{expected}} (and warm up when scaling by {SCALE_THRESHOLD:g}× or "
            "more)."
        ),
    },
)
