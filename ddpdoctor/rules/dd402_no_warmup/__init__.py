"""DD402 no-warmup: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import DDP_SET_UP, Rule, Setting, prose, snippet

CODE = "DD402"

# An lr this many times the reference recipe's needs a warmup (Goyal et al. warm up from the base rate; `why`).
SCALE_THRESHOLD = 4.0

# The probe half's thresholds.
RAMP = 1e-6  # relative increase that counts as the lr going up

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("warmup_lr_scale", SCALE_THRESHOLD, "times the recipe's lr",
                "an lr scaled this much needs a warmup"),
        Setting("lr_ramp", RAMP, "relative",
                "an increase of the lr above this counts as the lr going up"),
    ),
    name="no-warmup",
    severity=Severity.LOW,
    summary=f"lr scaled up by >= {SCALE_THRESHOLD:g}x with no warmup schedule",
    what=prose(
        f"""
        Static analysis looks for a learning rate scaled to {SCALE_THRESHOLD:g} or more times the recipe's
        (from `--base-lr` or an expression such as `lr * world_size`) with no warmup: no LinearLR, OneCycleLR,
        LambdaLR or SequentialLR ramp and no per-step assignment to `param_group["lr"]`.

        The probe reads the learning rate at each observed step and fires when it starts at
        {SCALE_THRESHOLD:g}x or more the recipe's and does not ramp up.
        """
    ),
    why=prose(
        """
        The linear scaling rule breaks down at the start of training, when the network changes fast: a large
        learning rate from the first step can diverge or settle in a worse region that later epochs do not
        recover from. Goyal et al. (2017) matched batch 256 (23.6% ResNet-50 top-1 error) at batch 8192 only
        with a gradual warmup from the base rate to the scaled rate over the first 5 epochs (23.7%); without
        warmup the same run reached 24.8%.
        """
    ),
    example=snippet(
        """
        from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

        # Bad: the recipe's lr of 0.1 scaled to 8 GPUs (0.8) from the first step
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * dist.get_world_size(), momentum=0.9)
        scheduler = CosineAnnealingLR(optimizer, T_max=total_steps)

        # Good: 5 epochs of linear warmup from the recipe's lr (0.1), then the schedule
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * dist.get_world_size(), momentum=0.9)
        warmup_steps = 5 * steps_per_epoch
        warmup = LinearLR(optimizer, start_factor=1 / dist.get_world_size(), total_iters=warmup_steps)
        cosine = CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps)
        scheduler = SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])
        """
    ),
    example_context=DDP_SET_UP + snippet(
        """
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        loader = DataLoader(train_set, batch_size=128, sampler=DistributedSampler(train_set))
        steps_per_epoch = len(loader)
        total_steps = 90 * steps_per_epoch
        ...
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            scheduler.step()
        """
    ),
    fix="Warm up: ramp the lr linearly from the recipe's value to the scaled value over the first ~5 epochs.",
)
