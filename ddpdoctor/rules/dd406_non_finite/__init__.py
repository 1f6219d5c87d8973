"""DD406 non-finite: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD406"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="non-finite",
    severity=Severity.HIGH,
    summary="NaN/Inf in loss, gradients or BN running_var",
    what=prose(
        """
        The probe checks the loss, the gradients and every BatchNorm running_mean and running_var for NaN
        or Inf at each observed step, and reports the first step, rank, and tensors where they appeared.
        """
    ),
    why=prose(
        """
        One non-finite gradient on one rank becomes non-finite on every rank after DDP's all-reduce (NaN + x
        is NaN), so a single bad sample poisons all replicas at once. A NaN or Inf in a BatchNorm running
        variance is subtler: training normalises with batch statistics and can look healthy, but the model
        evaluates with the running statistics and outputs garbage, and under the default buffer broadcast a
        corrupt rank 0 copies its buffers to every rank. Occasional Inf gradients are expected under a
        GradScaler (it skips those steps and lowers the scale); a non-finite loss, parameters or statistics
        are not. Typical causes are an unstable loss (log of a softmax that underflowed), a learning rate
        scaled up without warmup (DD401, DD402), or float16 without loss scaling.
        """
    ),
    example=snippet(
        """
        # Bad: softmax underflows to 0 and log(0) = -inf; -inf * 0 = nan
        loss = -(torch.log(torch.softmax(logits, dim=1)) * one_hot).sum(dim=1).mean()

        # Good: the fused, numerically stable form
        loss = F.cross_entropy(logits, targets)
        """
    ),
    fix=(
        "Look at the first step and rank where a value became non-finite (in the evidence): make the loss "
        "numerically stable, lower or warm up the learning rate, and use a GradScaler with float16."
    ),
)
