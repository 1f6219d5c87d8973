"""Triage's deterministic checks → CONFIRMED (pure: the arms' events and findings; no torch).

- `pairing(arms)`: do the arms start from the same weights and see the same first batches, rank by rank (digests)?
- `conversion_causes(a)`: what the conversion did to each layer within the SyncBN arm, from the arm's own analyses
  (DD208 changed function, DD209 momentum/eps lost, DD210 unfrozen, DD211 applied statistics, DD212 process group,
  DD216 parameters not trained).
- `attribute_causes(a, p, ...)`: per-layer attributes and optimizer membership compared between the arm with the
  conversion (A) and the arm without it (P) at the same optimizer step — code that picks norm layers by exact class
  changed their weight decay, momentum, freezing or precise-BN recalibration (DD209), or frozen layers train again
  (DD210).
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses import bn_checks
from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Finding
from ddpdoctor.formatting import fmt_measure as fmt_num
from ddpdoctor.rules import get_rule
from ddpdoctor.triage.model import CONVERSION_RULES, Arm, Cause, small
from ddpdoctor.triage.model import layers as n_layers


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
                out.append({"layer": name, "step": step, "diffs": diffs, "cls_a": la.get("cls"),
                            "cls_p": lp.get("cls")})
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



def conversion_causes(a: Arm) -> list[Cause]:
    """CONFIRMED from the SyncBN arm's own deterministic checks."""
    out = []
    for rule in CONVERSION_RULES:
        for f in a.has(rule):
            out.append(Cause(cause=f.name, rule=f.rule, verdict="confirmed", favours="fix_conversion",
                             measured={"summary": _summary_of(f), **small(f.evidence)}, message=f.message,
                             fix=f.fix, severity=f.severity, magnitude=f.magnitude, file=f.file, line=f.line,
                             source=f))
    return out


def _summary_of(f: Finding) -> str:
    ev = f.evidence
    if f.rule == "DD208":
        layers = ev.get("layers") or [{}]
        rel = layers[0].get("train_rel_diff")
        return (f"{ev.get('changed')} of {n_layers(ev.get('compared'))} changed (train output differs by "
                f"{fmt_num(100 * (rel or 0))}%)")
    if f.rule == "DD211":
        layers = ev.get("layers") or [{}]
        return (f"applied {layers[0].get('applied')} statistics; var off {fmt_num(layers[0].get('var_error_rel') or 0)}"
                f", mean off {fmt_num(layers[0].get('mean_error_std') or 0)} std")
    if f.rule == "DD212":
        return f"{n_layers(len(ev.get('layers') or []))} with a wrong process group"
    if f.rule == "DD216":
        return f"{n_layers(ev.get('untrained_layers'))}: BN parameters not in the optimizer"
    if f.rule == "DD210":
        return f"{n_layers(ev.get('unfrozen_layers'))} unfrozen by the converter"
    if f.rule == "DD209":
        return f"{n_layers(ev.get('changed_layers'))}: momentum/eps lost in the converter"
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
        where = class_test_site(a.ctx, p.ctx, SETTER_ATTR.get(first["key"], first["key"])) if kind in (
            "hyper", "frozen_by_code") else None
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
        test = (where or {}).get("test") or {}
        if where is not None:
            measured["class_test"] = where
            text += (f" — the class test at {a.ctx.at(where['test'])}: its branch sets {where['attr']} at line "
                     f"{where['set']['line']} for plain BatchNorm (arm P) and never for SyncBatchNorm (arm A)")
        out.append(Cause(cause=cause, rule=rule, verdict="confirmed", favours="fix_conversion", measured=measured,
                         message=text, fix=get_rule(rule).fix, severity=get_rule(rule).severity,
                         magnitude=float(len(items)), file=a.ctx.where(test)[0] if test else None,
                         line=test.get("line")))
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


# the `bn_attr_set` attribute that changes each compared attribute
SETTER_ATTR = {"momentum": "momentum", "eps": "eps", "training": "training", "weight_requires_grad": "requires_grad",
               "bias_requires_grad": "requires_grad"}


def class_test_site(a: RunContext, p: RunContext, attr: str) -> dict[str, Any] | None:
    """Where the script's exact-class test is: a line of its own code that set `attr` on BatchNorm layers in arm P
    (plain BN) and never in arm A (SyncBN) runs only for the plain class; the `if` whose branch holds that line is
    the test (read from the source, when it is there). {"attr", "set": site, "test": site} or None."""
    def sites(ctx: RunContext) -> dict[tuple[str, int], dict[str, Any]]:
        out: dict[tuple[str, int], dict[str, Any]] = {}
        for proc in ctx.ranks.values():
            for e in proc.of("bn_attr_set"):
                site = e.get("site") or {}
                if e.get("attr") == attr and site.get("file"):
                    out.setdefault((site["file"], int(site.get("line") or 0)), site)
        return out

    in_a, in_p = sites(a), sites(p)
    only_p = [site for key, site in sorted(in_p.items()) if key not in in_a]
    if not only_p:
        return None
    setter = only_p[0]
    test = _enclosing_if(setter["file"], int(setter.get("line") or 0)) or setter
    return {"attr": attr, "set": setter, "test": test}


def _enclosing_if(path: str, line: int) -> dict[str, Any] | None:
    """The innermost `if` (or conditional expression's statement) whose body holds `line`, as a site."""
    import ast
    from pathlib import Path

    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.body:
            start, end = node.body[0].lineno, max(getattr(n, "end_lineno", n.lineno) or n.lineno for n in node.body)
            if start <= line <= end and (best is None or node.lineno > best.lineno):
                best = node
    return None if best is None else {"file": path, "line": best.lineno, "function": None}
