"""DD213 stale-running-stats (one run): running statistics against PreciseBN population statistics at the final
weights.

What it does: reads the `bn_population` events a `ddpdoctor triage` arm records at its end (the recorder only runs
in triage arms, so a `check` run has none and this analysis is silent): per layer the running mean's distance
from the population mean of every rank's held batches, in the population's standard deviations (RMS over
channels), and the running variance's relative distance (median over channels), median over layers; fires when
that lag is material against the population estimate's own sampling error (`ddpdoctor.analyses.bn_checks.lag_level`).
Across arms `ddpdoctor triage` decides whether the lag differs between SyncBN and per-rank statistics.
"""

from __future__ import annotations

from ddpdoctor.analyses.bn_checks import lag_level, population
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.formatting import fmt_measure as fmt_num
from ddpdoctor.rules.dd213_stale_running_stats import CODE


# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
def _lag(evidence: dict) -> float | None:
    """The larger of the two lags the finding fires on: the running mean's (in standard deviations) and the
    running variance's (relative)."""
    values = [v for v in (key("mean_lag_std")(evidence), key("var_lag_rel")(evidence)) if v is not None]
    return max(values) if values else None


CONSEQUENCE = Consequence(
    what="the measured lag of the running statistics behind the population (mean in standard deviations, variance "
    "relative)",
    measure=_lag)


def analyze(ctx: RunContext) -> list[Finding]:
    pop = population(ctx)
    if pop is None:
        return []
    level = lag_level(pop)
    if level in ("ruled_out", "not_measurable"):  # not_measurable: still warming up, or unbounded (the reason)
        return []
    message = (f"the running statistics lag population statistics recomputed at the final weights (PreciseBN on "
               f"held training batches): mean off by {fmt_num(pop['mean_lag_std'])} std, variance by "
               f"{fmt_num(100 * pop['var_lag_rel'])}% (median over {pop['layers']} layers; population estimate "
               f"±{fmt_num(pop['population_se_std'] or 0)} std)")
    return [ctx.finding(CODE, message=message, ranks=sorted(ctx.ranks), evidence=pop,
                        confidence=Confidence.LIKELY if level == "likely" else Confidence.POSSIBLE,
                        magnitude=pop["mean_lag_std"])]
