"""DD401 lr-not-scaled: the single-process learning rate is used for a batch that DDP multiplies by the world size.

What it flags: an optimizer of a DDP-trained model whose lr is a literal (or an argparse option's default, or the
optimizer's own default) when nothing in the file makes the step size follow the world size. DDP averages
gradients over world_size × the per-process batch, so a recipe tuned for one process at batch B now takes the
same step for a batch of world_size × B: the linear scaling rule (Goyal et al.) says lr × world_size for SGD,
√world_size is common for Adam-family optimizers.

What stays silent: lr computed from the global batch or the world size anywhere (`base_lr * batch_size *
world_size / 256`, `args.lr * dist.get_world_size()`, `lr *= world_size`); `loss *= world_size` (sums gradients
instead of averaging — the same scaling for SGD); a per-process batch divided by the world size (the global
batch stays the single-process one); lr from a config object the walk cannot see.

Confidence: likely for a literal lr with SGD-like optimizers; possible (medium severity) for command-line
defaults — the user may pass a scaled value —, for Adam-family optimizers, and when a warmup schedule suggests the
literal was already scaled by hand.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.static import names as N
from ddpdoctor.static.model import ScriptModel, cap_unreached, lower
from ddpdoctor.static.semantic import WORLD_TAGS, Obj, Value, constant_values, is_constant, tags_of

CODE = "DD401"


def _describe_lr(script: ScriptModel, opt: Obj) -> tuple[str, str, object] | None:
    """(kind, text, value) of an optimizer's lr: kind is "literal", "default", "cli" or None when unknown."""
    lr = opt.props.get("lr")
    cls = opt.props.get("cls")
    if lr is None:
        groups = _group_lrs(opt)
        if groups:
            lr = groups
        elif cls in N.DEFAULT_LR:
            return "default", f"the {cls} default lr={N.DEFAULT_LR[cls]}", N.DEFAULT_LR[cls]
        else:
            return None
    if tags_of(lr) & WORLD_TAGS:
        return None
    node = opt.props.get("lr_node")
    text = script.text(node) if node is not None else "lr"
    if is_constant(lr):
        values = constant_values(lr) or [o.value for o in lr]
        value = values[0] if values else None
        if value is not None and text != repr(value) and not text.replace(".", "").replace("e-", "").isdigit():
            return "literal", f"lr={text} (= {value})", value
        return "literal", f"lr={text}", value
    cli = [o.props.get("cli_arg") for o in lr if o.props.get("cli_arg") is not None]
    if cli and len(cli) == len(lr):
        default = cli[0].default
        dv = constant_values(default) if default else []
        return "cli", f"lr={text} (default {dv[0]})" if dv else f"lr={text}", dv[0] if dv else None
    return None


def _group_lrs(opt: Obj) -> Value:
    """The lr of each param group given as a dict (`[{"params": ..., "lr": 0.1}, ...]`)."""
    params = opt.props.get("params") or ()
    out: list[Obj] = []
    for o in params:
        for group in (o.items or ()) if o.kind == "tuple" else ():
            for d in group:
                if d.kind == "dict" and "lr" in d.fields:
                    out.extend(d.fields["lr"])
    return tuple(out)


def check(script: ScriptModel) -> Iterator[Finding]:
    if not script.ddp_wraps or script.lr_scaled_up:
        return
    training_loaders = [
        lev.data["obj"]
        for lev in script.of("loader")
        if any(lev.data["obj"] in it.data["loaders"] and script.iteration_trains(it) for it in script.of("iterate"))
    ]
    if not training_loaders:
        return  # no DataLoader feeds the training loop: the per-process batch is not visible
    for loader in training_loaders:
        if tags_of(loader.props.get("batch_size") or ()) & WORLD_TAGS:
            return  # per-process batch = global batch / world size: the single-process recipe still holds
    reported: dict[str, dict] = {}
    warmup = any(ev.data["obj"].props.get("cls") in N.WARMUP_SCHEDULERS for ev in script.of("scheduler")) or (
        "warmup" in script.words or "warm_up" in script.words
    )
    for ev in script.of("optimizer"):
        opt = ev.data["obj"]
        owners = script.param_owners(opt.props.get("params") or ())
        wrapped = [o for o in owners if o.family is not None and o.family.wrapped]
        if owners and not wrapped:
            continue
        described = _describe_lr(script, opt)
        if described is None:
            continue
        kind, text, value = described
        if text in reported:  # `if opt == "sgd": SGD(lr=args.lr) elif ...: AdamW(lr=args.lr)`: one cause
            reported[text].setdefault("also_at", []).append(ev.line)
            continue
        cls = opt.props.get("cls") or "optimizer"
        adam = cls in N.ADAM_FAMILY
        severity = None
        if kind == "literal" and not adam:
            confidence = Confidence.LIKELY
        else:
            confidence, severity = Confidence.POSSIBLE, Severity.MEDIUM
        if not owners:
            confidence = lower(confidence)
        if warmup and confidence > Confidence.POSSIBLE:
            # a warmup schedule usually comes with an lr already scaled by hand (`lr=0.4  # 0.1 x 4 GPUs`)
            confidence, severity = Confidence.POSSIBLE, Severity.MEDIUM
        rule = "√world_size" if adam else "world_size"
        evidence = {"optimizer": cls, "optimizer_line": ev.line, "lr": value, "lr_source": kind, "suggested_scaling": "sqrt" if adam else "linear"}
        reported[text] = evidence
        yield script.finding(
            CODE,
            ev.line,
            f"{cls} at line {ev.line} uses {text}, a per-process value, while DDP averages gradients over "
            f"world_size × the per-process batch and nothing scales the lr by {rule}",
            cap_unreached(confidence, ev),
            evidence=evidence,
            severity=severity,
        )
