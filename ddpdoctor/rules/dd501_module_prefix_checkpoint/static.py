"""DD501 module-prefix-checkpoint: a checkpoint saved from the DDP (or DataParallel) wrapper.

What it flags: `torch.save` (or a `save*` helper the walk cannot enter) of `model.state_dict()` where `model`
is — on at least one path — the wrapper, directly or inside a dict (`{"model": model.state_dict(), ...}`), or of
the wrapper object itself. Every key then starts with "module.", and loading into the plain model fails or, with
strict=False, silently loads nothing.

What stays silent: `model.module.state_dict()`, an unwrapped alias (`model_without_ddp = model.module`), optimizer
state dicts, scripts that strip the prefix themselves (`consume_prefix_in_state_dict_if_present`, a
`"module."` replace/startswith on load), and a resume checkpoint the script loads back into the wrapper while it
also saves the plain model's weights for everyone else (Barlow Twins, SwAV: `checkpoint.pth` from the wrapper,
`resnet50.pth` from `model.module`).

Confidence: certain when the saved state dict comes from the wrapper on every path; likely when the variable is
the wrapper only on the distributed path or the save happens in a helper. A checkpoint the script loads back into
the wrapper, with no plain weights saved beside it, is still reported, at low (resuming works, so it is not a
defect of this script; every other consumer must strip the prefix), and the message says so.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.rules.dd501_module_prefix_checkpoint import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import Obj, Value


def _held(value: Value, depth: int = 0) -> Iterator[tuple[Obj, Value]]:
    """Every object a saved value holds, through dicts and tuples (a checkpoint dict of state dicts), each with
    the value it is one of."""
    if depth > 4:
        return
    for o in value:
        yield o, value
        if o.kind == "dict":
            for v in o.fields.values():
                yield from _held(v, depth + 1)
        elif o.kind == "tuple":
            for v in (o.items or ()) + ((o.props["elem"],) if "elem" in o.props else ()):
                yield from _held(v, depth + 1)


def _model_state_owners(o: Obj) -> tuple[Obj, ...]:
    """The modules a model state dict comes from (none for an optimizer's, or for anything else)."""
    return o.props.get("owner", ()) if o.kind == "state_dict" and not o.props.get("optimizer") else ()


def _wrapper_states(value: Value) -> list[tuple[Obj, bool]]:
    """(wrapper, only-wrapper) for each wrapper whose state ends up in `value`."""
    out: list[tuple[Obj, bool]] = []
    for o, among in _held(value):
        owners = _model_state_owners(o)
        wrappers = [w for w in owners if w.kind == "wrapper"]
        out.extend((w, len(wrappers) == len(owners)) for w in wrappers)
        if o.kind == "wrapper":
            out.append((o, len(among) == 1))
    return out


def _families_loaded_into_wrapper(script: ScriptModel) -> set[int]:
    """Models whose wrapper the script loads a state dict into (a resume into the same wrapper: the keys match)."""
    return {
        id(o.family)
        for ev in script.of("load_state_dict")
        for o in ev.data["target"]
        if o.kind == "wrapper" and o.family is not None
    }


def _plain_saves(script: ScriptModel) -> list[Obj]:
    """The modules whose own state dicts the script saves (`torch.save(model.module.state_dict(), ...)`, a part of
    the model: `model.module.backbone.state_dict()`), with no wrapper among their owners on any path."""
    out: list[Obj] = []
    for ev in script.of("save"):
        for o, _ in _held(ev.data["obj"]):
            owners = _model_state_owners(o)
            if owners and not any(w.kind == "wrapper" for w in owners):
                out.extend(owners)
    return out


def _exports_plain(wrapper: Obj, plain: list[Obj]) -> bool:
    """Whether the script also saves the weights of the model inside `wrapper` (or of a part of it) unwrapped."""
    if not plain:
        return False
    parts: list[Obj] = []
    layer = list(wrapper.props.get("inner", ()))
    for _ in range(3):  # the model, its submodules, theirs
        parts.extend(layer)
        layer = [x for o in layer if o.is_module for v in o.fields.values() for x in v if x.is_module]
    return any(p is o or (o.family is not None and o.family is p.family) for o in plain for p in parts)


def check(script: ScriptModel) -> Iterator[Finding]:
    if script.of("strip_prefix") or any(s.startswith("module.") or s == "module" for s in script.string_constants):
        return
    resumed = _families_loaded_into_wrapper(script)
    plain = _plain_saves(script) if resumed else []
    candidates = [(ev, ev.data["obj"], "torch.save") for ev in script.of("save")]
    # a helper the walk entered (a save_model of the project): the torch.save inside it is judged there, with the
    # branches of the helper (`if isinstance(model, DataParallel): model.module.state_dict()`) taken into account
    entered = {(c[0], c[1]) for sev in script.of("save") for c in sev.chain}
    for ev in script.of("call"):
        name = (ev.data.get("name") or "").lower()
        if (ev.file, ev.line) in entered:
            continue
        if "save" in name:
            candidates.append((ev, ev.data["args"].all(), ev.data.get("name") or "save"))
    for ev, value, how in candidates:
        states = _wrapper_states(value)
        if not states:
            continue
        wrapper, only = states[0]
        family = id(wrapper.family) if wrapper.family is not None else None
        if family in resumed and _exports_plain(wrapper, plain):
            continue  # a resume checkpoint: loaded back into the wrapper, the plain weights saved for the rest
        wrap = script.wrap_event_of(wrapper)
        kind = "DDP" if wrapper.wrapper_kind == "ddp" else "DataParallel"
        confidence = Confidence.CERTAIN if only and how == "torch.save" else Confidence.LIKELY
        message = (
            f"the checkpoint saved by {how} at line {ev.line} holds the state of the {kind} wrapper "
            f"`{script.name(wrapper)}`" + (f" ({script.place(wrap, ev)})" if wrap else "")
            + ", so every key starts with \"module.\""
        )
        if family in resumed:
            message += (
                ": this script loads it back into the wrapper, so resuming works, but a single-process run, an "
                "evaluation script or a fine-tuning recipe that loads it into the plain model fails (or, with "
                "strict=False, loads nothing)"
            )
        else:
            message += " and the plain model cannot load it"
        yield script.finding(
            CODE,
            line=ev,
            message=message,
            confidence=cap_unreached(confidence, ev),
            evidence={"save_line": ev.line, "wrapper": script.name(wrapper), "wrap_line": wrap.line if wrap else None,
                      "saved_by": how, "loaded_back_into_wrapper": family in resumed},
            # the script's own use of the checkpoint (resuming) works: what breaks is another program's, so low
            severity=Severity.LOW if family in resumed else None,
        )
