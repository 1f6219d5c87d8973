"""DD306 uneven-batches: ranks run different numbers of batches, or batches of different sizes, in an epoch.

What it does: for each training loop (a loader iteration during which optimizer steps ran, matched across ranks
by its loop site and how many times that site started), compares what each rank's loader reported at `iter()` —
`len(loader)` batches, and the size of the last batch (len(sampler) − (batches − 1) × batch_size unless
drop_last) — and the batch sizes the ranks actually drew at the same step. The probe cuts epochs short, so the
loader's own numbers are what tell how the epoch would end; a loop that ran out early shows in the observed
batches too.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Finding, Severity
from ddpdoctor.rules.dd306_uneven_batches import CODE
from ddpdoctor.rundata import rle_expand


def _uneven(evidence: dict) -> float | None:
    """How many ways the ranks' epochs were measured to differ: distinct batch counts (planned, or where a loader
    ran out), distinct last-batch sizes, and a batch that already differed in size, each beyond the first."""
    if not any(k in evidence for k in ("batches_per_epoch", "last_batch_size", "first_size_difference")):
        return None
    counts = {b for b in (evidence.get("batches_per_epoch") or {}).values() if isinstance(b, int)}
    ran_out = set((evidence.get("ran_out_after") or {}).values())
    lasts = {v for v in (evidence.get("last_batch_size") or {}).values() if v is not None}
    return float(max(len(counts), 1) - 1 + max(len(ran_out), 1) - 1 + max(len(lasts), 1) - 1
                 + (1 if evidence.get("first_size_difference") else 0))


# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the differences measured between the ranks' batch counts and batch sizes",
    measure=_uneven)


def _site_key(site: dict[str, Any] | None) -> tuple[str, int]:
    return (site or {}).get("file", "?"), (site or {}).get("line", 0)


def last_batch(plan: dict[str, Any]) -> int | None:
    n, batches, bs = plan.get("sampler_len"), plan.get("batches"), plan.get("batch_size")
    if not isinstance(n, int) or not isinstance(batches, int) or not isinstance(bs, int) or batches <= 0:
        return None
    if plan.get("drop_last"):
        return bs
    return n - (batches - 1) * bs


def _training_plans(p) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:  # noqa: ANN001
    """(loader_plan, matching loader_iter_end) of the training iterations of one rank, in order."""
    starts = {(e.get("loader"), e.get("loader_seq", e.get("seq"))): e for e in p.of("loader_iter")}
    ends = {e.get("it"): e for e in p.of("loader_iter_end")}
    out = []
    for plan in p.of("loader_plan"):
        start = starts.get((plan.get("loader"), plan.get("iteration")))
        end = ends.get(start.get("it")) if start else None
        training = end.get("training") if end is not None else plan.get("grad_enabled")
        if training:
            out.append((plan, end))
    return out


def analyze(ctx: RunContext) -> list[Finding]:
    if len(ctx.ranks) < 2:
        return []
    # (loop site, n-th start of that site) -> rank -> (plan, end)
    groups: dict[tuple, dict[int, tuple[dict[str, Any], dict[str, Any] | None]]] = {}
    for r, p in ctx.ranks.items():
        seen: dict[tuple[str, int], int] = {}
        for plan, end in _training_plans(p):
            k = _site_key(plan.get("site"))
            groups.setdefault((k, seen.get(k, 0)), {})[r] = (plan, end)
            seen[k] = seen.get(k, 0) + 1
    findings = []
    reported_sites: set[tuple[str, int]] = set()
    for (site_key, epoch), per_rank in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if len(per_rank) < 2 or site_key in reported_sites:
            continue
        batches = {r: plan.get("batches") for r, (plan, _) in per_rank.items()}
        lasts = {r: last_batch(plan) for r, (plan, _) in per_rank.items()}
        observed = {r: rle_expand(end.get("sizes")) for r, (_, end) in per_rank.items() if end is not None}
        exhausted = {r: len(observed.get(r, [])) for r, (_, end) in per_rank.items()
                     if end is not None and end.get("reason") == "exhausted"}
        count_differs = len({b for b in batches.values() if isinstance(b, int)}) > 1 or len(set(exhausted.values())) > 1
        last_differs = len({v for v in lasts.values() if v is not None}) > 1
        first_diff = None
        if len(observed) >= 2:
            n = min(len(v) for v in observed.values())
            for i in range(n):
                if len({v[i] for v in observed.values()}) > 1:
                    first_diff = {"batch": i, "sizes": {str(r): v[i] for r, v in observed.items()}}
                    break
        if not (count_differs or last_differs or first_diff):
            continue
        reported_sites.add(site_key)
        plan0 = next(iter(per_rank.values()))[0]
        parts = []
        if count_differs:
            per = ", ".join(f"rank {r}: {b}" for r, b in batches.items())
            if exhausted and len(set(exhausted.values())) > 1:
                per = ", ".join(f"rank {r}: {b}" for r, b in exhausted.items())
            parts.append(
                f"the ranks run different numbers of batches per epoch ({per}): the rank with more waits in the "
                "gradient all-reduce of its extra steps for a peer that has left the loop (a hang, unless the "
                "loop runs under ddp.join())"
            )
        if last_differs:
            per = ", ".join(f"rank {r}: {v}" for r, v in lasts.items())
            parts.append(
                f"the last batch of the epoch has different sizes ({per}): DDP averages gradients with equal weight "
                "per rank, so the samples of the smaller batch count more, and per-rank BatchNorm normalises it with "
                "noisier statistics"
            )
        if first_diff and not last_differs:
            per = ", ".join(f"rank {r}: {v}" for r, v in first_diff["sizes"].items())
            parts.append(f"batch {first_diff['batch']} of epoch {epoch} already differs in size ({per})")
        sharded = [plan.get("sampler_cls") for plan, _ in per_rank.values()]
        message = f"training loop at {ctx.at(plan0.get('site'))}: " + "; ".join(parts)
        severity = Severity.HIGH if count_differs else None
        spread = max((b for b in batches.values() if isinstance(b, int)), default=0) - min(
            (b for b in batches.values() if isinstance(b, int)), default=0)
        findings.append(
            ctx.finding(
                CODE,
                message=message,
                severity=severity,
                site=plan0.get("site"),
                ranks=list(per_rank),
                evidence={
                    "epoch": epoch,
                    "batches_per_epoch": {str(r): b for r, b in batches.items()},
                    "last_batch_size": {str(r): v for r, v in lasts.items()},
                    "sampler_len": {str(r): plan.get("sampler_len") for r, (plan, _) in per_rank.items()},
                    "batch_size": {str(r): plan.get("batch_size") for r, (plan, _) in per_rank.items()},
                    "drop_last": {str(r): plan.get("drop_last") for r, (plan, _) in per_rank.items()},
                    "sampler": sharded,
                    "batches_observed": {str(r): len(v) for r, v in observed.items()},
                    "ran_out_after": {str(r): v for r, v in exhausted.items()},
                    "first_size_difference": first_diff,
                },
                magnitude=float(spread) if count_differs else 0.5,
            )
        )
    return findings
