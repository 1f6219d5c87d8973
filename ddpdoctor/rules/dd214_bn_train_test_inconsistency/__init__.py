"""DD214 bn-train-test-inconsistency: the rule's catalog entry and its documentation.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half; `ddpdoctor triage` (ddpdoctor/triage/) also decides it across arms.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, Setting, prose, snippet

CODE = "DD214"

# relative L2 change of the eval-mode output between running and population statistics: likely / possible
SHIFT_LIKELY, SHIFT_POSSIBLE = 0.05, 0.01

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("eval_shift_likely", SHIFT_LIKELY, "relative L2",
                "eval-mode output changed this much between running and population statistics: likely"),
        Setting("eval_shift_possible", SHIFT_POSSIBLE, "relative L2",
                "the same: possible"),
    ),
    name="bn-train-test-inconsistency",
    severity=Severity.LOW,
    summary=(
        "the statistics used in training and those used in evaluation differ enough to shift eval outputs"
    ),
    what=prose(
        """
        The probe, in each arm of `ddpdoctor triage`, next to the population statistics of DD213, runs the
        model's eval-mode forward on a held training batch twice, once with the running statistics and once with the
        population statistics, and reports the relative change of the output.
        """
    ),
    why=prose(
        """
        A model trained with batch statistics is evaluated with running statistics. When they disagree —
        lagging running averages, a normalisation batch much smaller or larger than the data's real
        variation, non-i.i.d. batches — the eval-mode network is not the one that was trained, and accuracy
        drops although training looked fine. Measuring the shift of the outputs says how much that matters
        for this model, which the size of the statistics' error alone does not.
        """
    ),
    example=snippet(
        """
        # Bad: running statistics from a few noisy per-GPU batches of 2
        model.eval(); evaluate(model)

        # Good: recalibrate, or normalise over a larger batch (SyncBN over a subgroup)
        torch.optim.swa_utils.update_bn(calibration_loader, model)
        """
    ),
    fix="Recalibrate BN statistics before evaluation, or normalise over batches that represent the data.",
)
