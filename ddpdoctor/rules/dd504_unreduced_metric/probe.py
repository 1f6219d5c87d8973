"""DD504 unreduced-metric, measured: a non-in-place Horovod reduction whose result the script throws away.

What it does: reads the `hvd_op` events of Horovod's collectives called from user code (recorded by the stand-in,
first calls per site). `hvd.allreduce(t)` (like `allgather`, `broadcast`) returns a NEW tensor and leaves `t` as it
was; a call whose result is discarded (an expression statement: the caller's next instruction pops it) reduced
nothing the script goes on to use. The finding gives, for the first calls at that site, the value each rank kept
and the value the reduction returned: how far the metric the script reports is from the job's.

Measured for a static "metric never reduced" suspicion: when the evaluation loop it names ran on every rank and
each rank then called a reducing collective (all_reduce, all_gather, reduce, gather...: the probe records the
first calls per call site) that the walk did not see, before its next optimizer step (a training loss reduced for
logging in the next epoch is not the metric), the suspicion is dropped with where the reduction ran; an
evaluation loop that did not run during the probe keeps it, with a note.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.consequence import key as evidence_key
from ddpdoctor.analyses.context import RunContext, fmt_num
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd504_unreduced_metric import CODE
from ddpdoctor.torchnames import REDUCING_COLLECTIVES

MEASURES = Measures(
    scope="site",
    what="the evaluation passes each rank ran and the reducing collectives it called after them; the value each rank "
    "kept from a Horovod reduction whose result the script threw away",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the Horovod reductions measured whose result the script threw away",
    measure=evidence_key("calls"))


def _measure_reductions(ctx: RunContext) -> None:
    for site in ctx.static_sites(CODE):
        loop_line = site["evidence"].get("eval_loop_line")
        if not loop_line:
            continue
        loop = {"file": site["file"], "line": loop_line}
        after: dict[int, dict[str, Any]] = {}
        ran: set[int] = set()
        for r, p in ctx.ranks.items():
            starts = [e for e in p.of("loader_iter") if ctx.ran_at(loop, [e.get("site")])]
            if not starts:
                continue
            ran.add(r)
            # between the first evaluation pass and the next optimizer step: a loss all_reduce'd for logging in
            # the next epoch's training is no reduction of the evaluation's metric
            s0 = min(int(e.get("seq") or 0) for e in starts)
            s1 = min((int(e.get("seq") or 0) for e in p.of("train_step") if int(e.get("seq") or 0) > s0),
                     default=None)
            hit = next((e for e in p.of("collective") if e.get("op") in REDUCING_COLLECTIVES
                        and int(e.get("seq") or 0) > s0 and (s1 is None or int(e.get("seq") or 0) < s1)), None)
            if hit is not None:
                after[r] = hit
        if not ran:
            ctx.not_measured(CODE, site=site, about=("eval_loop_line",),
                             reason=f"the evaluation loop at line {loop_line} did not run during the probe")
        elif set(after) == set(ctx.ranks) and len(ctx.ranks) > 1:
            first = next(iter(after.values()))
            ctx.measured(CODE, site=site, about=("eval_loop_line",), reason=(
                f"after the evaluation loop at line {loop_line} every rank called {first.get('op')} at "
                f"{ctx.at(first.get('site'))}: the metric is reduced across ranks"
            ))

FIRST_CALLS = 3  # calls per site shown in the evidence


def analyze(ctx: RunContext) -> list[Finding]:
    _measure_reductions(ctx)
    sites: dict[tuple[str, int], dict[str, Any]] = {}
    for p, e in ctx.run.events("hvd_op"):
        if not e.get("result_discarded"):
            continue
        site = e.get("site") or {}
        key = (str(site.get("file")), int(site.get("line") or 0))
        entry = sites.setdefault(key, {"site": site, "op": e.get("op"), "name": e.get("name"),
                                       "reduce_op": e.get("reduce_op"), "calls": {}})
        rank = p.rank if p.rank is not None else e.get("rank")
        entry["calls"].setdefault(int(e.get("call") or 0), {})[str(rank)] = {
            "kept": e.get("input_mean"), "returned": e.get("result_mean")}
    findings = []
    for entry in sites.values():
        calls = dict(sorted(entry["calls"].items())[:FIRST_CALLS])
        first = next(iter(calls.values()), {})
        kept = ", ".join(f"rank {r} {fmt_num(round(v['kept'], 4))}" for r, v in sorted(first.items())
                         if v.get("kept") is not None)
        returned = next((v["returned"] for v in first.values() if v.get("returned") is not None), None)
        differ = len({v.get("kept") for v in first.values()}) > 1
        op = f"hvd.{entry['op']}" + (f"(..., name={entry['name']!r})" if entry.get("name") else "")
        what = (entry.get("reduce_op") or "result").lower()
        message = (
            f"{op} at {ctx.at(entry['site'])} returns the {what} across ranks as a new tensor and the script throws it "
            "away: the tensor it goes on with is each rank's own"
            + (f" (first call: {kept}" + (f"; the {what} was {fmt_num(round(returned, 4))})" if returned is not None
                                         else ")") if kept else "")
            + (", so what it reports differs from rank to rank" if differ else "")
        )
        findings.append(
            ctx.finding(
                CODE,
                message=message,
                site=entry["site"],
                ranks=sorted({int(r) for c in calls.values() for r in c if str(r).lstrip("-").isdigit()}),
                evidence={"op": entry["op"], "name": entry.get("name"), "reduce_op": entry.get("reduce_op"),
                          "result_discarded": True, "calls": {str(k): v for k, v in calls.items()}},
                fix_detail=(
                    f"Use the result (t = hvd.{entry['op']}(t)), or reduce in place with hvd.{entry['op']}_(t)."
                    if entry["op"] in ("allreduce", "broadcast") else f"Use the result of hvd.{entry['op']}."
                ),
            )
        )
    return findings
