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

Confidence: without the reference recipe nobody can tell from the source that a literal lr is wrong — it may
already be the value tuned for this world size — so a literal, a command-line default or the optimizer's default
is `possible` at low severity (it must not fail a CI gate on correct code). It is `likely` (high) only where the
file itself shows the single-process recipe: the lr is scaled with the per-process batch size but not with the
world size (`lr = 0.1 * batch_size / 256` with `DataLoader(batch_size=batch_size)`): the author applied the
scaling rule to a batch DDP multiplies. When the same lr also trains the script's own single-process run
(`if args.distributed: model = DDP(model)` with the optimizer built for both), one lr serves two global batches
that differ by the world size, and the message says so; but nothing says which of the two it was tuned for, and
a recipe published for N GPUs (DETR, the torchvision references) keeps its single-process path for debugging:
that stays `possible`, low.
The probe settles it: with --base-lr/--base-batch it measures the global batch and the lr, and clears this
finding when the lr matches the scaled reference.
"""

from __future__ import annotations

from typing import Callable, Iterator

from ddpdoctor import torchnames as N
from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.rules.dd401_lr_not_scaled import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached, lower
from ddpdoctor.static.semantic import WORLD_TAGS, Event, Obj, Value, constant_values, is_constant, tags_of


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


def _same_quantity(batch: Value) -> Callable[[Obj], bool]:
    """Whether an operand is the per-process batch size: the same object, the same command-line option, or the
    same name (`args.batch_size` read twice gives two objects of one option)."""
    ids = {id(o) for o in batch}
    dests = {o.props["cli_arg"].dest for o in batch if o.props.get("cli_arg") is not None}
    labels = {o.label for o in batch if o.label}

    def match(o: Obj) -> bool:
        cli = o.props.get("cli_arg")
        return id(o) in ids or (cli is not None and cli.dest in dests) or (bool(o.label) and o.label in labels)

    return match


def _grows_with(obj: Obj, match: Callable[[Obj], bool], depth: int = 0) -> bool:
    """`base_lr * batch_size / 256`, `lr * batch / 32`: the value grows with a matching operand."""
    if depth > 8:
        return False
    if match(obj):
        return True
    op = obj.props.get("op")
    left, right = obj.props.get("left", ()), obj.props.get("right", ())
    if op == "Mult":
        return any(_grows_with(o, match, depth + 1) for o in left + right)
    if op in ("Div", "FloorDiv", "Pow"):
        return any(_grows_with(o, match, depth + 1) for o in left)
    return False


def _scaled_with_batch(script: ScriptModel, opt: Obj, loaders: list[Obj]) -> str | None:
    """The text of the per-process batch size the lr was scaled with (but not with the world size), or None."""
    lr = opt.props.get("lr") or ()
    if not lr or tags_of(lr) & WORLD_TAGS:
        return None
    for loader in loaders:
        batch = loader.props.get("batch_size") or ()
        if not batch or tags_of(batch) & WORLD_TAGS:
            continue
        match = _same_quantity(batch)
        if any(_grows_with(o, match) for o in lr):
            node = loader.props.get("batch_size_node")
            return script.text(node) if node is not None else (batch[0].label or "the per-process batch size")
    return None


def _also_single_process(script: ScriptModel, ev: Event, wrapped: list[Obj]) -> str | None:
    """The condition under which the script wraps the model in DDP, when the optimizer (built outside it) also
    trains the model unwrapped: the same lr serves the script's single-process run."""
    families = {id(o.family) for o in wrapped if o.family is not None}
    wraps = [
        w for w in script.ddp_wraps
        if w.data["wrapper"].family is not None and id(w.data["wrapper"].family) in families
    ]
    if not wraps:
        return None
    opt_conds = {id(c.node) for c in ev.ctx if c.kind == "cond"}
    for w in wraps:
        conds = [c for c in w.ctx if c.kind == "cond" and id(c.node) not in opt_conds]
        if not conds:
            return None  # wrapped on every path the optimizer sees
    cond = next(c for c in wraps[0].ctx if c.kind == "cond" and id(c.node) not in opt_conds)
    return str(cond.info)


def check(script: ScriptModel) -> Iterator[Finding]:
    if not script.ddp_wraps or script.lr_scaled_up:
        return
    training_loaders = [
        lev.data["obj"]
        for lev in script.of("loader")
        if any(script.iteration_trains(it) for it in script.of("iterate", loaders=(lev.data["obj"],)))
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
        batch_text = _scaled_with_batch(script, opt, training_loaders)
        described = _describe_lr(script, opt)
        if batch_text is not None:
            node = opt.props.get("lr_node")
            text = f"lr={script.text(node) if node is not None else 'lr'}"
            lr0 = (opt.props.get("lr") or (None,))[0]
            expr = script.text(lr0.node) if lr0 is not None and lr0.node is not None else None
            described = ("batch", text + (f" (= {expr})" if expr and f"lr={expr}" != text else ""), None)
        if described is None:
            continue
        kind, text, value = described
        if text in reported:  # `if opt == "sgd": SGD(lr=args.lr) elif ...: AdamW(lr=args.lr)`: one cause
            reported[text].setdefault("also_at", []).append(ev.line)
            continue
        cls = opt.props.get("cls") or "optimizer"
        adam = cls in N.ADAM_FAMILY
        rule = "√world_size" if adam else "world_size"
        single = _also_single_process(script, ev, wrapped) if kind != "batch" else None
        # Without a sign of the single-process recipe in the file, a literal lr may be the value tuned for this
        # world size: heuristic. The probe with --base-lr/--base-batch measures it.
        if kind == "batch":
            confidence, severity = Confidence.LIKELY, None
        else:
            confidence, severity = Confidence.POSSIBLE, Severity.LOW
        if not owners:
            confidence = lower(confidence)
        if warmup and confidence > Confidence.POSSIBLE and kind != "batch":
            # a warmup schedule usually comes with an lr already scaled by hand (`lr=0.4  # 0.1 x 4 GPUs`)
            confidence, severity = Confidence.POSSIBLE, Severity.LOW
        evidence = {"optimizer": cls, "optimizer_line": ev.line, "lr": value, "lr_source": kind,
                    "suggested_scaling": "sqrt" if adam else "linear"}
        if kind == "batch":
            evidence["scaled_with_per_process_batch"] = batch_text
            message = (
                f"{cls} at line {ev.line} uses {text}, scaled with the per-process batch size `{batch_text}` but not "
                f"with the world size, while DDP averages gradients over world_size × that batch: the global batch "
                f"is world_size times the one the lr was scaled for"
            )
        else:
            if single is None:
                message = (
                    f"{cls} at line {ev.line} uses {text} and nothing scales it by {rule}, while DDP averages "
                    "gradients over world_size × the per-process batch: if it is the single-GPU value, the global "
                    "batch is world_size times the one it was tuned for (pass --base-lr/--base-batch to measure it)"
                )
            else:
                message = (
                    f"{cls} at line {ev.line} uses {text}, a per-process value, while DDP averages gradients over "
                    f"world_size × the per-process batch and nothing scales the lr by {rule}"
                )
            if single is not None:
                evidence["ddp_only_when"] = single
                message += (
                    f"; the same lr also trains the script's single-process run (DDP only when `{single}`), so one "
                    "of the two uses an lr tuned for the other's global batch"
                )
        reported[text] = evidence
        yield script.finding(
            CODE, line=ev, message=message, confidence=cap_unreached(confidence, ev), evidence=evidence,
            severity=severity,
        )
