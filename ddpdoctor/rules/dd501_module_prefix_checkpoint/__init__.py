"""DD501 module-prefix-checkpoint: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import DDP_SET_UP, Rule, prose, snippet

CODE = "DD501"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="module-prefix-checkpoint",
    severity=Severity.MEDIUM,
    summary="checkpoint saved from the DDP wrapper (keys start with \"module.\")",
    what=prose(
        """
        Static analysis looks for `torch.save(...)` of `ddp.state_dict()` where `ddp` is the DDP wrapper
        rather than `ddp.module`. A resume checkpoint that the script loads back into the wrapper is not
        reported when the script also saves the plain model's weights (or a part of them, a backbone) for
        everything else; without them it is reported at low (resuming works: what breaks is another program
        that loads it into the plain model).

        The probe inspects state dicts passed to `torch.save` and fires when their keys start with
        "module."; low when the run (or, statically, the script) loads the checkpoint back only into the
        wrapper; info when the same run also saved the plain weights of that model or of a part of it (its
        keys are the checkpoint's with one prefix such as "module.backbone." removed).
        """
    ),
    why=prose(
        """
        DDP holds the network as its child named `module`, so the wrapper's state dict keys read
        "module.conv1.weight" instead of "conv1.weight". Loading such a checkpoint into the plain network
        fails with missing and unexpected keys, and the common workaround, `strict=False`, loads nothing at
        all without complaint (DD503): evaluation, fine-tuning or a resumed run starts from random weights.
        """
    ),
    example=snippet(
        """
        # Bad: keys are "module.conv1.weight", ...
        torch.save(ddp.state_dict(), "ckpt.pt")

        # Good: save the network itself
        if dist.get_rank() == 0:
            torch.save(ddp.module.state_dict(), "ckpt.pt")
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
    fix=(
        "Save ddp.module.state_dict(); strip the prefix from existing checkpoints with "
        "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state_dict, \"module.\")."
    ),
    fix_names={"ddp": "wrapper"},
    run_only="a prefixed checkpoint fails to load, loudly",
    cost_note=prose(
        """
        medium, below what the benchmark measures: its row measures DD501 with DD503 (the wrapper's checkpoint
        loaded with strict=False: nothing loads, the evaluated network is its random initialisation). Alone the
        weights are intact: a strict load raises at once, and a script that resumes into the wrapper loses
        nothing (the finding is then low).
        """
    ),
)
