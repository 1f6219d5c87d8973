"""DD904 nothing-observed, static half: the training loop runs in an engine static analysis does not follow.

What it flags: a script whose training loop is run by an engine that ddpdoctor's static models do not cover
(`deepspeed.initialize`, Lightning's strategy="deepspeed", ColossalAI: an `engine` event with modelled False), and
a script that hands its model to an unknown trainer (`trainer.fit(model)`, `trainer.train()` on an object of an
imported package) while nothing in it steps an optimizer or runs a backward pass that the walk can see. The
rules read the training loop: where it is out of sight, "no findings" would mean "not looked at", so the report
says "not analysed: <engine>" instead.

What stays silent: the frameworks apis/frameworks.py models (Lightning's Trainer with a DDP strategy, Accelerate,
the Hugging Face Trainer); a script whose optimizer steps or backward passes the walk sees (its own loop, even
beside an unknown helper).

Confidence: certain for an engine known not to be modelled; likely for an unknown trainer (its `fit` may be a
thin loop the walk could not enter). The probe settles it (MEASURES, scope run): a run with optimizer steps
measured the training, and the static note is dropped.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd904_nothing_observed import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached

# method names that hand the training loop to a trainer object
_LOOP_METHODS = frozenset({"fit", "train", "train_model", "fit_model", "run_training"})


def check(script: ScriptModel) -> Iterator[Finding]:
    engines = script.of("engine")
    for ev in engines:
        if ev.data["modelled"]:
            continue
        name = ev.data["name"]
        yield script.finding(
            CODE,
            line=ev,
            message=f"not analysed: {name}: the training loop runs inside it, and static analysis does not model "
            "it, so no rule could check the loop (`ddpdoctor check` without --static runs it and measures what "
            "the ranks do)",
            confidence=cap_unreached(Confidence.CERTAIN, ev),
            evidence={"engine": name, "call": ev.data["how"]},
            fix_variant="not_analysed",
        )
    if any(ev.data["modelled"] for ev in engines) or script.training_events:
        return
    for ev in script.of("call"):
        if ev.data.get("name") not in _LOOP_METHODS:
            continue
        engine = _imported_receiver(script, ev)
        if engine is None:
            continue
        yield script.finding(
            CODE,
            line=ev,
            message=f"not analysed: {engine}: `{script.text(ev.node)}` hands the training to a trainer static "
            "analysis does not model, and no optimizer step or backward pass is visible in the script, so no "
            "rule could check the training loop (`ddpdoctor check` without --static runs it and measures it)",
            confidence=cap_unreached(Confidence.LIKELY, ev),
            evidence={"engine": engine, "call": script.text(ev.node)},
            fix_variant="not_analysed",
        )
        return


def _imported_receiver(script: ScriptModel, ev) -> str | None:  # noqa: ANN001
    """The imported class a `.fit()`-like call's receiver was built from (`fancytrainer.Trainer`), when the call
    or that constructor is handed a model; None for the script's own objects and for calls that train no model
    (`LogisticRegression().fit(X, y)`)."""
    func = ev.data.get("func")
    if func is None or func.kind != "unknown":
        return None
    qual = func.props.get("qual")
    if not qual:
        return None
    given = list(ev.data["args"].all())
    built = func.props.get("call_args")
    if built is not None:
        given.extend(built.all())
    if not any(o.is_module for o in given):
        return None
    return qual
