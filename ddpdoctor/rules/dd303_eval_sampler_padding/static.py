"""DD303 eval-sampler-padding: a DistributedSampler splits evaluation data and pads it with duplicates.

What it flags (low): a `DistributedSampler` without `drop_last=True` whose loader is iterated only for
evaluation (no backward pass or optimizer step in that loop). When len(dataset) is not a multiple of the world
size, the sampler repeats samples to even out the shards, so a metric gathered from all ranks counts them twice.

What stays silent: training samplers; `drop_last=True`; custom samplers (e.g. an unpadded "ordered distributed"
sampler); evaluation on rank 0 over the whole set.

Confidence: possible — the padding happens only for some dataset lengths and world sizes.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd303_eval_sampler_padding import CODE
from ddpdoctor.static.model import ScriptModel
from ddpdoctor.static.semantic import constant_values


def check(script: ScriptModel) -> Iterator[Finding]:
    loaders = [ev.data["obj"] for ev in script.of("loader")]
    for sev in script.of("sampler"):
        sampler = sev.data["obj"]
        if not sampler.props.get("distributed") or sampler.props.get("custom"):
            continue
        if True in constant_values(sampler.props.get("drop_last") or ()):
            continue
        its = [it for it in script.of("iterate", loaders=script.loaders_of(sampler)) if it.data.get("loop") is not None]
        if (
            not its
            or any(script.iteration_trains(it) for it in its)
            or not any(script.loop_evaluates(it.data["loop"]) for it in its)
        ):
            continue
        evaluating = next(it for it in its if script.loop_evaluates(it.data["loop"]))
        lengths = {d.props.get("length") for d in sampler.props.get("dataset", ()) if d.props.get("length")}
        length = lengths.pop() if len(lengths) == 1 else None
        name = script.sampler_name(sampler, loaders)
        yield script.finding(
            CODE,
            line=sampler,
            message=f"{name} (line {sampler.line}) splits evaluation data; unless len(dataset)"
            + (f" (= {length})" if length else "")
            + " is a multiple of the world size it pads the shards with repeated samples, which the metric counts "
            "twice",
            confidence=Confidence.POSSIBLE,
            evidence={"sampler_line": sampler.line, "eval_loop_line": evaluating.line,
                      "eval_loop": script.place(evaluating, sampler), "dataset_length": length},
        )
