"""From the arms' recorded runs to a ranked diagnosis (pure: event logs and findings in, causes out; no torch).

Deterministic checks give CONFIRMED: what the conversion did to each layer within the SyncBN arm (DD208 changed
function, DD209 momentum/eps lost, DD210 unfrozen, DD211 applied statistics, DD212 process group, DD216 parameters
not trained — the arm's own analyses), and per-layer attributes compared between the arm with the conversion (A)
and the arm without it (P) at the same optimizer step (DD209: code that picks norm layers by exact class changed
their weight decay, momentum, freezing or precise-BN recalibration; DD210: frozen layers training again).

Statistical measurements give LIKELY / POSSIBLE / RULED OUT with their numbers: BN noise removed by syncing
(DD204 generalised: effective sample count per rank from per-sample channel moments, the noise of the batch mean
in both arms and their ratio, against the recipe's normalisation batch), non-i.i.d. shards (DD203), running
statistics against PreciseBN population statistics at fixed weights (DD213) and the eval-output shift they cause
(DD214), micro-batch BN under accumulation (DD215). Port problems the check analyses find in both arms are
BOTH ARMS: they cannot explain a gap between the arms.

Ranking: confirmed; both-arms causes of medium severity or more; likely; possible; ruled out in favour of one arm
("SyncBN is right here"); low both-arms causes; not measurable; ruled out — then by severity and measured size.

Size: one module because the causes are decided against each other from the same arms — a conversion defect
confirmed in arm A decides whether A's and P's statistics may be compared, the noise verdict decides which
running-statistics verdicts are its consequences, and the headline reads the ranked whole; the per-run halves of
the rules live in their packages (ddpdoctor/rules/dd2NN_*/probe.py) and the measurements in analyses/bn_checks.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddpdoctor.analyses import bn_checks
from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Confidence, Finding, Severity, new_finding
from ddpdoctor.rules import get_rule
from ddpdoctor.rules.dd202_small_bn_batch import SMALL_BN_BATCH
from ddpdoctor.rules.dd204_syncbn_large_batch import LARGE_SYNC_BATCH
from ddpdoctor.rules.dd213_stale_running_stats import LAG_LIKELY, LAG_POSSIBLE, VAR_LAG_LIKELY, VAR_LAG_POSSIBLE
from ddpdoctor.rules.dd214_bn_train_test_inconsistency import SHIFT_LIKELY, SHIFT_POSSIBLE

# rules whose verdict triage decides itself (their check findings are replaced by the causes)
TRIAGE_RULES = ("DD203", "DD204", "DD208", "DD209", "DD210", "DD211", "DD212", "DD213", "DD214", "DD215", "DD216")
# findings about SyncBN itself, not a port problem that could hurt both arms
SYNCBN_ONLY = ("DD101", "DD201", "DD202", "DD205")
CONVERSION_RULES = ("DD208", "DD209", "DD210", "DD211", "DD212", "DD216")

SMALL_BATCH = SMALL_BN_BATCH  # per-rank samples below which local BN statistics are noisy (DD202's threshold)
LARGE_BATCH = LARGE_SYNC_BATCH  # per-rank samples at which local statistics are already stable (DD204's)
NOISE_RATIO_LIKELY = 0.8  # syncing must remove at least 20% of the batch-mean noise to matter
CLEAR_DIFFERENCE = 1.5  # one arm's lag or shift this many times the other's favours the other arm
TIERS = {"confirmed": 0, "both_arms_high": 1, "likely": 2, "possible": 3, "ruled_out_favouring": 4,
         "both_arms_low": 5, "not_measurable": 6, "ruled_out": 7}


@dataclass
class Arm:
    name: str
    what: str
    ctx: RunContext
    findings: list[Finding]
    as_written: bool
    mirror: bool = False  # the script uses plain BN: A is the converted arm

    @property
    def steps(self) -> int:
        steps = [self.ctx.steps_of(r) for r in self.ctx.ranks]
        return min(steps) if steps else 0

    def has(self, rule: str) -> list[Finding]:
        return [f for f in self.findings if f.rule == rule]


@dataclass
class Cause:
    cause: str
    rule: str | None
    verdict: str
    favours: str
    measured: dict[str, Any]
    message: str
    fix: str
    severity: Severity = Severity.LOW
    magnitude: float = 0.0
    site: dict[str, Any] | None = None
    file: str | None = None
    line: int | None = None
    explained_by: str | None = None  # the rule of a cause this one is a consequence of (ranked right after it)

    @property
    def tier(self) -> int:
        if self.verdict == "both_arms":
            return TIERS["both_arms_high" if self.severity >= Severity.MEDIUM else "both_arms_low"]
        if self.verdict == "ruled_out" and self.favours != "none":  # evidence for one arm ("SyncBN is right here")
            return TIERS["ruled_out_favouring"]
        return TIERS[self.verdict]

    def to_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "rule": self.rule, "verdict": self.verdict, "favours": self.favours,
                "measured": self.measured, "message": self.message, "fix": self.fix}


@dataclass
class TriageResult:
    arms: list[dict[str, Any]]
    paired: bool
    pairing: dict[str, Any]
    headline: str
    causes: list[Cause]
    emulated: bool
    mirror: bool
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"arms": self.arms, "paired": self.paired, "headline": self.headline,
                "causes": [c.to_json() for c in self.causes]}


def fmt_num(x: Any) -> str:
    """3 significant digits for messages (whole numbers from 100 up)."""
    if x is None:
        return "-"
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _r(x: Any, digits: int = 4) -> Any:
    return bc.rounded(x) if not isinstance(x, float) else bc.finite(x, digits)


# --------------------------------------------------------------------------------------------------- pairing


def pairing(arms: list[Arm]) -> tuple[bool, dict[str, Any]]:
    """Do the arms start from the same weights and see the same first batches, rank by rank? Compared on the
    digests the triage recorder took (initial parameters, inputs of the first training forwards)."""
    per_arm: dict[str, dict[str, Any]] = {}
    for arm in arms:
        digests: dict[str, Any] = {}
        for rank, proc in arm.ctx.ranks.items():
            for e in proc.of("triage_pairing"):
                key = f"rank{rank}.{e.get('what')}" + (f".{e.get('n')}" if e.get("what") == "batch" else "")
                digests.setdefault(key, e.get("digest"))
        per_arm[arm.name] = digests
    keys = sorted(set().union(*[set(d) for d in per_arm.values()])) if per_arm else []
    differ = [k for k in keys if len({d.get(k) for d in per_arm.values()}) > 1]
    has_params = any(k.endswith("initial_params") for k in keys)
    has_batches = any(".batch." in k for k in keys)
    paired = bool(keys) and not differ and has_params and has_batches and len(arms) > 1
    why = None
    if not keys:
        why = "no digests were recorded (no optimizer step or no training forward through DDP)"
    elif differ:
        what = sorted({k.split(".", 1)[1].split(".")[0] for k in differ})
        why = "the arms differ in " + " and ".join(
            {"initial_params": "initial weights", "batch": "their first batches"}.get(w, w) for w in what)
    return paired, {"compared": keys, "different": differ, "reason": why}


# --------------------------------------------------------------------------------------------------- helpers


def _finding_cause(f: Finding, cause: str, favours: str, measured: dict[str, Any]) -> Cause:
    return Cause(cause=cause, rule=f.rule, verdict="confirmed", favours=favours, measured=measured,
                 message=f.message, fix=f.fix, severity=f.severity, magnitude=f.magnitude, file=f.file,
                 line=f.line)


def _attrs_by_step(ctx: RunContext) -> dict[int, dict[str, dict[str, Any]]]:
    """step → layer name → attributes, from the lowest rank's diff-encoded `bn_attrs` events."""
    ranks = ctx.ranks
    if not ranks:
        return {}
    current: dict[str, dict[str, Any]] = {}
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for e in ranks[min(ranks)].of("bn_attrs"):
        current = {**current, **(e.get("layers") or {})}
        out[int(e.get("step", 0))] = dict(current)
    return out


def _state_at(by_step: dict[int, dict[str, dict[str, Any]]], step: int) -> dict[str, dict[str, Any]] | None:
    earlier = [s for s in by_step if s <= step]
    return by_step[max(earlier)] if earlier else None


def _group(opt: Any) -> Any:
    if not isinstance(opt, dict):
        return None
    return {"lr": opt.get("lr"), "weight_decay": opt.get("weight_decay")}


COMPARED = ("momentum", "eps", "training", "weight_requires_grad", "bias_requires_grad")


def attribute_differences(a: RunContext, p: RunContext) -> list[dict[str, Any]]:
    """The first optimizer step at which each layer differs between arm A and arm P, and how."""
    sa, sp = _attrs_by_step(a), _attrs_by_step(p)
    if not sa or not sp:
        return []
    # events are written when something changed: the last step compared is the last step both arms took
    last = min(max([a.steps_of(r) for r in a.ranks] or [0]), max([p.steps_of(r) for r in p.ranks] or [0]))
    last = max(last, min(max(sa), max(sp)))
    steps = sorted(s for s in set(sa) | set(sp) if s <= last)
    seen: set[tuple[str, str]] = set()
    out = []
    for step in steps:
        xa, xp = _state_at(sa, step), _state_at(sp, step)
        if xa is None or xp is None:
            continue
        for name in sorted(set(xa) & set(xp)):
            la, lp = xa[name], xp[name]
            diffs: dict[str, list[Any]] = {}
            for key in COMPARED:
                if la.get(key) != lp.get(key):
                    diffs[key] = [la.get(key), lp.get(key)]
            for k in ("weight", "bias"):
                ga, gp = _group(la.get(f"{k}_optimizer")), _group(lp.get(f"{k}_optimizer"))
                if (ga is None) != (gp is None):
                    diffs[f"{k}_in_optimizer"] = [ga is not None, gp is not None]
                elif ga is not None and gp is not None:
                    for hk in ("lr", "weight_decay"):
                        if ga[hk] != gp[hk]:
                            diffs[f"{k}_{hk}"] = [ga[hk], gp[hk]]
            for key in list(diffs):
                if (name, key) in seen:
                    del diffs[key]
                else:
                    seen.add((name, key))
            if diffs:
                out.append({"layer": name, "step": step, "diffs": diffs, "cls_a": la.get("cls"), "cls_p": lp.get("cls")})
    return out


def _no_grad_forwards(ctx: RunContext) -> dict[str, int]:
    """layer name → train-mode forwards without gradients (BN recalibration, evaluation left in train mode)."""
    bn = bc.bn_for(ctx)
    out: dict[str, int] = {}
    if bn is None:
        return out
    for layer in bn.layers:
        out[layer.name] = layer.ranks[min(layer.ranks)].modes.count("t")
    return out


# --------------------------------------------------------------------------------------------------- causes


def conversion_causes(a: Arm) -> list[Cause]:
    """CONFIRMED from the SyncBN arm's own deterministic checks."""
    names = {"DD208": "conversion-changed-function", "DD209": "bn-type-check-misses-syncbn",
             "DD210": "frozen-bn-unfrozen", "DD211": "syncbn-stats-wrong", "DD212": "syncbn-scope",
             "DD216": "bn-params-not-trained"}
    out = []
    for rule in CONVERSION_RULES:
        for f in a.has(rule):
            out.append(_finding_cause(f, names[rule], "fix_conversion", {"summary": _summary_of(f),
                                                                         **_small(f.evidence)}))
    return out


def _layers(n: Any) -> str:
    return f"{n} layer" + ("" if n == 1 else "s")


def _small(evidence: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in evidence.items() if not isinstance(v, str) or len(v) < 200}


def _summary_of(f: Finding) -> str:
    ev = f.evidence
    if f.rule == "DD208":
        layers = ev.get("layers") or [{}]
        rel = layers[0].get("train_rel_diff")
        return (f"{ev.get('changed')} of {_layers(ev.get('compared'))} changed (train output differs by "
                f"{fmt_num(100 * (rel or 0))}%)")
    if f.rule == "DD211":
        layers = ev.get("layers") or [{}]
        return (f"applied {layers[0].get('applied')} statistics; var off {fmt_num(layers[0].get('var_error_rel') or 0)}"
                f", mean off {fmt_num(layers[0].get('mean_error_std') or 0)} std")
    if f.rule == "DD212":
        return f"{_layers(len(ev.get('layers') or []))} with a wrong process group"
    if f.rule == "DD216":
        return f"{_layers(ev.get('untrained_layers'))}: BN parameters not in the optimizer"
    if f.rule == "DD210":
        return f"{_layers(ev.get('unfrozen_layers'))} unfrozen by the converter"
    if f.rule == "DD209":
        return f"{_layers(ev.get('changed_layers'))}: momentum/eps lost in the converter"
    return f.message[:80]


def attribute_causes(a: Arm, p: Arm, already: list[Cause]) -> list[Cause]:
    """CONFIRMED from A-vs-P layer attributes at the same optimizer step (code that stopped recognising the
    converted layers), minus what the conversion itself explains (already reported from the conversion)."""
    diffs = attribute_differences(a.ctx, p.ctx)
    convs = {e.get("name"): e for e in bn_checks.lowest_rank_conversions(a.ctx.run)}
    have = {c.rule for c in already}
    groups: dict[str, list[dict[str, Any]]] = {}
    for d in diffs:
        conv = convs.get(d["layer"]) or {}
        before, after = conv.get("before") or {}, conv.get("after") or {}
        # parameters frozen on one side only: their optimizer membership follows from that (a script that builds
        # the optimizer over requires_grad parameters), so the freezing is the cause
        frozen_differs = any(k in d["diffs"] for k in ("weight_requires_grad", "bias_requires_grad")) or any(
            before.get(k) is False and after.get(k) is True for k in ("weight_requires_grad", "bias_requires_grad"))
        for key, (va, vp) in d["diffs"].items():
            if key in ("momentum", "eps"):
                if before.get(key) != after.get(key) and "DD209" in have:
                    continue  # the converter lost it: reported from the conversion
                groups.setdefault("hyper", []).append({**d, "key": key, "a": va, "p": vp})
            elif key in ("training", "weight_requires_grad", "bias_requires_grad"):
                dropped = before.get(key) is False and after.get(key) is True
                if dropped and "DD210" in have:
                    continue  # the converter dropped the frozen state: reported from the conversion
                kind = "frozen_by_converter" if dropped else "frozen_by_code"
                groups.setdefault(kind, []).append({**d, "key": key, "a": va, "p": vp})
            elif key.endswith("_in_optimizer"):
                if "DD216" in have or (frozen_differs and "DD210" in have):
                    continue
                kind = "frozen_by_converter" if frozen_differs else "optimizer"
                groups.setdefault(kind, []).append({**d, "key": key, "a": va, "p": vp})
            else:
                groups.setdefault("optimizer", []).append({**d, "key": key, "a": va, "p": vp})
    ng_a, ng_p = _no_grad_forwards(a.ctx), _no_grad_forwards(p.ctx)
    recal = [{"layer": n, "a": ng_a.get(n, 0), "p": ng_p.get(n, 0)} for n in sorted(set(ng_a) & set(ng_p))
             if (ng_a.get(n, 0) == 0) != (ng_p.get(n, 0) == 0)]
    out: list[Cause] = []

    def layers_text(items: list[dict[str, Any]]) -> str:
        names = sorted({i["layer"] for i in items})
        return f"{len(names)} layer{'s' if len(names) != 1 else ''} (first: `{names[0]}`)"

    def value(v: Any) -> str:
        return "-" if v is None else (fmt_num(float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool)
                                      else str(v))

    def attribute(key: str) -> str:
        for param in ("weight", "bias"):
            for suffix, text in (("_weight_decay", "weight decay of the BN {p}"), ("_lr", "lr of the BN {p}"),
                                 ("_in_optimizer", "BN {p} in an optimizer"),
                                 ("_requires_grad", "requires_grad of the BN {p}")):
                if key == param + suffix:
                    return text.format(p=param)
        return key.replace("_", " ")

    for kind, items in groups.items():
        first = items[0]
        what = f"{attribute(first['key'])} {value(first['a'])} with SyncBN vs {value(first['p'])} without"
        if kind == "optimizer":
            cause, rule = "bn-type-check-misses-syncbn", "DD209"
            text = (f"the optimizer treats {layers_text(items)} differently once they are SyncBatchNorm ({what}, "
                    f"from step {first['step']}): code that selects norm layers by exact class (e.g. a weight-decay "
                    "exclusion) no longer matches them")
        elif kind == "hyper":
            cause, rule = "bn-type-check-misses-syncbn", "DD209"
            text = (f"{layers_text(items)} run with a different {first['key']} once converted ({what}, from step "
                    f"{first['step']}): code that sets it by exact class (a BN momentum schedule) skips SyncBatchNorm")
        elif kind == "frozen_by_converter":
            cause, rule = "frozen-bn-unfrozen", "DD210"
            text = (f"{layers_text(items)} are frozen without the conversion and train with it ({what}, from step "
                    f"{first['step']}): the converter did not copy the frozen state")
        else:
            cause, rule = "bn-type-check-misses-syncbn", "DD209"
            text = (f"{layers_text(items)} are frozen differently with and without the conversion ({what}, from "
                    f"step {first['step']}): code that freezes norm layers by exact class skips SyncBatchNorm")
        measured = {"summary": what, "layers": [{k: i[k] for k in ("layer", "step", "key", "a", "p")}
                                                 for i in items][:16], "compared": "arm A vs arm P at each step"}
        out.append(Cause(cause=cause, rule=rule, verdict="confirmed", favours="fix_conversion", measured=measured,
                         message=text, fix=get_rule(rule).fix, severity=get_rule(rule).severity,
                         magnitude=float(len(items))))
    if recal:
        first = recal[0]
        text = (f"{len(recal)} BN layer{'s' if len(recal) != 1 else ''} ran {first['a']} train-mode forwards without "
                f"gradients with SyncBN and {first['p']} without it (first: `{first['layer']}`): a BN recalibration "
                "(precise-BN) helper that selects layers by exact class skips the converted layers, so their "
                "running statistics are never recomputed")
        out.append(Cause(cause="bn-type-check-misses-syncbn", rule="DD209", verdict="confirmed",
                         favours="fix_conversion",
                         measured={"summary": f"no-grad BN forwards {first['a']} (A) vs {first['p']} (P)",
                                   "layers": recal[:16]},
                         message=text, fix=get_rule("DD209").fix, severity=get_rule("DD209").severity,
                         magnitude=float(len(recal))))
    return out


def _layer_groups(a: Arm) -> dict[str, int]:
    """layer → ranks it normalised over in the arm's gradient-enabled training forwards."""
    return _groups_of(a.ctx)


def _groups_of(ctx: RunContext) -> dict[str, int]:
    bn = bc.bn_for(ctx)
    out: dict[str, int] = {}
    if bn is None:
        return out
    for layer in bn.layers:
        if layer.synced:
            out[layer.name] = len(layer.info.get("group_ranks") or bn.ranks)
        else:
            out[layer.name] = 1
    return out


def noise_cause(a: Arm, p: Arm | None, settings: Any, noniid: bool, g_arm: Arm | None = None) -> Cause:
    """BN noise removed by syncing (DD204 generalised), measured as effective sample counts."""
    layers = bn_checks.sample_moments(a.ctx.run)
    groups = _layer_groups(a)
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
        p_rows = {lay.name: bn_checks.layer_effective_samples(lay) for lay in bn_checks.sample_moments(p.ctx.run)}
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
        "effective_samples_per_rank": _r(n_local),
        "effective_samples_interval": [_r(n_lo), _r(n_hi)],
        "batch_mean_noise_plain_std": _r(noise_local),
        "batch_mean_noise_syncbn_std": _r(noise_sync) if synced else None,
        "noise_ratio_syncbn_vs_plain": _r(ratio) if synced else None,
        "layers": [bc.rounded(r) for r in rows[:16]],
    }
    if spread:
        measured["measured_across_ranks"] = bc.rounded(spread)
    subgroup = _layer_groups(g_arm) if g_arm is not None else {}
    gs = max(subgroup.values(), default=0)
    if gs > 1:
        measured["normalisation_batch_subgroups"] = b * gs
        measured["batch_mean_noise_subgroups_std"] = _r(noise_local / math.sqrt(gs))
    noise_text = (f"{fmt_num(noise_local)} std ({fmt_num(n_local)} effective samples from {b}, 90% interval "
                  f"{fmt_num(n_lo)}–{fmt_num(n_hi)})")
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
                     measured={"summary": f"p = {fmt_num(f.evidence.get('p_value') or 0)}",
                               **{k: f.evidence.get(k) for k in ("p_value", "statistic", "most_different")}},
                     message=f.message + " — SyncBN is right to normalise over the union of the shards; the "
                     "regression is elsewhere (or in the data itself)", fix=f.fix, severity=f.severity,
                     magnitude=f.magnitude, file=f.file, line=f.line)
    if test is None or test.p_value is None:
        return None
    return Cause(cause="non-iid-shards", rule="DD203", verdict="ruled_out", favours="none",
                 measured={"summary": f"p = {fmt_num(test.p_value)}", "p_value": _r(test.p_value)},
                 message=(f"the ranks' BatchNorm inputs are consistent with i.i.d. shards (p = "
                          f"{fmt_num(test.p_value)}): SyncBN has no data imbalance to correct"),
                 fix=get_rule("DD203").fix, severity=Severity.HIGH)


def accumulation_of(ctx: RunContext) -> tuple[dict[str, Any], str, str] | None:
    """(measured, message, verdict) of gradient accumulation in one run, None without it. Optimizer steps that
    average several model forwards, counted as training forwards through DDP between optimizer steps — not BN
    forwards, which a multi-view model (SimSiam, MoCo, DINO: the encoder run once per view) makes several of per
    model forward."""
    per_step = [int(e.get("ddp_forwards") or 0) for p in ctx.ranks.values() for e in p.of("optimizer_step")]
    per_step = [k for k in per_step if k > 0]
    if not per_step:
        return None
    k = int(np.median(per_step))
    if k < 2:
        return None
    bn = bc.bn_for(ctx)
    if bn is None:
        return None
    first = bn.layers[0]
    per_rank = first.per_rank_samples()
    b = int(np.median(list(per_rank.values()))) if per_rank else 0
    g = _groups_of(ctx).get(first.name, 1)
    world = len(bn.ranks)
    verdict = "likely" if b * g < LARGE_BATCH else "possible"
    message = (f"gradient accumulation: each optimizer step averages {k} forwards of {b} samples per rank "
               f"({k * b * world} samples over {world} ranks) but BatchNorm normalises — and updates its running "
               f"statistics — per forward, over {b * g} samples{' with SyncBN' if g > 1 else ''}"
               + (f" (plain BN: {b})" if g > 1 else ""))
    measured = {"summary": f"{k} micro-batches of {b}/rank; BN over {b * g}", "micro_batches": k,
                "micro_batch_per_rank": b, "optimizer_batch": k * b * world, "bn_batch_syncbn": b * g,
                "bn_batch_plain": b}
    return measured, message, verdict


def accumulation_cause(a: Arm) -> Cause | None:
    """DD215 across arms: the micro-batch BN hurts both arms, SyncBN less (it normalises over the group)."""
    found = accumulation_of(a.ctx)
    if found is None:
        return None
    measured, message, verdict = found
    return Cause(cause="micro-batch-bn", rule="DD215", verdict=verdict, favours="syncbn", measured=measured,
                 message=message + "; it hurts both arms, SyncBN less", fix=get_rule("DD215").fix,
                 severity=Severity.LOW, magnitude=float(measured["micro_batches"]))


def population(ctx: RunContext) -> dict[str, Any] | None:
    """Per layer over ranks: running vs population lag (mean in std, var relative), the population estimate's
    standard error, and the eval-output shift; None when not recorded."""
    lags_m, lags_v, ses, shifts = [], [], [], []
    for proc in ctx.ranks.values():
        ev = proc.last("bn_population")
        if not ev or not ev.get("ok"):
            continue
        if ev.get("eval_output_shift") is not None:
            shifts.append(float(ev["eval_output_shift"]))
        try:
            vec = np.asarray(ctx.run.load_array(ev["stats"]), dtype=np.float64) if ev.get("stats") else None
        except (OSError, ValueError, KeyError):
            vec = None
        if vec is None:
            continue
        off = 0
        world = max(len(ctx.ranks), 1) if ev.get("pooled") else 1
        for layer in ev.get("layers") or []:
            c, h = int(layer["channels"]), int(layer["batches"])
            need = 6 * c + h * c
            if off + need > vec.size:
                break
            rm, rv, _pm, _pv, gm, gv = (vec[off + i * c: off + (i + 1) * c] for i in range(6))
            means = vec[off + 6 * c: off + 6 * c + h * c].reshape(h, c)
            off += need
            sd = np.sqrt(np.maximum(gv, 0) + float(layer.get("eps") or 1e-5))
            lags_m.append(float(np.sqrt(np.mean(((rm - gm) / sd) ** 2))))
            lags_v.append(float(np.median(np.abs((rv + 1e-12) / (gv + 1e-12) - 1.0))))
            if h > 1:
                ses.append(float(np.sqrt(np.mean((means.std(axis=0, ddof=1) / math.sqrt(h * world) / sd) ** 2))))
    if not lags_m:
        return None
    return {"mean_lag_std": float(np.median(lags_m)), "var_lag_rel": float(np.median(lags_v)),
            "population_se_std": float(np.median(ses)) if ses else None,
            "eval_output_shift": float(np.median(shifts)) if shifts else None, "layers": len(lags_m)}


def lag_level(pop: dict[str, Any]) -> str:
    """likely / possible / ruled_out for one arm's running-statistics lag (`population`)."""
    m, v, se = pop["mean_lag_std"], pop["var_lag_rel"], pop["population_se_std"] or 0.0
    if (m > LAG_LIKELY and m > 3 * se) or v > VAR_LAG_LIKELY:
        return "likely"
    if (m > LAG_POSSIBLE and m > 2 * se) or v > VAR_LAG_POSSIBLE:
        return "possible"
    return "ruled_out"


def running_stats_causes(arms: list[Arm], paired: bool) -> list[Cause]:
    """DD213 (running statistics lag population statistics at the final weights) and DD214 (the eval-output shift
    that lag causes), per arm. Lag present in both the SyncBN arm and the per-rank-statistics arm to within a
    factor CLEAR_DIFFERENCE cannot explain a gap between them: BOTH ARMS. The per-rank arm compared is L when it
    ran (same modules, only the statistics differ: the statistical effect of syncing), else P. Comparing arms
    needs them paired."""
    pops = {arm.name: population(arm.ctx) for arm in arms}
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

    def decide(values: dict[str, float], material: dict[str, str]) -> tuple[str, str]:
        """(verdict, favours) from per-arm sizes and per-arm verdicts."""
        worst = max(material.values(), key=lambda x: {"ruled_out": 0, "possible": 1, "likely": 2}[x])
        if worst == "ruled_out":
            return "ruled_out", "none"
        if paired and "A" in values and "P" in values:
            xa, xp = values["A"], values["P"]
            if xa > CLEAR_DIFFERENCE * xp and material.get("A") != "ruled_out":
                return worst, "plain"
            if xp > CLEAR_DIFFERENCE * xa and material.get("P") != "ruled_out":
                return worst, "syncbn"
            return "both_arms", "none"
        return worst, "none"

    per_arm = {k: lag_level(x) for k, x in pops.items()}
    size = {k: max(x["mean_lag_std"], x["var_lag_rel"]) for k, x in pops.items()}
    verdict, favours = decide(size, per_arm)
    worst = max(pops.items(), key=lambda kv: size[kv[0]])
    m, v, se = worst[1]["mean_lag_std"], worst[1]["var_lag_rel"], worst[1]["population_se_std"] or 0.0
    def label(k: str) -> str:
        return "L" if renamed and k == "P" else k

    text = "; ".join(f"arm {label(k)}: mean {fmt_num(x['mean_lag_std'])} std, var {fmt_num(100 * x['var_lag_rel'])}%"
                     for k, x in sorted(pops.items()))
    tail = {"ruled_out": ": no material lag",
            "both_arms": ": both arms lag alike, so it cannot explain a gap between them (early training moves the "
            "weights faster than the running averages follow)",
            }.get(verdict, f": arm {label(worst[0])}'s running statistics lag the current weights")
    out.append(Cause(cause="stale-running-stats", rule="DD213", verdict=verdict, favours=favours,
                     measured={"summary": f"lag {fmt_num(m)} std, var {fmt_num(100 * v)}% (arm {label(worst[0])})",
                               "per_arm": {label(k): bc.rounded(x) for k, x in pops.items()},
                               "population_se_std": _r(se)},
                     message=(f"running statistics against PreciseBN population statistics recomputed at the final "
                              f"weights on held training batches (median over layers; {text}; population estimate "
                              f"±{fmt_num(se)} std){tail}"),
                     fix=get_rule("DD213").fix, severity=Severity.INFO, magnitude=m))
    shifts = {k: x["eval_output_shift"] for k, x in pops.items() if x.get("eval_output_shift") is not None}
    if shifts:
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


def port_causes(written: Arm, other: Arm | None) -> list[Cause]:
    """Findings of the as-written arm that are not about SyncBN: in both arms → BOTH ARMS."""
    out = []
    other_rules = {f.rule for f in other.findings} if other is not None else set()
    seen: set[str] = set()
    for f in written.findings:
        if f.rule in TRIAGE_RULES or f.rule in SYNCBN_ONLY or f.rule in seen:
            continue
        seen.add(f.rule)
        rule = get_rule(f.rule)
        both = other is None or f.rule in other_rules
        if both:
            verdict, favours = "both_arms", "none"
            message = f.message + " — this hurts both arms, so it cannot explain a gap between them"
        else:
            verdict = "possible"
            favours = "plain" if written.name == "A" else "syncbn"
            message = f.message + f" — seen with arm {written.name} only, not with arm {other.name}"
        out.append(Cause(cause=rule.name, rule=f.rule, verdict=verdict, favours=favours,
                         measured={"summary": _clip(f.message), **_small(dict(list(f.evidence.items())[:8]))},
                         message=message, fix=f.fix, severity=f.severity, magnitude=f.magnitude, file=f.file,
                         line=f.line))
    return out


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


# --------------------------------------------------------------------------------------------------- triage


def rank_causes(causes: list[Cause]) -> list[Cause]:
    """By tier, severity and size; a consequence right after the cause that explains it (root causes first)."""
    def key(c: Cause) -> tuple:
        return (c.tier, -int(c.severity), -c.magnitude, c.rule or "", c.cause)

    roots = sorted((c for c in causes if c.explained_by is None or not any(
        r.rule == c.explained_by and r.explained_by is None for r in causes)), key=key)
    out: list[Cause] = []
    for c in roots:
        out.append(c)
        out.extend(sorted((x for x in causes if x.explained_by == c.rule and x not in roots), key=key))
    return out


def fold_consequences(causes: list[Cause]) -> None:
    """Running statistics that are worse with per-rank statistics are what noisy small per-rank batches, non-i.i.d.
    shards, or BN over small micro-batches do: such DD213/DD214 verdicts favouring SyncBN are consequences of that
    cause."""
    roots = [c for c in causes if (c.rule == "DD204" and c.verdict == "ruled_out" and c.favours == "syncbn"
                                   and (c.measured.get("per_rank_samples") or SMALL_BATCH) < SMALL_BATCH)
             or (c.rule in ("DD203", "DD215") and c.verdict in ("likely", "possible"))]
    if not roots:
        return
    root = roots[0]
    for c in causes:
        if c.rule in ("DD213", "DD214") and c.favours == "syncbn" and c.explained_by is None:
            c.explained_by = root.rule
            c.message += f" — a consequence of {root.cause} ({root.rule})"


REASONS = {
    "DD208": "a converted layer computes a different function",
    "DD209": "code that picks norm layers by class treats the converted layers differently",
    "DD210": "frozen BatchNorm layers train again",
    "DD211": "SyncBN applies statistics that are not its group's exact ones",
    "DD212": "SyncBN synchronises over the wrong ranks",
    "DD216": "the converted layers' BN parameters are never trained",
    "DD203": "the ranks' data are not i.i.d., which SyncBN corrects",
    "DD215": "BN normalises small micro-batches under gradient accumulation, which SyncBN partly recovers",
    "DD213": "running statistics lag the weights more without SyncBN",
    "DD214": "evaluation is more inconsistent with training without SyncBN",
    "DD204": "per-GPU BN statistics from so few samples are noisy",
}


def headline(causes: list[Cause], mirror: bool) -> str:
    """One sentence: what to do first, in the user's question's terms."""
    top = causes[0] if causes else None
    if top is not None and top.verdict == "confirmed":
        reason = REASONS.get(top.rule or "", top.cause)
        if mirror:
            return (f"Converting this plain-BN script to SyncBN would change the model itself: {reason} "
                    f"({top.rule}) — fix that before converting.")
        return f"The conversion to SyncBN changed the model itself: {reason} ({top.rule}) — fix that before comparing accuracy."
    prefix = "No SyncBN-specific defect found"
    if top is not None and top.verdict == "both_arms":
        return f"{prefix}; {top.cause} ({top.rule}) hurts both arms, so the regression is elsewhere — fix it first."
    noise = next((c for c in causes if c.rule == "DD204"), None)
    b = noise.measured.get("per_rank_samples") if noise is not None else None
    if top is not None and top.verdict == "likely" and top.favours in ("plain", "subgroups"):
        if mirror:
            return (f"{prefix}; SyncBN would most likely not help: per-GPU batches" + (f" of {b}" if b else "")
                    + " already give stable BN statistics, and syncing would remove the BN noise that regularises.")
        return (f"{prefix}; SyncBN most likely scores lower because it removes the BN noise that per-GPU batches"
                + (f" of {b}" if b else "") + " already average out: use per-GPU BatchNorm or SyncBN over small "
                "subgroups.")
    favouring = next((c for c in causes if c.favours == "syncbn" and c.verdict in ("likely", "possible", "ruled_out")),
                     None)
    if favouring is not None and (top is favouring or top is None or top.favours in ("syncbn", "none")):
        reason = REASONS.get(favouring.rule or "", favouring.cause)
        if mirror:
            return f"{prefix} in the conversion; SyncBN would likely help here: {reason} ({favouring.rule})."
        return f"{prefix}; SyncBN is right here — {reason} ({favouring.rule}) — so the regression is elsewhere."
    if top is not None and top.verdict == "possible":
        if top.rule == "DD204" and not mirror:
            return (f"{prefix}; SyncBN may score lower because it removes part of the BN noise of per-GPU batches"
                    + (f" of {b}" if b else "") + " (possible, not likely): compare with per-GPU BatchNorm.")
        return f"{prefix}; the strongest candidate is only possible: {top.cause} ({top.rule})."
    return (f"{prefix}: nothing measured explains a gap between SyncBN and plain DDP on this script"
            + (" (the mirror question: converting would change nothing measurable)." if mirror else "."))


def triage(arms: list[Arm], settings: Any) -> TriageResult:
    by_name = {arm.name: arm for arm in arms}
    a, p = by_name.get("A"), by_name.get("P")
    written = next((arm for arm in arms if arm.as_written), arms[0])
    mirror = written.name == "P"
    paired, pair_info = pairing(arms)
    causes: list[Cause] = []
    notes: list[str] = []
    if a is not None:
        conv = conversion_causes(a)
        causes.extend(conv)
        if p is not None:
            causes.extend(attribute_causes(a, p, conv))
        nonid = noniid_cause(a)
        if nonid is not None:
            causes.append(nonid)
        causes.append(noise_cause(a, by_name.get("L") or p, settings,
                                  noniid=bool(nonid and nonid.verdict != "ruled_out"), g_arm=by_name.get("G")))
        acc = accumulation_cause(a)
        if acc is not None:
            causes.append(acc)
    # without arm L, A and P differ by whatever the conversion changed too: once that is confirmed, their running
    # statistics are not compared (no arm is favoured)
    confounded = "L" not in by_name and any(c.verdict == "confirmed" for c in causes)
    causes.extend(running_stats_causes([x for x in (a, by_name.get("L"), p) if x is not None],
                                       paired and not confounded))
    other = p if written is a else a
    causes.extend(port_causes(written, other))
    fold_consequences(causes)
    for arm in arms:
        failed = [f for f in arm.findings if f.rule in ("DD901", "DD902")] if arm is not written else []
        if failed:
            notes.append(f"arm {arm.name} ({arm.what}) failed: {failed[0].rule} {failed[0].name} — what compares it "
                         f"with the other arms covers its {arm.steps} steps only")
    if not paired:
        notes.append(f"arms not paired: {pair_info.get('reason')}; statistics comparing the arms are not used")
    ranked = rank_causes(causes)
    arms_json = [{"name": arm.name, "what": arm.what, "steps": arm.steps} for arm in arms]
    emulated = any(e.get("cuda_emulated") for arm in arms for _, e in arm.ctx.run.events("torch_ready"))
    return TriageResult(arms=arms_json, paired=paired, pairing=pair_info, headline=headline(ranked, mirror),
                        causes=ranked, emulated=emulated, mirror=mirror, notes=notes)


def cause_findings(result: TriageResult, arm: Arm) -> list[Finding]:
    """Confirmed and likely causes with a rule, as findings (so exit codes and --fail-on see them)."""
    out = []
    for c in result.causes:
        if c.rule is None or c.verdict not in ("confirmed", "likely") or c.rule not in TRIAGE_RULES:
            continue
        existing = [f for f in arm.findings if f.rule == c.rule and f.message == c.message]
        if existing:
            out.extend(existing)
            continue
        out.append(new_finding(
            c.rule, sources=("probe",), severity=c.severity,
            confidence=Confidence.CERTAIN if c.verdict == "confirmed" else Confidence.LIKELY,
            message=c.message, file=c.file or arm.ctx.script, line=c.line, ranks=arm.ctx.ranks,
            evidence={"triage_verdict": c.verdict, "triage_favours": c.favours,
                      **{k: v for k, v in c.measured.items() if k != "summary"}},
            magnitude=c.magnitude,
        ))
    unique: dict[tuple, Finding] = {}
    for f in out:
        unique.setdefault((f.rule, f.message), f)
    return list(unique.values())
