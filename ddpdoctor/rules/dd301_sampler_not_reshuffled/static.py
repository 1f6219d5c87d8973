"""DD301 sampler-not-reshuffled: a shuffling DistributedSampler whose order repeats every epoch.

What it flags: a `DistributedSampler` (shuffle left at its default True) whose DataLoader is iterated again and
again inside a loop (epochs, a `while` over steps), when `set_epoch` is never called on that sampler, is called
with a constant, or is called once outside the loop that re-iterates the loader. The sampler seeds its
permutation with `seed + epoch`; without a new epoch every epoch visits the samples in the same order.

What stays silent: `sampler.set_epoch(epoch)` in the loop, also as `train_loader.sampler.set_epoch(epoch)` or
through a helper; `shuffle=False` samplers; custom samplers (a subclass that overrides `__iter__`, infinite or
repeat-augment samplers); loaders iterated once; loaders iterated only to evaluate (nothing steps the
optimizer in their loop: the order of evaluation batches does not change the result); a `set_epoch` on an object
the walk cannot resolve (it may be this sampler).

Confidence: certain when the file never calls set_epoch at all; likely otherwise.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd301_sampler_not_reshuffled import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import constant_values, is_constant


def check(script: ScriptModel) -> Iterator[Finding]:
    set_epochs = script.of("set_epoch")
    unresolved = [ev for ev in set_epochs if not any(t.kind == "sampler" for t in ev.data["target"])]
    if any(not is_constant(ev.data["arg"]) for ev in unresolved):
        return
    loaders = [ev.data["obj"] for ev in script.of("loader")]
    for sev in script.of("sampler"):
        sampler = sev.data["obj"]
        if not sampler.props.get("distributed") or sampler.props.get("overrides_iter"):
            continue
        shuffle = sampler.props.get("shuffle")
        if shuffle and is_constant(shuffle) and not any(constant_values(shuffle)):
            continue
        repeated = [
            it
            for it in script.of("iterate", loaders=script.loaders_of(sampler))
            if it.loops and script.iteration_trains(it)
        ]
        if not repeated:
            continue
        it = repeated[0]
        loop_nodes = {c.node for c in it.loops}
        on_this = [ev for ev in set_epochs if any(t is sampler for t in ev.data["target"])]
        in_loop = [ev for ev in on_this if {c.node for c in ev.loops} & loop_nodes]
        varying = [ev for ev in in_loop if not is_constant(ev.data["arg"])]
        if varying:
            continue
        name = script.sampler_name(sampler, loaders)
        loop_line = getattr(it.loops[-1].node, "lineno", it.line)
        if in_loop:
            ev = in_loop[0]
            why = (
                f"set_epoch is called with the constant `{script.text(ev.data['arg_node'])}` "
                f"at {script.place(ev, sampler)}"
            )
            confidence = Confidence.CERTAIN
        elif on_this:
            ev = on_this[0]
            why = (
                f"set_epoch runs once at {script.place(ev, sampler)}, outside the loop of "
                f"{script.place(it.loops[-1], sampler)} that re-iterates it"
            )
            confidence = Confidence.LIKELY
        else:
            why = "set_epoch is never called on it"
            confidence = Confidence.CERTAIN if not set_epochs else Confidence.LIKELY
        if shuffle and not is_constant(shuffle):
            confidence = Confidence.POSSIBLE
        yield script.finding(
            CODE,
            line=sampler,
            message=f"{name} (line {sampler.line}) shuffles, but {why}, so every epoch visits the "
            f"samples in the same order",
            confidence=cap_unreached(confidence, sev, it),
            evidence={
                "sampler_line": sampler.line,
                "loop_line": loop_line,
                "iterated_at": it.line,
                "set_epoch_lines": [ev.line for ev in on_this],
            },
        )
