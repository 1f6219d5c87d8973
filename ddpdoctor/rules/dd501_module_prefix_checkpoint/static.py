"""DD501 module-prefix-checkpoint: a checkpoint saved from the DDP (or DataParallel) wrapper.

What it flags: `torch.save` (or a `save*` helper the walk cannot enter) of `model.state_dict()` where `model`
is — on at least one path — the wrapper, directly or inside a dict (`{"model": model.state_dict(), ...}`), or of
the wrapper object itself. Every key then starts with "module.", and loading into the plain model fails or, with
strict=False, silently loads nothing.

What stays silent: `model.module.state_dict()`, an unwrapped alias (`model_without_ddp = model.module`), optimizer
state dicts, scripts that strip the prefix themselves (`consume_prefix_in_state_dict_if_present`, a
`"module."` replace/startswith on load).

Confidence: certain when the saved state dict comes from the wrapper on every path; likely when the variable is
the wrapper only on the distributed path or the save happens in a helper.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd501_module_prefix_checkpoint import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import Obj, Value


def _wrapper_states(value: Value, depth: int = 0) -> list[tuple[Obj, bool]]:
    """(wrapper, only-wrapper) for each wrapper whose state ends up in `value`."""
    out: list[tuple[Obj, bool]] = []
    if depth > 4:
        return out
    for o in value:
        if o.kind == "state_dict" and not o.props.get("optimizer"):
            owners = o.props.get("owner", ())
            wrappers = [w for w in owners if w.kind == "wrapper"]
            for w in wrappers:
                out.append((w, len(wrappers) == len(owners)))
        elif o.kind == "wrapper":
            out.append((o, len(value) == 1))
        elif o.kind == "dict":
            for v in o.fields.values():
                out.extend(_wrapper_states(v, depth + 1))
        elif o.kind == "tuple":
            for v in (o.items or ()) + ((o.props["elem"],) if "elem" in o.props else ()):
                out.extend(_wrapper_states(v, depth + 1))
    return out


def check(script: ScriptModel) -> Iterator[Finding]:
    if script.of("strip_prefix") or any(s.startswith("module.") or s == "module" for s in script.string_constants):
        return
    candidates = [(ev, ev.data["obj"], "torch.save") for ev in script.of("save")]
    for ev in script.of("call"):
        name = (ev.data.get("name") or "").lower()
        if "save" in name:
            candidates.append((ev, ev.data["args"].all(), ev.data.get("name") or "save"))
    for ev, value, how in candidates:
        states = _wrapper_states(value)
        if not states:
            continue
        wrapper, only = states[0]
        wrap = script.wrap_event_of(wrapper)
        kind = "DDP" if wrapper.wrapper_kind == "ddp" else "DataParallel"
        confidence = Confidence.CERTAIN if only and how == "torch.save" else Confidence.LIKELY
        yield script.finding(
            CODE,
            line=ev,
            message=f"the checkpoint saved by {how} at line {ev.line} holds the state of the {kind} wrapper "
            f"`{script.name(wrapper)}`" + (f" ({script.place(wrap, ev)})" if wrap else "")
            + ", so every key starts with \"module.\" and the plain model cannot load it",
            confidence=cap_unreached(confidence, ev),
            evidence={"save_line": ev.line, "wrapper": script.name(wrapper), "wrap_line": wrap.line if wrap else None,
                      "saved_by": how},
        )
