"""DD304 identical-rng-streams: the random streams that augmentation and dropout draw from are the same on every
rank.

What it does: compares, across ranks, digests of the generator states recorded at the same points — before each
of the first training forwards through DDP (torch's CPU generator and the device generator), at each training
DataLoader iteration (torch, numpy and `random` global states of the main process, and the base seed of the
loader's workers) — and reports identical streams only where something draws from them: a forward that advanced
the generator (dropout and other stochastic layers), or a dataset whose `__getitem__` advanced a global generator
or returns different items under different seeds (random augmentation) — in the main process with
num_workers=0, in the workers otherwise.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd304_identical_rng_streams import CODE


def _identical_streams(evidence: dict) -> float | None:
    """Dropout (one) plus each data-pipeline stream measured identical across ranks: the finding's magnitude."""
    if "dropout" not in evidence and "data_pipeline" not in evidence:
        return None
    return float((1 if evidence.get("dropout") else 0) + len(evidence.get("data_pipeline") or ()))


# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the random streams measured identical across ranks (dropout, each data-pipeline stream)",
    measure=_identical_streams)


def _key(site: dict[str, Any] | None) -> tuple[str, int]:
    return (site or {}).get("file", "?"), (site or {}).get("line", 0)


def _same(values: list[Any]) -> bool:
    return len(values) >= 2 and all(v is not None and v == values[0] for v in values)


def _dropout(ctx: RunContext) -> dict[str, Any] | None:
    """Forwards that drew from a generator whose state was the same on every rank."""
    per_rank = {r: {e.get("n"): e for e in p.of("rng_forward")} for r, p in ctx.ranks.items()}
    per_rank = {r: evs for r, evs in per_rank.items() if evs}
    if len(per_rank) < 2:
        return None
    common = sorted(set.intersection(*(set(evs) for evs in per_rank.values())))
    drawing = identical = 0
    generators: set[str] = set()
    example = None
    for n in common:
        evs = [per_rank[r][n] for r in per_rank]
        for gen in ("torch", "device"):
            if not any((e.get("advanced") or {}).get(gen) for e in evs):
                continue
            drawing += 1
            digests = [((e.get("generators") or {}).get(gen) or {}).get("digest") for e in evs]
            if _same(digests):
                identical += 1
                generators.add(gen)
                if example is None:
                    example = {"forward": n, "generator": gen,
                               "next_draws": ((evs[0].get("generators") or {}).get(gen) or {}).get("next")}
    if not identical:
        return None
    first = next(iter(per_rank.values()))
    ddp_site = None
    for _, e in ctx.run.events("ddp_init"):
        ddp_site = e.get("site")
        break
    return {
        "forwards_compared": len(common),
        "drawing_forwards": drawing,
        "identical_drawing_forwards": identical,
        "generators": sorted(generators),
        "example": example,
        "ranks": sorted(per_rank),
        "site": ddp_site,
        "steps": sorted({e.get("step") for e in first.values()}),
    }


def _dataset_draws(ctx: RunContext) -> dict[tuple[str, int], dict[str, Any]]:
    """loop site -> what the dataset's __getitem__ draws from (union over ranks)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for p in ctx.ranks.values():
        for e in p.of("dataset_items"):
            name = e.get("dataset_cls")
            if e.get("base_cls") and e.get("base_cls") != name:
                name = f"{e.get('base_cls')} (in a {name})"
            d = out.setdefault(_key(e.get("site")), {"draws_from": set(), "seed_dependent": False, "dataset_cls": name})
            d["draws_from"] |= set(e.get("draws_from") or [])
            d["seed_dependent"] = d["seed_dependent"] or bool(e.get("seed_dependent"))
    return out


def _pipeline(ctx: RunContext) -> list[dict[str, Any]]:
    """Training loader iterations whose random streams (main process or workers) are the same on every rank."""
    draws = _dataset_draws(ctx)
    per_rank: dict[int, dict[tuple, dict[str, Any]]] = {}
    for r, p in ctx.ranks.items():
        seen: dict[tuple[str, int], int] = {}
        for e in p.of("rng_loader"):
            k = _key(e.get("site"))
            per_rank.setdefault(r, {})[(k, seen.get(k, 0))] = e
            seen[k] = seen.get(k, 0) + 1
    if len(per_rank) < 2:
        return []
    out = []
    common = set.intersection(*(set(v) for v in per_rank.values()))
    reported: set[tuple[str, int]] = set()
    for key in sorted(common):
        site_key, _ = key
        if site_key in reported:
            continue
        evs = [per_rank[r][key] for r in per_rank]
        dataset = draws.get(site_key)
        if dataset is None or not (dataset["draws_from"] or dataset["seed_dependent"]):
            continue  # the dataset draws nothing: equal streams change nothing
        workers = evs[0].get("num_workers") or 0
        if workers > 0:
            seeds = [e.get("worker_base_seed") for e in evs]
            if not _same(seeds):
                continue
            out.append({
                "where": "workers",
                "site": evs[0].get("site"),
                "num_workers": workers,
                "worker_base_seed": seeds[0],
                "worker_init_fn": evs[0].get("worker_init_fn"),
                "dataset_cls": dataset["dataset_cls"],
                "draws_from": sorted(dataset["draws_from"]) or ["(seed-dependent items)"],
            })
            reported.add(site_key)
            continue
        same = [
            g for g in sorted(dataset["draws_from"] or {"torch", "numpy", "random"})
            if g in ("torch", "numpy", "random")
            and _same([((e.get("generators") or {}).get(g) or {}).get("digest") for e in evs])
        ]
        if not same:
            continue
        out.append({
            "where": "main process",
            "site": evs[0].get("site"),
            "num_workers": 0,
            "generators": same,
            "next_draws": {g: ((evs[0].get("generators") or {}).get(g) or {}).get("next") for g in same},
            "dataset_cls": dataset["dataset_cls"],
            "draws_from": sorted(dataset["draws_from"]) or ["(seed-dependent items)"],
        })
        reported.add(site_key)
    return out


def _seed_calls(ctx: RunContext) -> list[dict[str, Any]]:
    """The script's seeding calls that used the same seed on every rank, in call order."""
    per_rank = {r: [e for e in p.of("rng_seed")] for r, p in ctx.ranks.items()}
    if len(per_rank) < 2:
        return []
    ref = next(iter(per_rank.values()))
    out = []
    for i, e in enumerate(ref):
        others = [evs[i] if i < len(evs) else None for evs in per_rank.values()]
        if all(o is not None and o.get("seed") == e.get("seed") and _key(o.get("site")) == _key(e.get("site"))
               for o in others) and e.get("seed") is not None:
            out.append({"generator": e.get("generator"), "seed": e.get("seed"), "site": e.get("site")})
    return out


def analyze(ctx: RunContext) -> list[Finding]:
    if len(ctx.ranks) < 2:
        return []
    dropout = _dropout(ctx)
    pipeline = _pipeline(ctx)
    if dropout is None and not pipeline:
        return []
    seeds = _seed_calls(ctx)
    parts = []
    if dropout is not None:
        ex = dropout["example"] or {}
        draws = ", ".join(f"{v:.4f}" for v in (ex.get("next_draws") or [])[:3])
        parts.append(
            "the training forward (dropout or another random layer) draws from the "
            f"{'device' if ex.get('generator') == 'device' else 'torch'} generator, which was in the same state on "
            f"every rank before {dropout['identical_drawing_forwards']} of {dropout['drawing_forwards']} drawing "
            "forwards" + (f" (next draws {draws} on every rank)" if draws else "")
        )
    for pl in pipeline:
        if pl["where"] == "workers":
            parts.append(
                f"{pl['dataset_cls']} augments randomly in {pl['num_workers']} DataLoader workers per rank, and every "
                f"rank's loader drew the same worker base seed at {ctx.at(pl['site'])}, so worker k produces the same "
                "random stream on every rank"
            )
        else:
            parts.append(
                f"{pl['dataset_cls']} augments randomly in the main process (num_workers=0) and the "
                f"{'/'.join(pl['generators'])} generator{'s were' if len(pl['generators']) > 1 else ' was'} in the "
                f"same state on every rank at the loop at {ctx.at(pl['site'])}"
            )
    seed_text = ""
    involved = set(dropout["generators"] if dropout else [])
    for pl in pipeline:
        involved |= set(pl.get("generators") or ["torch"])  # worker base seeds come from torch's generator
    involved = {"torch" if g == "device" else g for g in involved}
    seeds = [s for s in seeds if s["generator"] in involved] + [s for s in seeds if s["generator"] not in involved]
    if seeds:
        s0 = seeds[0]
        seed_text = f" — {s0['generator']} seeded with {s0['seed']} on every rank at {ctx.at(s0['site'])}"
    consumers = " and ".join(
        w for w, on in (("dropout masks", dropout is not None), ("augmentations", bool(pipeline))) if on
    )
    message = (
        f"random streams are identical on {fmt_ranks(ctx.ranks)}: " + "; ".join(parts) + seed_text
        + f", so every rank draws the same {consumers} at the same positions of its batch and their diversity "
        f"across the global batch shrinks {len(ctx.ranks)}×"
    )
    confidence = Confidence.CERTAIN
    if pipeline and dropout is None and all(pl.get("worker_init_fn") for pl in pipeline):
        confidence = Confidence.POSSIBLE  # worker_init_fn may reseed per rank inside the workers
    site = seeds[0]["site"] if seeds else (pipeline[0]["site"] if pipeline else dropout["site"] if dropout else None)
    return [
        ctx.finding(
            CODE,
            message=message,
            confidence=confidence,
            site=site,
            ranks=list(ctx.ranks),
            evidence={
                "dropout": dropout,
                "data_pipeline": pipeline or None,
                "same_seed_calls": seeds or None,
                "method": "digests of generator states compared across ranks at the same forward / loader "
                "iteration; the draws shown come from copies of the states (the run's streams were not consumed)",
            },
            magnitude=float((1 if dropout else 0) + len(pipeline)),
        )
    ]


# what DD302 reads to recognise repeated augmentation (each rank augments its copy of a sample differently)
loop_key = _key
dataset_draws = _dataset_draws
identical_pipelines = _pipeline
