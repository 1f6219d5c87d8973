"""DD108 legacy-local-rank-arg: the script takes its local rank from a --local_rank argument that torchrun does
not pass.

What it does: the probe runs the script as torchrun does — without --local_rank, unless the option is required
(argparse would exit: then it passes --local_rank=N as torch.distributed.launch did, so the rest can be measured,
and says so) — and records the option's default and parsed value on every rank, and the first read of LOCAL_RANK
from the environment by the script or its own modules. The script falls back to the environment (no finding,
and a static DD108 is dropped with a note) when it reads LOCAL_RANK itself (timm's and DINO's helpers do, after
parsing) or when the option's default is each rank's LOCAL_RANK. Otherwise every rank keeps the same default:
reported, with what that default does (0 puts every rank on cuda:0, measured: DD105 folds under this finding; -1
names no GPU: `.cuda(-1)` raises before the first step). Under its own torchrun launch the probe gives each rank its
LOCAL_RANK in place of a default that names no device, as torch.distributed.launch passed it, so one fatal setup
bug does not hide the rest (SPEC "Diagnose past the first fatal bug"); the finding says so. A crash on the default
that still happened (DD902) folds under this finding.
"""

from __future__ import annotations

from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.consequence import key as evidence_key
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd105_device_not_bound.probe import placements
from ddpdoctor.rules.dd108_legacy_local_rank_arg import CODE

MEASURES = Measures(
    scope="run",
    what="the --local_rank option as every rank parsed it under torchrun, and the script's own reads of LOCAL_RANK",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the ranks measured parsing the legacy local-rank option",
    measure=evidence_key("per_rank"))


def analyze(ctx: RunContext) -> list[Finding]:
    per_rank = {r: p.first("local_rank_arg") for r, p in ctx.ranks.items()}
    per_rank = {r: e for r, e in per_rank.items() if e is not None}
    if not per_rank:
        return []
    injected = any(e.get("injected") for e in per_rank.values())
    reads = {r: p.first("env_read") for r, p in ctx.ranks.items()}
    reads = {r: e for r, e in reads.items() if e is not None and e.get("var") == "LOCAL_RANK"}
    falls_back = all(
        e.get("env_local_rank") is not None and str(e.get("default")) == str(e.get("env_local_rank"))
        for e in per_rank.values()
    )
    first = next(iter(per_rank.values()))
    option = (first.get("option_strings") or ["--local_rank"])[0]
    if reads and not injected:
        read = next(iter(reads.values()))
        ctx.measured(
            CODE,
            run_wide=True,
            reason=f"the script reads LOCAL_RANK from the environment itself (at {ctx.at(read.get('site'))}, on "
            f"{len(reads)} of {len(per_rank)} ranks), so {option} is only a fallback",
            evidence={"env_read": read.get("site")},
        )
        return []
    if falls_back and len(per_rank) > 1:
        ctx.measured(CODE, run_wide=True, reason=(
            f"{option}'s default was each rank's LOCAL_RANK ("
            + ", ".join(f"rank {r}: {e.get('default')}" for r, e in per_rank.items()) + ")"
        ))
        return []
    defaults = sorted({str(e.get("default")) for e in per_rank.values()})
    overridden = {r: e.get("overridden_to") for r, e in per_rank.items() if e.get("overridden_to") is not None}
    own = _own_devices(ctx, per_rank) if not (injected or overridden or first.get("required")) else None
    if own:
        # the ranks kept the default, and yet each bound a GPU of its own (from RANK % device_count, say): the
        # option does not pick the device (SwAV declares it only to take what the legacy launcher passes)
        # it clears the suspicion that the default picks the device (static evidence "default"), not the one
        # about an option nothing reads, which the legacy launcher's `--local-rank` would stop (evidence "read")
        ctx.measured(CODE, run_wide=True, about=("default",), reason=(
            f"every rank parsed {option}={defaults[0]} under torchrun, yet each held its DDP replica on its own "
            f"device ({own}): the option's value does not pick the GPU"
        ))
        return []
    if first.get("required"):
        consequence = "argparse exits with an error on every rank under torchrun, which does not pass it"
    else:
        consequence = (
            f"under torchrun, which does not pass it, every rank gets the default {defaults[0]}"
            + ("" if injected else f" (measured: {len(per_rank)} ranks parsed {option}={defaults[0]}"
               + (" and never read LOCAL_RANK)" if not reads else ")"))
            + _what_the_default_does(first.get("default"))
        )
    how = "; the probe passed it as torch.distributed.launch did, to measure the rest" if injected else ""
    if overridden:
        how = ("; the probe then gave each rank its LOCAL_RANK instead ("
               + ", ".join(f"rank {r}: {v}" for r, v in sorted(overridden.items()))
               + "), as torch.distributed.launch passed it, to measure the rest")
    message = (
        f"the script reads its local rank from {option} (declared at {ctx.at(first.get('site'))}): {consequence}{how}"
    )
    evidence = {
        "option_strings": first.get("option_strings"),
        "required": first.get("required"),
        "per_rank": {
            str(r): {"default": e.get("default"), "value": e.get("value"), "LOCAL_RANK": e.get("env_local_rank")}
            for r, e in per_rank.items()
        },
        "injected_by_probe": injected,
        "overridden_by_probe": {str(r): v for r, v in sorted(overridden.items())},
        "reads_local_rank_env": bool(reads),
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


def _own_devices(ctx: RunContext, per_rank: dict[int, dict]) -> str | None:
    """"rank 0 cuda:0, rank 1 cuda:1" when every rank that parsed the option held its DDP replica on a CUDA device
    no other rank of its node held (DD105's measurement), else None."""
    seen = placements(ctx)
    if not per_rank or any(not str((seen.get(r) or {}).get("params") or "").startswith("cuda") for r in per_rank):
        return None
    held = [(seen[r]["host"], str(seen[r]["params"])) for r in per_rank]
    if len(set(held)) < len(held):
        return None
    return ", ".join(f"rank {r} {seen[r]['params']}" for r in sorted(per_rank))


def _what_the_default_does(default: object) -> str:
    """What every rank using the same default local rank means for its device."""
    try:
        index = int(default)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ", and the ranks share one device"
    if index < 0:
        return (f": {index} names no GPU — `.cuda({index})` and `device_ids=[{index}]` raise, "
                f"`torch.cuda.set_device({index})` is ignored and leaves every rank on cuda:0")
    return f": every rank binds cuda:{index}, one GPU shared by all of them"
