"""DD203 non-iid-shards: the ranks' BatchNorm inputs differ beyond what i.i.d. sampling explains.

What it does: for every BN layer, the per-channel mean of its input in each rank's gradient-enabled training
forwards (recorded per step, in float64) goes into `ddpdoctor.bn.stats.noniid_test`: per channel, a two-way
ANOVA F-test of the rank effect blocked on the step — steps are the replicates, because the model changes from
step to step and that drift is shared by all ranks —, weighted by the per-rank counts; the channels' p-values,
then the layers', combined with the Cauchy combination test, which stays valid under the strong dependence
between channels and layers. Fires at p < 1e-3 with the statistic, the p-value, and the most different layer and
channel: of the channels significant on their own, the one whose rank means are furthest apart in units of its
within-batch standard deviation (what BN divides by). That distance must reach 0.1: ranks that train on fixed,
disjoint shards of a small i.i.d. dataset (re-read every epoch) differ detectably by finite-sample noise —
0.03 std measured on a 256-sample shard — which no normalisation choice needs to hear about.

The test is on the layer *inputs*, so it reads the same under SyncBN (which normalises with global statistics
but still sees per-rank inputs). The first layer's input depends on the data only through a shared model; deeper
layers' inputs also depend on the batch statistics of the layers before, which is one more reason the step,
not the sample, is the replicate. Calibrated in tests: silent on i.i.d. shards (false alarms well below 1% across
seeds), fires on class-sorted contiguous shards.

Severity: high with per-GPU BN; low when every BN layer synchronises (SyncBN normalises over the union, which
removes the BN-specific harm). Confidence: certain below p = 1e-9, else likely; possible when the replicas had
diverged (then deeper layers differ because the models differ, not only the data).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.bn.stats import rank_effect_test
from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.formatting import fmt_statistic
from ddpdoctor.rules import get_rule
from ddpdoctor.rules.dd203_non_iid_shards import CODE, MATERIAL_EFFECT, SURE


def _spread(evidence: dict) -> float | None:
    """The most different channel's spread between the ranks' BN input means (what the finding is about)."""
    best = evidence.get("most_different")
    value = best.get("spread_std") if isinstance(best, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the measured spread between ranks of the most different BN input channel, in standard deviations",
    measure=_spread)


def analyze(ctx: RunContext) -> list[Finding]:
    bn = bc.bn_for(ctx)
    if bn is None or len(bn.ranks) < 2:
        return []
    test = bc.noniid_for(ctx)
    if test is None or not test.non_iid:
        return []
    fixed = fixed_batch(ctx)
    if fixed:
        # no dataset: each rank fed one fixed batch at every step, so there is no step-to-step sampling noise to
        # test the ranks against, and no shards to be non-i.i.d. (a synthetic benchmark)
        if _loader_batches(ctx):
            # a loader that yields the same batch at every step (one batch per epoch, never reshuffled): no
            # step-to-step noise either, but there is a dataset, and the note must not say otherwise
            detail = ("(its training loader yielded that same batch every time), so there is no step-to-step "
                      "sampling noise to test the ranks against")
        else:
            detail = ("(a fixed synthetic batch, no dataset), so the ranks' BatchNorm inputs differ by those "
                      "batches alone, not by how data is sharded")
        ctx.notes.append(
            "DD203 (non-i.i.d. shards) not tested: every rank fed its model the same input batch at each of its "
            f"first {fixed} training steps {detail}"
        )
        return []
    effects = _effects(bn, test.threshold)
    best = max(effects, key=lambda e: e["spread_std"]) if effects else None
    if best is None or best["spread_std"] < MATERIAL_EFFECT:
        return []  # detectable, but too small to matter for normalisation (e.g. two fixed i.i.d. shards)
    all_synced = all(layer.synced for layer in bn.layers if layer.per_rank_samples())
    diverged = _replicas_diverged(ctx)
    confidence = Confidence.CERTAIN if (test.p_value or 0.0) < SURE else Confidence.LIKELY
    if diverged:
        confidence = Confidence.POSSIBLE
    severity = Severity.LOW if all_synced else get_rule(CODE).severity
    parts = [
        f"the ranks' BatchNorm inputs differ beyond i.i.d. sampling noise (p = {test.p_value:.1e}, Cauchy "
        f"combination of per-channel ANOVA F-tests over {len(test.layers)} layers and {test.steps} steps)",
        f"most different: channel {best['channel']} of {best['layer']}, whose mean on rank {best['highest_rank']} "
        f"is {best['spread_std']:.2f} std above rank {best['lowest_rank']}'s (F = {fmt_statistic(best['f'])}, "
        f"p = {best['p']:.1e})",
    ]
    if all_synced:
        parts.append("SyncBN normalises over the union of the shards, which limits the harm to the data itself")
    else:
        parts.append("per-GPU BN normalises each rank's shard with its own statistics")
    if diverged:
        parts.append("the replicas had diverged, so deeper layers may differ because the models differ")
    message = "; ".join(parts)
    evidence: dict[str, Any] = {
        **test.to_json(),
        "most_different": bc.rounded(best),
        "material_effect_std": MATERIAL_EFFECT,
        "all_layers_synced": all_synced,
        "replicas_diverged": diverged,
        "syncbn_replay_rel_error": bc.replay_errors(ctx),
    }
    layer = bn.by_name(best["layer"])
    site = bc.training_loader_site(ctx.run) or (layer.info.get("site") if layer is not None else None)
    return [
        ctx.finding(
            CODE,
            message=message,
            severity=severity,
            confidence=confidence,
            site=site,
            ranks=bn.ranks,
            evidence=evidence,
            magnitude=float(-np.log10(max(test.p_value, 1e-300))),
        )
    ]


def _effects(bn: bc.BNRun, threshold: float) -> list[dict[str, Any]]:
    """Every channel whose own rank-effect test is significant, with how far apart the ranks' means of that
    channel are in units of its within-batch standard deviation (what BN divides by: after per-rank
    normalisation the ranks' features are shifted against each other by this much)."""
    out = []
    for layer in bn.layers:
        means, variances, counts, order = bc.blocks(layer, bn.ranks)
        if len(order) < 2 or means.shape[2] == 0:
            continue
        ct = rank_effect_test(means, counts)
        w = counts.sum(axis=1)
        if np.any(w <= 0):
            continue
        per_rank = np.nansum(np.nan_to_num(means) * counts[:, :, None], axis=1) / w[:, None]
        sd = np.sqrt(np.nanmean(variances, axis=(0, 1)))
        for ch in np.flatnonzero(np.nan_to_num(ct.p, nan=1.0) < threshold):
            if not sd[ch] > 0:
                continue
            lo, hi = int(np.argmin(per_rank[:, ch])), int(np.argmax(per_rank[:, ch]))
            out.append({
                "layer": layer.name,
                "channel": int(ch),
                "spread_std": float((per_rank[hi, ch] - per_rank[lo, ch]) / sd[ch]),
                "per_rank_mean": {str(r): bc.finite(v) for r, v in zip(bn.ranks, per_rank[:, ch])},
                "within_batch_std": bc.finite(sd[ch]),
                "lowest_rank": bn.ranks[lo],
                "highest_rank": bn.ranks[hi],
                "f": float(ct.f[ch]),
                "p": float(ct.p[ch]),
            })
    return out


def _replicas_diverged(ctx: RunContext) -> bool:
    """Parameter digests differ across ranks at some step (DD103's evidence)."""
    by_step: dict[int, set[str]] = {}
    for _rank, p in ctx.ranks.items():
        for e in p.of("params"):
            if e.get("digest") is not None:
                by_step.setdefault(int(e.get("step", 0)), set()).add(str(e["digest"]))
    return any(len(d) > 1 for d in by_step.values())


def fixed_batch(ctx: RunContext) -> int:
    """Training forwards compared per rank when every rank fed the same input at each of them (one fixed batch:
    equal `ddp_input_digest` digests), else 0."""
    seen = []
    for p in ctx.ranks.values():
        digests = [e.get("digest") for e in p.of("ddp_input_digest")]
        if len(digests) < 2 or len(set(digests)) != 1:
            return 0
        seen.append(len(digests))
    return min(seen) if len(seen) >= 2 else 0


def _loader_batches(ctx: RunContext) -> int:
    """Batches the ranks drew from training loaders (0: the batches came from no loader)."""
    return sum(int(e.get("batches") or 0) for p in ctx.ranks.values() for e in p.of("loader_iter_end")
               if e.get("training"))
