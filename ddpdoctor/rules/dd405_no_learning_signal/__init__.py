"""DD405 no-learning-signal: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, Setting, prose, snippet

CODE = "DD405"

# The probe half's thresholds.
MIN_STEPS = 2  # optimizer steps without any non-zero gradient before it fires
MIN_LOSSES = 3  # backward passes with a bit-identical loss before it fires

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("no_signal_steps", MIN_STEPS, "optimizer steps",
                "steps without any non-zero gradient before the rule fires"),
        Setting("no_signal_losses", MIN_LOSSES, "backward passes",
                "passes with a bit-identical loss before the rule fires"),
    ),
    name="no-learning-signal",
    severity=Severity.HIGH,
    summary="all gradients exactly zero, or loss constant, across the probe's steps",
    what=prose(
        """
        The probe records the gradient norm of every parameter at each optimizer step and the loss value,
        and fires when every gradient is exactly zero (or None) at every observed step, or the loss is
        exactly the same at every step.
        """
    ),
    why=prose(
        """
        A model whose parameters receive no gradient, or whose loss does not move, is not training at all;
        its accuracy stays where the initialisation put it. The usual causes are ordering and identity
        mistakes: `zero_grad()` between `backward()` and `step()`, a loss rebuilt from detached values
        (`torch.tensor(loss.item(), requires_grad=True)` backpropagates into nothing), an optimizer built over
        parameters the model no longer uses (a conversion that cloned them, a model rebuilt after the
        optimizer), frozen parameters (`requires_grad=False` after loading) or a learning rate of zero.
        """
    ),
    example=snippet(
        """
        # Bad: gradients cleared between backward and step
        loss.backward()
        optimizer.zero_grad()
        optimizer.step()

        # Good
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        """
    ),
    fix=(
        "Make the loss reach the trained parameters: zero_grad, backward, then step, with an optimizer built "
        "over the model's current parameters and a non-zero learning rate."
    ),
)
