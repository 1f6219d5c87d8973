"""DD214 bn-train-test-inconsistency (one run): how much the eval-mode output moves between running and population
statistics.

What it does: reads the `eval_output_shift` of the `bn_population` events a `ddpdoctor triage` arm records at its
end (silent in `check` runs, which record none): the relative L2 change of the model's eval-mode output on a held
training batch when the running statistics are replaced by the population statistics of every rank's held
batches, median over ranks (`ddpdoctor.analyses.bn_checks.population`). Likely above SHIFT_LIKELY, possible above
SHIFT_POSSIBLE (this rule's parameters). Across arms `ddpdoctor triage` decides whether SyncBN changes it.
"""

from __future__ import annotations

from ddpdoctor.analyses.bn_checks import population
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.formatting import fmt_measure as fmt_num
from ddpdoctor.rules.dd214_bn_train_test_inconsistency import CODE, SHIFT_LIKELY, SHIFT_POSSIBLE

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the measured shift of the evaluation outputs between batch and running statistics",
    measure=key("eval_output_shift"))


def analyze(ctx: RunContext) -> list[Finding]:
    pop = population(ctx)
    shift = None if pop is None else pop.get("eval_output_shift")
    if shift is None or shift <= SHIFT_POSSIBLE or pop.get("shift_not_measurable"):
        return []  # shift_not_measurable: running statistics still warming up, or a shift against an output near 0
    message = (f"evaluating with the running statistics instead of population statistics recomputed at the final "
               f"weights changes the model's eval output by {fmt_num(100 * shift)}% (relative L2, on a held "
               "training batch)")
    return [ctx.finding(CODE, message=message, ranks=sorted(ctx.ranks), evidence={"eval_output_shift": shift},
                        confidence=Confidence.LIKELY if shift > SHIFT_LIKELY else Confidence.POSSIBLE,
                        magnitude=shift)]
