"""DD215 micro-batch-bn: BatchNorm normalises each micro-batch under gradient accumulation.

What it does: the number of training forwards through DDP between optimizer steps (median over the steps of
every rank) is the accumulation factor; at 2 or more it reports the micro-batch BN normalised over (per rank, and
over its SyncBN group) against the samples one optimizer step averages. Likely when BN's batch is below
LARGE_SYNC_BATCH (DD204's threshold: below it the micro-batch statistics are noisy), possible above. The verdict
logic is shared with `ddpdoctor triage` (ddpdoctor.analyses.bn_checks.accumulation_of).
"""

from __future__ import annotations

from ddpdoctor.analyses.bn_checks import accumulation_of
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd215_micro_batch_bn import CODE

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the micro-batches measured per optimizer step through BN",
    measure=key("micro_batches"))


def analyze(ctx: RunContext) -> list[Finding]:
    found = accumulation_of(ctx)
    if found is None:
        return []
    measured, message, verdict = found
    return [ctx.finding(CODE, message=message, ranks=sorted(ctx.ranks), evidence=measured,
                        confidence=Confidence.LIKELY if verdict == "likely" else Confidence.POSSIBLE,
                        magnitude=float(measured["micro_batches"]))]
