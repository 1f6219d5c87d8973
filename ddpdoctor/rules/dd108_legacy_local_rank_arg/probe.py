"""DD108 legacy-local-rank-arg: the script takes its local rank from a --local_rank argument that torchrun does
not pass.

What it does: the probe passes --local_rank=N as torch.distributed.launch did (so the rest can be measured) and
records the option's default on every rank. A default equal to each rank's LOCAL_RANK means the script falls
back to the environment (fine); a constant default means every rank would get the same value under torchrun.
"""

from __future__ import annotations

from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd108_legacy_local_rank_arg import CODE


def analyze(ctx: RunContext) -> list[Finding]:
    per_rank = {r: p.first("local_rank_arg") for r, p in ctx.ranks.items()}
    per_rank = {r: e for r, e in per_rank.items() if e is not None}
    if not per_rank:
        return []
    injected = any(e.get("injected") for e in per_rank.values())
    falls_back = all(
        e.get("env_local_rank") is not None and str(e.get("default")) == str(e.get("env_local_rank"))
        for e in per_rank.values()
    )
    if falls_back and len(per_rank) > 1:
        return []
    first = next(iter(per_rank.values()))
    option = (first.get("option_strings") or ["--local_rank"])[0]
    defaults = sorted({str(e.get("default")) for e in per_rank.values()})
    if first.get("required"):
        consequence = "argparse exits with an error on every rank under torchrun, which does not pass it"
    else:
        consequence = (
            f"under torchrun, which does not pass it, every rank gets the default {defaults[0]} and the ranks share "
            "one device"
        )
    how = "; the probe passed it as torch.distributed.launch did" if injected else ""
    message = f"the script reads its local rank from {option} (declared at {ctx.at(first.get('site'))}): {consequence}{how}"
    evidence = {
        "option_strings": first.get("option_strings"),
        "required": first.get("required"),
        "per_rank": {str(r): {"default": e.get("default"), "value": e.get("value"), "LOCAL_RANK": e.get("env_local_rank")}
                     for r, e in per_rank.items()},
        "injected_by_probe": injected,
    }
    return [
        ctx.finding(
            CODE,
            message=message,
            fix_variant="probe",
            fix_args={"option": option},
            site=first.get("site"),
            ranks=list(per_rank),
            evidence=evidence,
        )
    ]
