"""DD211 syncbn-stats-wrong: a SyncBN-like layer applied statistics other than its group's exact ones.

What it does: for every SyncBN-like layer recorded by the applied-statistics recorder in the first optimizer steps
(and not deliberately normalising per rank, as triage arm L does), recovers the mean and variance it applied from
its input/output moments and compares them with the exact statistics of its process group (Chan's combination of
the ranks' recorded counts, means and variances), of the rank's own batch and of the world, within a tolerance
from floating-point rounding (`bn_checks.applied_statistics`). Fires when the group's statistics do not explain
the output on a measured channel: the applied statistics are the rank's own (a SyncBN that does not sync) or match
none of the candidates (a biased combination). Reports the median and largest error of the recovered mean (in
standard deviations) and variance (relative) and how many channels could be measured.
"""

from __future__ import annotations

from ddpdoctor.analyses import bn_checks
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_num, pct
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd211_syncbn_stats_wrong import CODE

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the SyncBN layers whose applied statistics were measured off the global batch's",
    measure=key("layers"))


def verdicts(ctx: RunContext) -> list[bn_checks.LayerVerdict]:
    key = "bn_applied_verdicts"
    if key not in ctx.memo:
        ranks = sorted(ctx.ranks)
        ctx.memo[key] = bn_checks.applied_verdicts(bn_checks.applied(ctx.run), ranks) if len(ranks) > 1 else []
    return ctx.memo[key]


def analyze(ctx: RunContext) -> list[Finding]:
    wrong = [v for v in verdicts(ctx) if v.applied not in (v.expected, "not_measured")]
    if not wrong:
        return []
    first = wrong[0]
    if first.applied == "local":
        what = "its rank's own batch statistics, not its group's"
    elif first.applied == "world":
        what = "the statistics of all ranks, not of its group"
    else:
        what = "statistics that are neither its group's exact ones nor any rank's own"
    errors = ""
    if first.mean_error is not None and first.var_error is not None:
        errors = (
            f"; against the exact group statistics the applied mean is off by {fmt_num(first.mean_error)} std "
            f"(max {fmt_num(first.max_mean_error or 0.0)}) and the variance by {pct(first.var_error)} "
            f"(max {pct(first.max_var_error or 0.0)})"
        )
    message = (
        f"{len(wrong)} SyncBN layer{'s' if len(wrong) != 1 else ''} ({first.cls}) normalised with {what}: "
        f"`{first.name}`'s outputs on {first.measured_channels} of {first.channels} measured channels are not "
        f"explained by the exact statistics of its process group{errors}"
    )
    evidence = {
        "layers": [
            {"name": v.name, "cls": v.cls, "applied": v.applied, "worst_z": bn_checks_round(v.worst_z),
             "mean_error_std": v.mean_error, "var_error_rel": v.var_error, "max_mean_error_std": v.max_mean_error,
             "max_var_error_rel": v.max_var_error, "measured_channels": v.measured_channels,
             "channels": v.channels, "forwards": v.forwards}
            for v in wrong
        ][:16],
        "checked_layers": len(verdicts(ctx)),
    }
    return [ctx.finding(CODE, message=message, ranks=sorted(ctx.ranks), evidence=evidence,
                        magnitude=float(first.max_var_error or 0.0) + float(first.max_mean_error or 0.0))]


def bn_checks_round(values: dict) -> dict:
    return {k: (None if v is None else float(f"{v:.4g}")) for k, v in values.items()}
