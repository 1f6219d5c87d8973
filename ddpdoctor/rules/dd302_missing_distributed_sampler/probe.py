"""DD302 missing-distributed-sampler: ranks iterate overlapping samples.

What it does: for each training DataLoader (one during whose iteration optimizer steps ran), builds the set of
dataset indices each rank visits in an epoch — the DistributedSampler's recorded order, the whole dataset for a
RandomSampler/SequentialSampler under torch's own BatchSampler (that is what they visit), otherwise (a batch
sampler of a framework's, such as Accelerate's BatchSamplerShard; a custom sampler) the indices the loader drew —
and measures the fraction of each rank's samples that another rank also visits. Indices are those of the dataset
under any `Subset` wrappers (the probe maps them), so shards made by hand (`Subset(ds, range(rank, N, world))`)
compare as the samples they hold. It also compares the batches the ranks drew:
identical batches mean the ranks shuffle with the same seed and the global batch repeats every sample.

A DistributedSampler over Subsets that differ from rank to rank (a `random_split` without a seeded generator) shards
positions of different splits: its shards overlap by chance in the samples underneath. The sampler is not what is
missing there, so the finding names the differing splits and its fix is a seeded split (DD305 reports the same
cause from the dataset's items; DD302 is kept because it measures what it costs: the overlap).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_ranks, pct
from ddpdoctor.analyses.orders import consistent, order, position_identity, shared_fraction, subsets_differ
from ddpdoctor.findings import Finding, Measures, Severity
from ddpdoctor.rules.dd302_missing_distributed_sampler import CODE, HIGH_OVERLAP, THRESHOLD

MEASURES = Measures(
    scope="site",
    what="the samples each rank drew from every training DataLoader, and how much of them other ranks drew too",
)
# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the share of a rank's samples measured also seen by another rank",
    measure=key("overlap_fraction"))


def _training_iterations(p) -> list[tuple[dict[str, Any], dict[str, Any]]]:  # noqa: ANN001
    starts = {e["it"]: e for e in p.of("loader_iter")}
    out = []
    for end in p.of("loader_iter_end"):
        if end.get("training") and end.get("it") in starts:
            out.append((starts[end["it"]], end))
    return out


def _shuffle_streams(ctx: RunContext, per_rank: dict[int, tuple[dict[str, Any], dict[str, Any]]]) -> dict[int, tuple]:
    """Rank -> (seed, epoch) its shuffling DistributedSampler drew the first training iteration with: the
    permutation is torch.randperm under manual_seed(seed + epoch), so ranks that differ in either do not
    permute alike, and their rank::world slices of different permutations overlap."""
    out: dict[int, tuple] = {}
    for r, (start, _) in per_rank.items():
        sid, after = start.get("sampler"), start.get("seq", 0)
        it = next((e for e in ctx.ranks[r].of("sampler_iter")
                   if e.get("sampler") == sid and e.get("seq", 0) >= after), None)
        if it is None or not it.get("shuffle") or it.get("seed") is None:
            return {}
        out[r] = (it.get("seed"), it.get("epoch"))
    return out


def _key(start: dict[str, Any]) -> tuple:
    site = start.get("created_site") or start.get("site") or {}
    return site.get("file"), site.get("line")


def analyze(ctx: RunContext) -> list[Finding]:
    if len(ctx.ranks) < 2:
        return []
    # (loader creation site, its dataset class) -> rank -> (first training iteration start, end): a helper that
    # builds every loader at one line gives loaders of different datasets at one line; a loader re-created every
    # epoch keeps its dataset (not its length: shards made by hand differ in length from rank to rank)
    groups: dict[tuple, dict[int, tuple[dict[str, Any], dict[str, Any]]]] = {}
    for r, p in ctx.ranks.items():
        for start, end in _training_iterations(p):
            key = (*_key(start), start.get("dataset_cls"))
            groups.setdefault(key, {}).setdefault(r, (start, end))
    findings = []
    for per_rank in groups.values():
        if len(per_rank) < 2:
            continue
        sets: dict[int, np.ndarray] = {}
        how: dict[int, str] = {}
        padding_share: dict[str, float] = {}
        k = None
        for r, (start, end) in per_rank.items():
            p = ctx.ranks[r]
            kind = start.get("sampler_kind")
            created = next((e for e in p.of("sampler_created") if e.get("sampler") == start.get("sampler")), {})
            if kind == "distributed":
                it = next((e for e in p.of("sampler_iter") if e.get("sampler") == start.get("sampler")
                           and e["t"] >= start["t"]), None)
                arr = order(ctx, it.get("order")) if it else None
                if arr is not None:
                    sets[r] = arr
                    how[r] = f"DistributedSampler(num_replicas={it.get('num_replicas')}, rank={it.get('sampler_rank')})"
                    k = k or it.get("sample_mod")
                    count, n, replicas = it.get("count") or 0, it.get("dataset_len") or 0, it.get("num_replicas") or 1
                    if count and n:
                        padded = max(0, count * replicas - n)
                        padding_share["max"] = max(padding_share.get("max", 0.0), padded / count)
                    continue
            n = start.get("dataset_len")
            if start.get("batch_sampler_cls") not in (None, "BatchSampler") and start.get("sampler_cls") in (
                    "SequentialSampler", "RandomSampler"):
                # a run recorded before the index source was the batch sampler: DataLoader's default sampler is
                # unused there, the custom batch sampler decides — read what the loader drew
                kind = "other"
            # a batch sampler of its own (Accelerate's BatchSamplerShard keeps every world_size-th batch of the
            # sampler's order) decides what the loader draws: then the indices drawn tell, not the sampler
            own_batches = start.get("batch_sampler_cls") in (None, "BatchSampler")
            full_pass = own_batches and (kind == "sequential" or (
                kind == "random" and not created.get("replacement") and created.get("num_samples") in (None, n)
            ))
            if full_pass and isinstance(n, int):
                loader = next((e for e in p.of("loader_created") if e.get("loader") == start.get("loader")), {})
                subset = loader.get("subset") or {}
                arr = order(ctx, subset.get("indices"))
                if arr is not None:  # a Subset (a shard made by hand): the samples under it, not its positions
                    sets[r] = arr
                    how[r] = (f"{start.get('sampler_cls')} over all {n} samples of a Subset of a "
                              f"{subset.get('base_len')}-sample dataset")
                    k = k or subset.get("sample_mod")
                    continue
                sets[r], how[r] = np.arange(n, dtype=np.int64), f"{start.get('sampler_cls')} over all {n} samples"
                continue
            arr = order(ctx, end.get("indices"))
            if arr is not None:
                sets[r], how[r] = arr, f"{start.get('sampler_cls')} (indices drawn by the loader)"
        if len(sets) < 2:
            continue
        sets = {r: consistent(a, k) for r, a in sets.items()}
        shared = {r: shared_fraction(a, [b for s, b in sets.items() if s != r]) for r, a in sets.items()}
        overlap = float(np.mean(list(shared.values())))
        start0 = next(iter(per_rank.values()))[0]
        site = start0.get("created_site") or start0.get("site")
        sizes = {r: int(len(np.unique(a))) for r, a in sets.items()}
        padding = padding_share.get("max", 0.0)
        if overlap < max(THRESHOLD, padding + 0.01):
            if overlap <= padding + 0.01:  # measured disjoint (a DistributedSampler's padding repeats a few by design)
                ctx.clear(
                    CODE,
                    site=site,
                    reason=(
                        f"the training DataLoader's shards on {fmt_ranks(sets)} measured disjoint: "
                        f"{pct(overlap)} of a rank's samples also seen by another rank ("
                        + ", ".join(f"rank {r}: {n}" for r, n in sizes.items()) + " distinct samples)"
                    ),
                    evidence={"overlap_fraction": overlap, "distinct_samples": {str(r): v for r, v in sizes.items()},
                              "index_source": {str(r): v for r, v in how.items()}},
                )
            continue
        repeated = _repeated_augmentation(ctx, per_rank, sets, how)
        if repeated is not None:
            ctx.clear(CODE, site=site, reason=repeated["reason"], evidence=repeated)
            continue
        drawn = {r: order(ctx, end.get("indices")) for r, (_, end) in per_rank.items()}
        drawn = {r: a for r, a in drawn.items() if a is not None and len(a)}
        identical = None
        if len(drawn) >= 2:
            ref = next(iter(drawn.values()))
            identical = min(position_identity(ref, a) for a in drawn.values())
        kinds = sorted({start.get("sampler_cls") for start, _ in per_rank.values()})
        nranks = len(sets)
        distributed = all(start.get("sampler_kind") == "distributed" for start, _ in per_rank.values())
        split_differs = distributed and subsets_differ(
            ctx, {r: start.get("loader") for r, (start, _) in per_rank.items() if start.get("loader") is not None}
        ) is True
        if split_differs:
            lead = (
                f"the training DataLoader at {ctx.at(site)} has a DistributedSampler, but {fmt_ranks(sets)} hold "
                f"different splits of the dataset (their Subset index lists differ: a random_split without a seeded "
                f"generator), so the sampler shards positions of different subsets: {pct(overlap)} of the samples "
                f"a rank sees are also seen by another rank "
                f"({', '.join(f'rank {r}: {n}' for r, n in sizes.items())} distinct samples)"
            )
        streams = _shuffle_streams(ctx, per_rank) if distributed and not split_differs else {}
        seeds_differ = len({seed for seed, _ in streams.values()}) > 1
        epochs_differ = len({epoch for _, epoch in streams.values()}) > 1
        if split_differs:
            pass  # the differing splits explain the overlap: the lead above
        elif seeds_differ or epochs_differ:
            what = "seed" if seeds_differ else "epoch"
            lead = (
                f"the DistributedSampler of the training DataLoader at {ctx.at(site)} shuffles with a different "
                f"{what} on each rank ("
                + ", ".join(f"rank {r}: seed {sd}, epoch {ep}" for r, (sd, ep) in sorted(streams.items()))
                + "), so the ranks permute the dataset differently and the slices they take of their own "
                f"permutations overlap: {pct(overlap)} of the samples a rank sees are also seen by another rank"
            )
        elif distributed:
            lead = (
                f"the DistributedSampler of the training DataLoader at {ctx.at(site)} gives {fmt_ranks(sets)} "
                f"overlapping shards: {pct(overlap)} of the samples a rank sees are also seen by another rank"
            )
        else:
            lead = (
                f"the training DataLoader at {ctx.at(site)} has no DistributedSampler "
                f"({', '.join(k_ for k_ in kinds if k_)}): "
                f"{pct(overlap)} of the samples each rank sees per epoch are also seen by another rank "
                f"({', '.join(f'rank {r}: {n}' for r, n in sizes.items())} distinct samples), so the {nranks} ranks "
                f"repeat each other's work"
            )
        if identical is not None and identical >= 0.99:
            lead += (
                "; the batches drawn were identical on every rank (same shuffle seed), so each global batch holds "
                f"every sample {nranks}×"
            )
        # severity from the overlap measured: a minority of repeated samples (a partial sharding bug) costs less
        # than ranks that repeat most of each other's work
        severity = None
        if overlap < HIGH_OVERLAP and not (identical is not None and identical >= 0.99):
            severity = Severity.MEDIUM
            lead += f" (medium: below {pct(HIGH_OVERLAP)} shared)"
        findings.append(
            ctx.finding(
                CODE,
                message=lead,
                **({"severity": severity} if severity is not None else {}),
                fix_variant="split" if split_differs else "seed" if streams and (seeds_differ or epochs_differ)
                else "probe",
                site=site,
                ranks=list(sets),
                evidence={
                    "overlap_fraction": overlap,
                    "per_rank_shared_fraction": {str(r): v for r, v in shared.items()},
                    "distinct_samples": {str(r): v for r, v in sizes.items()},
                    "index_source": {str(r): v for r, v in how.items()},
                    "identical_batches_fraction": identical,
                    "consistent_sample_mod": k,
                    "splits_differ_across_ranks": split_differs,
                    **({"shuffle_seed_epoch": {str(r): list(v) for r, v in sorted(streams.items())}}
                       if seeds_differ or epochs_differ else {}),
                },
                magnitude=overlap,
            )
        )
    if not findings:
        findings.extend(_identical_inputs(ctx))
    return findings


def _identical_inputs(ctx: RunContext) -> list[Finding]:
    """Identical batches however they are produced (a loader, indices drawn in the loop from a generator seeded
    alike on every rank): the digests of the first training forwards' inputs (DDP or FSDP2 `fully_shard`,
    `ddp_input_digest`) equal on every rank at each forward, while they change from forward to forward (a fixed
    synthetic batch reused every step is a benchmark, not a data pipeline: no finding)."""
    per_rank: dict[int, dict[int, str]] = {}
    for r, p in ctx.ranks.items():
        seen: dict[int, str] = {}
        for e in p.of("ddp_input_digest"):
            if int(e.get("ddp") or 0) == int(next(iter(p.of("ddp_input_digest")), {}).get("ddp") or 0):
                seen.setdefault(int(e.get("n") or 0), str(e.get("digest")))
        per_rank[r] = seen
    if len(per_rank) < 2:
        return []
    common = sorted(set.intersection(*(set(d) for d in per_rank.values())))
    if len(common) < 2:
        return []
    same = [n for n in common if len({d[n] for d in per_rank.values()}) == 1]
    ref = next(iter(per_rank.values()))
    if len(same) != len(common) or len({ref[n] for n in common}) < 2:
        return []
    start = next((e for _, e in ctx.run.events("sharded_init")), None) or next(
        (e for _, e in ctx.run.events("ddp_init")), None) or {}
    wrapper = next((e.get("wrapper") for _, e in ctx.run.events("ddp_input_digest") if e.get("wrapper")), "DDP")
    nranks = len(per_rank)
    data = _data_source(ctx, common)
    message = (
        f"the first {len(common)} training batches were identical on {fmt_ranks(per_rank)}: the inputs of the "
        f"{wrapper} model's training forwards have equal digests on every rank at each forward, and differ from "
        f"forward to forward — "
    )
    if data["synthetic"]:
        # Identical gradients on every rank: the world trains on one rank's data. With no dataset (every sample
        # generated fresh in the loop) that is a synthetic benchmark by design, where it changes nothing measured.
        message += (
            f"the samples were generated in the training loop from a generator seeded alike on every rank (no "
            f"DataLoader or Dataset was read, and none of the {data['samples_compared']} samples compared recurred "
            f"in another forward): synthetic data, as a benchmark draws it, where identical batches change nothing "
            f"it measures; if this run trains a model, the {nranks} ranks compute one rank's gradient and each "
            "rank should seed its generator with its rank"
        )
    else:
        message += (
            f"the ranks draw the same samples (a generator seeded alike on every rank), so each global batch holds "
            f"every sample {nranks}× and the {nranks} ranks repeat each other's work"
        )
    return [ctx.finding(
        CODE, message=message, fix_variant="probe", site=start.get("site"), ranks=list(per_rank),
        severity=Severity.LOW if data["synthetic"] else None,
        evidence={"overlap_fraction": 1.0, "identical_batches_fraction": 1.0, "compared_forwards": len(common),
                  "index_source": "digests of the inputs of the model's training forwards", **data},
        magnitude=1.0,
    )]


def _data_source(ctx: RunContext, forwards: list[int]) -> dict[str, Any]:
    """Whether the identical batches came from data or were generated fresh (issue 20: a synthetic benchmark drawing
    torch.randn each step with one seed on every rank): measured, not named — no DataLoader iterated and no Dataset
    read on any rank, and no sample (row of the digested input) recurring in another forward, where a finite
    dataset drawn from repeats its samples. A run whose rows were not recorded counts as data."""
    loaders = any(p.of("loader_iter") or p.of("dataset_items") for p in ctx.ranks.values())
    p0 = ctx.ranks[min(ctx.ranks)]
    rows: dict[int, list[str]] = {}
    for e in p0.of("ddp_input_digest"):
        n = int(e.get("n") or 0)
        if n in forwards and isinstance(e.get("rows"), list):
            rows.setdefault(n, [str(x) for x in e["rows"]])
    seen: dict[str, int] = {}
    recurring = 0
    for n, digests in sorted(rows.items()):
        for d in set(digests):
            if d in seen and seen[d] != n:
                recurring += 1
            seen.setdefault(d, n)
    compared = sum(len(v) for v in rows.values())
    synthetic = not loaders and len(rows) >= 2 and compared > 0 and recurring == 0
    return {"data_pipeline": loaders, "samples_compared": compared, "samples_recurring": recurring,
            "synthetic": synthetic}


def _repeated_augmentation(ctx: RunContext, per_rank: dict[int, tuple[dict[str, Any], dict[str, Any]]],
                           sets: dict[int, np.ndarray], how: dict[int, str]) -> dict[str, Any] | None:
    """Repeated augmentation (RASampler-style: each sample shown to k ranks in an epoch, each rank augmenting it
    differently) recognised by what the run measured, never by the sampler's name: the overlap is read from the
    indices the loader drew (a sampler of the script's own); each rank's epoch is its share of one pass over the
    dataset (len of the sampler × ranks ≈ the dataset: it shards by design); the dataset draws random numbers (it
    augments); and the ranks' random streams at that loop differ (DD304's measurement). Any of these missing, the
    overlap is repeated work (DD302 stands). Returns the measurement, or None."""
    from ddpdoctor.rules.dd304_identical_rng_streams.probe import dataset_draws, identical_pipelines, loop_key

    starts = [start for start, _ in per_rank.values()]
    if any(start.get("sampler_kind") == "distributed" for start in starts):
        return None
    if not all("indices drawn by the loader" in h for h in how.values()):
        return None
    world = len(per_rank)
    n = starts[0].get("dataset_len")
    lens = [start.get("sampler_len") for start in starts]
    if not isinstance(n, int) or n <= 0 or any(not isinstance(x, int) for x in lens):
        return None
    if any(start.get("sampler_yields") == "batches" for start in starts):
        lens = [x * int(start.get("batch_size") or 1) if start.get("batch_size") else x
                for x, start in zip(lens, starts)]
    if sum(lens) > 1.1 * n:
        return None  # every rank's epoch is (nearly) the whole dataset: not a share of one pass
    loop = loop_key(starts[0].get("site"))
    draws = dataset_draws(ctx).get(loop)
    if draws is None or not (draws["draws_from"] or draws["seed_dependent"]):
        return None  # no augmentation: the repeats are identical copies
    if any(loop_key(pl.get("site")) == loop for pl in identical_pipelines(ctx)):
        return None  # the same random stream on every rank: the same augmentation repeated
    drawn = np.concatenate([a for a in sets.values()])
    _, counts = np.unique(drawn, return_counts=True)
    k = int(np.median(counts)) if len(counts) else 0
    if k < 2:
        return None
    return {
        "repeats": k,
        "sampler_len": {str(r): x for r, x in zip(per_rank, lens)},
        "dataset_len": n,
        "augments_with": sorted(draws["draws_from"]) or ["(seed-dependent items)"],
        "reason": (
            f"repeated augmentation by design, measured: the ranks' samplers share one pass over the {n}-sample "
            f"dataset ({' + '.join(str(x) for x in lens)} per epoch) and show each drawn sample about {k}× across "
            f"the {world} ranks, and {draws['dataset_cls']} augments it with a random stream that differs from rank "
            "to rank (so each copy is a different view, not repeated work)"
        ),
    }
