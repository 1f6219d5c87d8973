"""DD207 eval-in-train-mode: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import DDP_SET_UP, Rule, prose, snippet

CODE = "DD207"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="eval-in-train-mode",
    severity=Severity.MEDIUM,
    summary="evaluation forward (no_grad) with BN layers in training mode: stats polluted, SyncBN syncs",
    what=prose(
        """
        Static analysis looks for an evaluation loop (model calls under `torch.no_grad()` or
        `torch.inference_mode()`, or in a function named like evaluate/validate/test) reached without a
        `model.eval()` on the model or its wrapper.

        The probe counts forwards of BatchNorm layers in training mode while gradients are disabled, and
        whether their running statistics changed or SyncBatchNorm synchronised during them.
        """
    ),
    why=prose(
        """
        `torch.no_grad()` turns off gradient recording, not training behaviour. BatchNorm in training mode
        normalises each evaluation batch with that batch's own statistics, so scores depend on the
        evaluation batch size and composition, and it updates running_mean and running_var with evaluation
        data: with the default momentum of 0.1, after ten evaluation batches 65% of the running statistics
        the model is saved with come from evaluation data. Dropout stays active too.
        SyncBatchNorm also synchronises during such an evaluation; if only some ranks evaluate, it hangs
        (DD206).
        """
    ),
    example=snippet(
        """
        # Bad: no_grad does not switch BatchNorm to eval mode
        with torch.no_grad():
            for x, y in val_loader:
                correct += (ddp(x).argmax(1) == y).sum().item()

        # Good
        ddp.eval()
        with torch.no_grad():
            for x, y in val_loader:
                correct += (ddp(x).argmax(1) == y).sum().item()
        ddp.train()
        """
    ),
    example_context=DDP_SET_UP + snippet(
        """
        train_set = TensorDataset(torch.randn(64, 8), torch.randint(4, (64,)))
        loader = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set))
        val_loader = loader
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        correct = 0
        """
    ),
    fix="Call model.eval() before evaluation and model.train() after it.",
    cost_note=prose(
        """
        medium, although on digits it cost 4.4 points (a model with BatchNorm and dropout: every evaluation batch
        normalised with its own statistics, dropout active, the running statistics fed evaluation data), more than
        several high rules: that cost exists only where the evaluated model holds BatchNorm or dropout layers, and
        a model without them (an EMA or teacher encoder of LayerNorm blocks) loses nothing, which a source pattern
        cannot tell apart. High is the measured case's severity once the probe confirms such layers in training
        mode during the evaluation.
        """
    ),
)
