"""DD213 stale-running-stats: the rule's catalog entry and its documentation.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half; `ddpdoctor triage` (ddpdoctor/triage/) also decides it across arms.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, Setting, prose, snippet

CODE = "DD213"

# running mean vs population mean, in population standard deviations (median over layers): likely / possible, when
# also beyond 3 / 2 standard errors of the population estimate
LAG_LIKELY, LAG_POSSIBLE = 0.2, 0.1
# running variance vs population variance, relative (median over channels and layers)
VAR_LAG_LIKELY, VAR_LAG_POSSIBLE = 0.2, 0.1

RULE = Rule(
    package=__name__,
    code=CODE,
    settings=(
        Setting("mean_lag_likely", LAG_LIKELY, "population standard deviations",
                "running mean this far from the population mean (median over layers, past 3 standard errors): likely"),
        Setting("mean_lag_possible", LAG_POSSIBLE, "population standard deviations",
                "the same, beyond 2 standard errors: possible"),
        Setting("var_lag_likely", VAR_LAG_LIKELY, "relative",
                "running variance this far from the population variance (median over channels and layers): likely"),
        Setting("var_lag_possible", VAR_LAG_POSSIBLE, "relative",
                "the same: possible"),
    ),
    name="stale-running-stats",
    severity=Severity.INFO,
    summary=(
        "running statistics lag the population statistics at the current weights (EMA lag under a large lr "
        "or small momentum)"
    ),
    what=prose(
        """
        The probe, in each arm of `ddpdoctor triage`, recomputes at the end of its steps and at fixed
        weights PreciseBN-style population statistics: a copy of the model is run in train mode over the last few
        training batches with the running statistics reset to a cumulative average. The finding compares the
        running statistics the layers hold with them (the mean in units of the channel's standard deviation,
        the variance relatively), with the sampling error of the population estimate as an interval.
        """
    ),
    why=prose(
        """
        Running statistics are an exponential moving average over past batches, computed by past weights.
        With a large learning rate (a scaled-up lr, a warmup peak) or a small momentum the weights move
        faster than the average forgets, so evaluation normalises with statistics of a network that no longer
        exists. It affects plain and SyncBN runs alike; PreciseBN (Wu & Johnson 2021) recomputes them at the
        final weights.
        """
    ),
    example=snippet(
        """
        # Bad: evaluate with whatever the EMA holds after a high-lr epoch
        model.eval(); evaluate(model)

        # Good: recompute the statistics at the final weights first
        torch.optim.swa_utils.update_bn(train_loader_subset, model)
        model.eval(); evaluate(model)
        """
    ),
    fix="Recompute BN statistics at the final weights before evaluating (update_bn / PreciseBN).",
)
