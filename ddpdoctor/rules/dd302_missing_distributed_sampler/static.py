"""DD302 missing-distributed-sampler: a training DataLoader without DistributedSampler in a DDP script.

What it flags: a DataLoader that feeds training (a backward pass or optimizer step happens in the loop that
iterates it) in a distributed script, with no sampler, or with a single-process sampler (RandomSampler,
SequentialSampler…), over a dataset that is not split by rank. Every rank then iterates the whole dataset: the
"global batch" holds each sample world_size times and an epoch is world_size times shorter than it looks.

What stays silent: DistributedSampler or any custom/unknown sampler or batch_sampler; iterable datasets;
datasets built with the rank or world size (`Subset(ds, range(rank, n, world))`, a Dataset class of the file
that reads the rank); evaluation loaders (no training in their loop); a loader built only on a path that sets up
no distribution (`if args.nodes > 1: mp.spawn(main, ...) else: main(0, args)`: main's direct call is a
single-process run).

Confidence: likely when the loader shuffles or the dataset is a known map-style dataset; possible (at medium
severity) when the dataset comes from elsewhere and may shard itself.
"""

from __future__ import annotations

import ast
from typing import Iterator

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.rules.dd302_missing_distributed_sampler import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import PER_RANK_TAGS, WORLD_TAGS, Obj, constant_values, is_constant

_RANK_WORDS = ("rank", "world_size", "num_replicas", "shard", "split_dataset_by_node", "get_world_size")


def _dataset_is_sharded(ds: Obj) -> bool:
    if ds.tags & (PER_RANK_TAGS | WORLD_TAGS | {"rank_dep"}):
        return True
    args = ds.props.get("ctor_args") or ds.props.get("call_args")
    if args is not None and any(o.tags & (PER_RANK_TAGS | WORLD_TAGS | {"rank_dep"}) for o in args.all()):
        return True
    cls = ds.props.get("class")
    if cls is not None:
        text = ast.unparse(cls.props["node"]).lower()
        if any(w in text for w in _RANK_WORDS):
            return True
    return False


def _bound_name(datasets) -> str | None:  # noqa: ANN001 - the loader's dataset objects
    """The variable the loader's dataset is bound to, when it is one (the fix is then written with it)."""
    names = {d.props.get("bound_name") for d in datasets}
    return next(iter(names)) if len(names) == 1 and None not in names else None


def check(script: ScriptModel) -> Iterator[Finding]:
    if not script.distributed:
        return
    for lev in script.of("loader"):
        loader = lev.data["obj"]
        if loader.fields.get("batch_sampler") or script.single_process_path(lev):
            continue
        samplers = [s for s in loader.fields.get("sampler", ()) if not (s.kind == "const" and s.value is None)]
        if samplers and not all(
            s.kind == "sampler" and not s.props.get("distributed") and not s.props.get("custom") for s in samplers
        ):
            continue  # a DistributedSampler (maybe only on the distributed path), or one we cannot see into
        datasets = loader.fields.get("dataset", ())
        if any(d.kind == "iterable_dataset" for d in datasets) or any(_dataset_is_sharded(d) for d in datasets):
            continue
        its = script.of("iterate", loaders=(loader,))
        training = [it for it in its if script.iteration_trains(it) and not it.rank_ctx]
        if not training:
            continue
        it = training[0]
        shuffle = loader.props.get("shuffle")
        shuffles = bool(shuffle) and is_constant(shuffle) and any(constant_values(shuffle))
        known = any(d.kind == "dataset" for d in datasets)
        severity = None
        if shuffles or known:
            confidence = Confidence.LIKELY
        else:
            confidence, severity = Confidence.POSSIBLE, Severity.MEDIUM
        name = script.name(loader)
        how = "shuffle=True and no DistributedSampler" if shuffles else (
            f"the single-process {samplers[0].label}" if samplers else "no DistributedSampler"
        )
        yield script.finding(
            CODE,
            line=loader,
            message=f"DataLoader `{name}` (line {loader.line}) feeds the training loop of {script.place(it, loader)} "
            f"with {how}, so every rank iterates the whole dataset and the ranks train on the same samples",
            confidence=cap_unreached(confidence, lev, it),
            evidence={"loader_line": loader.line, "loop_line": it.line, "shuffle": shuffles,
                      "dataset": script.names(datasets) or None, "loader": name,
                      "dataset_name": _bound_name(datasets)},
            severity=severity,
        )
