"""Triage's statistical measurements → LIKELY / POSSIBLE / RULED OUT, each with its numbers (pure: no torch).

- `noise_cause`: BN noise removed by syncing (DD204 generalised): the effective sample count per rank from
  per-sample channel moments, the noise of the batch mean BN subtracts in each arm and their ratio, against the
  recipe's normalisation batch (`--base-batch`); subgroups (arm G) beside it.
- `noniid_cause`: non-i.i.d. shards (DD203), which SyncBN is right to correct.
- `accumulation_cause`: micro-batch BN under gradient accumulation (DD215).
- `running_stats_causes`: running statistics against PreciseBN population statistics at fixed weights (DD213) and
  the eval-output shift they cause (DD214), compared between the SyncBN arm and the per-rank-statistics arm.

The per-run measurements they read are in ddpdoctor.analyses.bn_checks (shared with the rules' probe halves).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ddpdoctor.analyses import bn_checks
from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.findings import Confidence, Severity
from ddpdoctor.formatting import fmt_measure as fmt_num
from ddpdoctor.formatting import fmt_p
from ddpdoctor.rules import get_rule, hook, setting
from ddpdoctor.triage.model import Arm, Cause, rounded

SMALL_BATCH = setting("small_bn_batch").default  # per-rank samples below which local BN statistics are noisy (DD202)
LARGE_BATCH = setting("large_sync_batch").default  # per-rank samples at which local statistics are already stable
MATERIAL_EFFECT = setting("non_iid_effect").default  # DD203's material difference between ranks' channel means
SHIFT_LIKELY, SHIFT_POSSIBLE = setting("eval_shift_likely").default, setting("eval_shift_possible").default
NOISE_RATIO_LIKELY = 0.8  # syncing must remove at least 20% of the batch-mean noise to matter
CLEAR_DIFFERENCE = 1.5  # one arm's lag or shift this many times the other's favours the other arm


def noise_cause(a: Arm, p: Arm | None, settings: Any, noniid: bool, g_arm: Arm | None = None) -> Cause:
    """BN noise removed by syncing (DD204 generalised), measured as effective sample counts."""
    layers = bn_checks.sample_moments(a.ctx.run)
    groups = bn_checks.sync_groups(a.ctx)
    bn = bc.bn_for(a.ctx)
    rows = []
    for layer in layers:
        per_rank = bn_checks.layer_effective_samples(layer)
        if not per_rank:
            continue
        g = groups.get(layer.name, 1)
        local = float(np.median([v["n_eff"] for v in per_rank.values()]))
        lo = float(np.median([v["lo"] for v in per_rank.values()]))
        hi = float(np.median([v["hi"] for v in per_rank.values()]))
        samples = float(np.median([v["samples"] for v in per_rank.values()]))
        values = float(np.median([v["values"] for v in per_rank.values()]))
        rows.append({"layer": layer.name, "group": g, "samples": samples, "values": values, "n_eff": local,
                     "n_eff_lo": lo, "n_eff_hi": hi, "n_eff_sync": local * g})
    if p is not None:
        p_rows = {lay.name: bn_checks.layer_effective_samples(lay, interval=False)
                  for lay in bn_checks.sample_moments(p.ctx.run)}
        for row in rows:
            pr = p_rows.get(row["layer"]) or {}
            if pr:
                row[f"n_eff_arm_{p.name}"] = float(np.median([v["n_eff"] for v in pr.values()]))
    if not rows:
        return Cause(cause="bn-noise-removed", rule="DD204", verdict="not_measurable", favours="none",
                     measured={"summary": "no per-sample BN moments recorded"},
                     message="the BN noise of the arms could not be measured: no BatchNorm training forward was "
                     "recorded", fix=get_rule("DD204").fix, severity=Severity.LOW)
    b = int(np.median([r["samples"] for r in rows]))
    values = int(np.median([r["values"] for r in rows]))
    g = int(max(r["group"] for r in rows))
    synced = g > 1
    n_local = float(np.median([r["n_eff"] for r in rows]))
    n_lo = float(np.median([r["n_eff_lo"] for r in rows]))
    n_hi = float(np.median([r["n_eff_hi"] for r in rows]))
    noise_local = 1.0 / math.sqrt(n_local) if n_local > 0 else float("inf")
    noise_sync = noise_local / math.sqrt(g)
    ratio = noise_sync / noise_local if noise_local > 0 else 1.0
    spread = None
    if bn is not None and synced:
        spreads = [bc.batch_noise(layer, bn.ranks) for layer in bn.layers if layer.synced]
        spreads = [s for s in spreads if s]
        if spreads:
            spread = {"local_mean_noise": float(np.median([s["local_mean_noise"] for s in spreads])),
                      "global_mean_noise": float(np.median([s["global_mean_noise"] for s in spreads]))}
    base = settings.base_batch
    norm_batch = b * g
    measured: dict[str, Any] = {
        "per_rank_samples": b,
        "sync_group": g,
        "normalisation_batch_syncbn": norm_batch if synced else None,
        "normalisation_batch_plain": b,
        "recipe_batch": base,
        "effective_samples_per_rank": rounded(n_local),
        "effective_samples_interval": [rounded(n_lo), rounded(n_hi)],
        "batch_mean_noise_plain_std": rounded(noise_local),
        "batch_mean_noise_syncbn_std": rounded(noise_sync) if synced else None,
        "noise_ratio_syncbn_vs_plain": rounded(ratio) if synced else None,
        "layers": [bc.rounded(r) for r in rows[:16]],
    }
    if spread:
        measured["measured_across_ranks"] = bc.rounded(spread)
    subgroup = bn_checks.sync_groups(g_arm.ctx) if g_arm is not None else {}
    gs = max(subgroup.values(), default=0)
    if gs > 1:
        measured["normalisation_batch_subgroups"] = b * gs
        measured["batch_mean_noise_subgroups_std"] = rounded(noise_local / math.sqrt(gs))
    # n_eff counts independent values (a sample's spatial positions count apart when they are uncorrelated):
    # bounded by the values the batch mean averages (bn_checks.layer_effective_samples), not by the samples
    per = f"{values} values of {b} samples" if values != b else f"{b} samples"
    noise_text = (f"{fmt_num(noise_local)} std ({fmt_num(n_local)} effective independent values of the {per}, "
                  f"90% interval {fmt_num(n_lo)}–{fmt_num(n_hi)})")
    measured["summary"] = (f"{b}/rank, BN over {norm_batch if synced else b}; noise {fmt_num(noise_local)}"
                           + (f" → {fmt_num(noise_sync)} std" if synced else " std"))
    fix = get_rule("DD204").fix
    if not synced:
        verdict, favours = "not_measurable", "none"
        message = (f"SyncBN did not synchronise in arm {a.name} (its layers normalise over one rank), so it "
                   f"removed no BN noise; the batch mean of each rank's batch is noisy by {noise_text}")
    elif b < SMALL_BATCH:
        verdict, favours = "ruled_out", "syncbn"
        message = (f"per-rank batches of {b} give noisy BN statistics: the batch mean is off by {noise_text}; "
                   f"SyncBN over {g} ranks normalises over {norm_batch} samples and cuts that to "
                   f"{fmt_num(noise_sync)} std — the noise it removes is harmful here, so SyncBN is right for this "
                   "batch size")
    elif base is not None and norm_batch <= base:
        verdict, favours = "ruled_out", "syncbn"
        message = (f"SyncBN normalises over {norm_batch} samples, no more than the recipe's batch of {base}: it "
                   f"restores the recipe's BN noise rather than removing it (per rank the batch mean is off by "
                   f"{noise_text})")
    elif b >= LARGE_BATCH and ratio <= NOISE_RATIO_LIKELY and not noniid:
        verdict, favours = "likely", ("subgroups" if gs > 1 and gs < g else "plain")
        message = (f"each rank's {b} samples already give stable BN statistics (the batch mean is off by "
                   f"{noise_text}); syncing over {g} ranks cuts that to {fmt_num(noise_sync)} std "
                   f"(×{fmt_num(ratio)}) and removes the "
                   "batch-statistics noise that regularises (ghost batch norm) — the most likely reason the SyncBN "
                   "run scores lower; keep per-GPU BN or sync over small subgroups"
                   + (f" (recipe batch {base})" if base else "")
                   + (f"; SyncBN over subgroups of {gs} (arm G) normalises over {b * gs} with "
                      f"{fmt_num(noise_local / math.sqrt(gs))} std" if gs > 1 else ""))
    else:
        verdict, favours = "possible", "plain"
        reason = ("the ranks' data are not i.i.d., which SyncBN is right to correct" if noniid
                  else f"with {b} samples per rank the local statistics are only moderately stable")
        message = (f"syncing over {g} ranks cuts the noise of the batch mean BN subtracts from {noise_text} per "
                   f"rank to {fmt_num(noise_sync)} std; whether losing it costs accuracy is uncertain: {reason}")
    return Cause(cause="bn-noise-removed", rule="DD204", verdict=verdict, favours=favours, measured=measured,
                 message=message, fix=fix, severity=Severity.LOW, magnitude=1.0 - ratio)


def noniid_cause(a: Arm) -> Cause | None:
    found = a.has("DD203")
    test = bc.noniid_for(a.ctx)
    if found:
        f = found[0]
        verdict = "likely" if f.confidence >= Confidence.LIKELY else "possible"
        return Cause(cause="non-iid-shards", rule="DD203", verdict=verdict, favours="syncbn",
                     measured={"summary": (f"p = {fmt_p(f.evidence['p_value'])}" if f.evidence.get("p_value")
                                           is not None else "non-i.i.d."),
                               **{k: f.evidence.get(k) for k in ("p_value", "statistic", "most_different")}},
                     message=f.message + " — SyncBN is right to normalise over the union of the shards; the "
                     "regression is elsewhere (or in the data itself)", fix=f.fix, severity=f.severity,
                     magnitude=f.magnitude, file=f.file, line=f.line, source=f)
    if test is None or test.p_value is None or (test.non_iid and hook("DD203", "probe").fixed_batch(a.ctx)):
        return None  # one fixed batch per rank: no sampling noise to test the ranks against, no row
    p_text = f"p = {fmt_p(test.p_value)}"
    if test.non_iid:
        # significant, yet DD203 stayed silent: the ranks' means differ by too little to matter (its
        # MATERIAL_EFFECT), which is not the same as looking i.i.d.
        message = (f"the ranks' BatchNorm inputs differ detectably ({p_text}, below the test's "
                   f"{fmt_p(test.threshold)}) but by less than {MATERIAL_EFFECT:g} within-batch standard deviations "
                   "in every channel: too little imbalance for SyncBN to correct")
    else:
        message = (f"the ranks' BatchNorm inputs are consistent with i.i.d. shards ({p_text}, not below the test's "
                   f"{fmt_p(test.threshold)}): SyncBN has no data imbalance to correct")
    return Cause(cause="non-iid-shards", rule="DD203", verdict="ruled_out", favours="none",
                 measured={"summary": p_text, "p_value": rounded(test.p_value)},
                 message=message, fix=get_rule("DD203").fix, severity=Severity.HIGH)


def accumulation_cause(a: Arm) -> Cause | None:
    """DD215 across arms: the micro-batch BN hurts both arms, SyncBN less (it normalises over the group)."""
    found = bn_checks.accumulation_of(a.ctx)
    if found is None:
        return None
    measured, message, verdict = found
    return Cause(cause="micro-batch-bn", rule="DD215", verdict=verdict, favours="syncbn", measured=measured,
                 message=message + "; it hurts both arms, SyncBN less", fix=get_rule("DD215").fix,
                 severity=Severity.LOW, magnitude=float(measured["micro_batches"]))


def running_stats_causes(arms: list[Arm], paired: bool) -> list[Cause]:
    """DD213 (running statistics lag population statistics at the final weights) and DD214 (the eval-output shift
    that lag causes), per arm. Lag present in both the SyncBN arm and the per-rank-statistics arm to within a
    factor CLEAR_DIFFERENCE cannot explain a gap between them: BOTH ARMS. The per-rank arm compared is L when it
    ran (same modules, only the statistics differ: the statistical effect of syncing), else P. Comparing arms
    needs them paired."""
    pops = {arm.name: bn_checks.population(arm.ctx) for arm in arms}
    pops = {k: v for k, v in pops.items() if v}
    if "L" in pops:  # the statistical effect of syncing: A against L
        pops = {k: v for k, v in pops.items() if k != "P"}
        pops = {("P" if k == "L" else k): v for k, v in pops.items()}
        renamed = True
    else:
        renamed = False
    if not pops:
        return []
    out = []

    def label(k: str) -> str:
        return "L" if renamed and k == "P" else k

    # the `measurable?` test of each quantity, per arm (ddpdoctor.analyses.bn_checks.population): an arm whose
    # running statistics are still warming up, or whose relative numbers are unbounded, gives no size, and arms are
    # only compared where each gives one
    lag_why = {k: x["lag_not_measurable"] for k, x in pops.items() if x.get("lag_not_measurable")}
    shift_why = {k: x["shift_not_measurable"] for k, x in pops.items() if x.get("shift_not_measurable")}
    if lag_why:
        out.append(_not_measurable("stale-running-stats", "DD213", lag_why, pops, label, Severity.INFO))
    if shift_why:
        out.append(_not_measurable("bn-train-test-inconsistency", "DD214", shift_why, pops, label, Severity.LOW))
    if lag_why and shift_why:
        return out

    def decide(values: dict[str, float], material: dict[str, str]) -> tuple[str, str]:
        """(verdict, favours) from per-arm sizes and per-arm verdicts."""
        worst = max(material.values(),
                    key=lambda x: {"not_measurable": -1, "ruled_out": 0, "possible": 1, "likely": 2}[x])
        if worst in ("ruled_out", "not_measurable"):
            return worst, "none"
        if paired and "A" in values and "P" in values:
            xa, xp = values["A"], values["P"]
            if xa > CLEAR_DIFFERENCE * xp and material.get("A") != "ruled_out":
                return worst, "plain"
            if xp > CLEAR_DIFFERENCE * xa and material.get("P") != "ruled_out":
                return worst, "syncbn"
            return "both_arms", "none"
        return worst, "none"

    per_arm = {k: bn_checks.lag_level(x) for k, x in pops.items()}
    size = {k: max(x["mean_lag_std"], x["var_lag_rel"]) for k, x in pops.items()}
    verdict, favours = decide(size, per_arm)
    worst = max(pops.items(), key=lambda kv: size[kv[0]])
    m, v, se = worst[1]["mean_lag_std"], worst[1]["var_lag_rel"], worst[1]["population_se_std"] or 0.0

    text = "; ".join(f"arm {label(k)}: mean {fmt_num(x['mean_lag_std'])} std, var {fmt_num(100 * x['var_lag_rel'])}%"
                     for k, x in sorted(pops.items()))
    tail = {"ruled_out": ": no material lag",
            "both_arms": ": both arms lag alike, so it cannot explain a gap between them (early training moves the "
            "weights faster than the running averages follow)",
            }.get(verdict, f": arm {label(worst[0])}'s running statistics lag the current weights")
    if not lag_why:
        out.append(Cause(cause="stale-running-stats", rule="DD213", verdict=verdict, favours=favours,
                         measured={"summary": f"lag {fmt_num(m)} std, var {fmt_num(100 * v)}% (arm {label(worst[0])})",
                                   "per_arm": {label(k): bc.rounded(x) for k, x in pops.items()},
                                   "population_se_std": rounded(se)},
                         message=(f"running statistics against PreciseBN population statistics recomputed at the "
                                  f"final weights on held training batches (median over layers; {text}; population "
                                  f"estimate ±{fmt_num(se)} std){tail}"),
                         fix=get_rule("DD213").fix, severity=Severity.INFO, magnitude=m))
    shifts = {k: x["eval_output_shift"] for k, x in pops.items() if x.get("eval_output_shift") is not None}
    if shifts and not shift_why:
        levels = {k: "likely" if s > SHIFT_LIKELY else "possible" if s > SHIFT_POSSIBLE else "ruled_out"
                  for k, s in shifts.items()}
        verdict, favours = decide(shifts, levels)
        worst_arm, s = max(shifts.items(), key=lambda kv: kv[1])
        text = ", ".join(f"arm {label(k)} {fmt_num(100 * x)}%" for k, x in sorted(shifts.items()))
        tail = {"ruled_out": "", "both_arms": ": alike in both arms, so it cannot explain a gap between them"}.get(
            verdict, "")
        out.append(Cause(cause="bn-train-test-inconsistency", rule="DD214", verdict=verdict, favours=favours,
                         measured={"summary": f"eval output shift {fmt_num(100 * s)}% (arm {label(worst_arm)})",
                                   "eval_output_shift": {label(k): bc.finite(x) for k, x in shifts.items()}},
                         message=(f"evaluating with the running statistics instead of population statistics "
                                  f"changes the model's eval output by {text} (relative L2, on a held training "
                                  f"batch){tail}"),
                         fix=get_rule("DD214").fix, severity=Severity.LOW, magnitude=s))
    return out


def _not_measurable(cause: str, rule: str, why: dict[str, str], pops: dict[str, Any], label: Any,
                    severity: Severity) -> Cause:
    """A NOT MEASURABLE row: the quantity's own `measurable?` test failed in these arms (the reason, per arm)."""
    reasons = "; ".join(f"arm {label(k)}: {r}" for k, r in sorted(why.items()))
    k = next(iter(why))
    n, need = pops[k].get("running_stat_updates"), pops[k].get("warmup_updates_needed")
    short = (f"not measurable: {n} of {need} warm-up updates" if n is not None and need is not None and n < need
             else f"not measurable: unbounded (over {100 * bn_checks.MAX_RELATIVE:.0f}%)")
    return Cause(cause=cause, rule=rule, verdict="not_measurable", favours="none",
                 measured={"summary": short, "reason": {label(a): r for a, r in why.items()}},
                 message=f"not measured on this run — {reasons}; run more steps (triage --steps/--epochs) to "
                 "measure it",
                 fix=get_rule(rule).fix, severity=severity)
