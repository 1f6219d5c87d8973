"""DD402 no-warmup: the lr is scaled up with the world size and nothing ramps it up.

What it flags (low): an lr (or the loss) multiplied by the world size or the global batch when the file has no
warmup: no LinearLR/OneCycleLR/ConstantLR scheduler, nothing named "warmup". Large scaled learning rates are
unstable in the first iterations; the linear scaling rule comes with a gradual warmup (Goyal et al., 2017).

What stays silent: any warmup scheduler or warmup logic; lr divided by the world size; unscaled lr (DD401).

Confidence: likely when the file has no scheduler at all; possible when a LambdaLR/SequentialLR or custom schedule
could ramp (we cannot tell from its code that it does not).

Evidence `unscaled_lr`: the term of the scaling expression that is the lr before scaling (`args.lr` in
`args.lr * args.batch_size * world_size / 256`: its option's dest, or a literal's value), so the probe can tell
from the lr the ranks stepped with by how much the expression scaled it — up, or down (a global batch below 256
scales it down, and a scale-down needs no warmup).
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor import torchnames as N
from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd402_no_warmup import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import EMPTY, Obj, Value


def check(script: ScriptModel) -> Iterator[Finding]:
    # `loss *= world_size` is left alone: it is a deliberate sum-not-mean choice, not an lr bump
    sites = [ev for ev in script.lr_scaled_up if ev.kind != "loss_scaled"]
    if not sites:
        return
    schedulers = [ev.data["obj"].props.get("cls") for ev in script.of("scheduler")]
    if any(cls in N.WARMUP_SCHEDULERS for cls in schedulers) or "warm" in script.words:
        return
    site = sites[0]
    confidence = Confidence.POSSIBLE if schedulers else Confidence.LIKELY
    if site.kind == "optimizer" and site.data["obj"].props.get("lr_node") is not None:
        what = f"lr={script.text(site.data['obj'].props['lr_node'])}"
    else:
        what = script.text(site.node)
    value = site.data["obj"].props.get("lr") if site.kind == "optimizer" else site.data.get("value")
    base = unscaled_lr(value or EMPTY)
    yield script.finding(
        CODE,
        line=site,
        message=f"`{what}` at line {site.line} scales the step size with the world size, but no warmup schedule ramps it "
        f"up, so the first iterations run at the full scaled lr (unstable from about 4 processes on)",
        confidence=cap_unreached(confidence, site),
        evidence={"scaling_line": site.line, "schedulers": [s for s in schedulers if s],
                  **({"unscaled_lr": base} if base else {})},
    )


def _factors(value: Value, depth: int = 0) -> list[Obj]:
    """The operands an expression multiplies together (both sides of `*`, the numerator of `/`)."""
    out: list[Obj] = []
    for o in value:
        op = o.props.get("op")
        if depth < 8 and op == "Mult":
            out += _factors(o.props.get("left", EMPTY), depth + 1) + _factors(o.props.get("right", EMPTY), depth + 1)
        elif depth < 8 and op in ("Div", "FloorDiv"):
            out += _factors(o.props.get("left", EMPTY), depth + 1)
        else:
            out.append(o)
    return out


def unscaled_lr(value: Value) -> dict | None:
    """The lr the expression scales: an lr-named operand (`args.lr`: its option's dest; `base_lr`: its name, and its
    value when static analysis knows it), else the product of its literal factors (`0.1 * world_size`)."""
    factors = _factors(value)
    for o in factors:
        name = o.props.get("attr") or o.label or ""
        if o.const or not N.is_lr_name(str(name).split(".")[-1]):
            continue
        cli = o.props.get("cli_arg")
        default = None
        if cli is not None:
            default = next((d.value for d in cli.default if d.const and isinstance(d.value, (int, float))), None)
        return {"text": o.label or str(name), "option": cli.dest if cli is not None else None, "default": default}
    literals = [o.value for o in factors
                if o.const and isinstance(o.value, (int, float)) and not isinstance(o.value, bool)]
    if literals and len(literals) < len(factors):
        product = 1.0
        for v in literals:
            product *= float(v)
        return {"text": " * ".join(repr(v) for v in literals), "option": None, "value": product}
    return None
