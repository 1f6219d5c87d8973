"""Data analyses (DD303–DD306) replayed from recorded probe runs (fixtures/runs/data_*, recorded by
tests/test_probe_data.py from fixtures/probe/data/), plus cases a single-node probe cannot record, built as event
logs by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.analyses import analyze_run
from ddpdoctor.check import report_run
from ddpdoctor.events import SCHEMA
from ddpdoctor.findings import Confidence, Severity

RUNS = Path(__file__).resolve().parent.parent / "fixtures" / "runs"


def probe_findings(run: str | Path, rule: str) -> list:
    path = run if isinstance(run, Path) else RUNS / run
    return [f for f in analyze_run(path).findings if f.rule == rule]


def make_run(tmp_path: Path, per_rank: dict[int, list[dict[str, Any]]], **meta: Any) -> Path:
    """A run directory with one event log per rank (process_start and pg_init added)."""
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"schema": SCHEMA, "script": "train.py", "script_abs": "/w/train.py",
                                               "cwd": "/w", "nproc": len(per_rank), **meta}))
    for r, evs in per_rank.items():
        pid = 100 + r
        head = [{"kind": "process_start", "role": "rank"},
                {"kind": "pg_init", "ok": True, "rank": r, "world_size": len(per_rank)}]
        lines = [{"t": 1.0 + i, "pid": pid, "seq": i + 1, "rank": r, **e} for i, e in enumerate(head + evs)]
        (run / "events" / f"vm-p{pid}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return run


SITE = {"file": "/w/train.py", "line": 20, "function": "<module>"}


# ------------------------------------------------------------------------------------------------ DD303


def test_dd303_counts_the_padded_duplicate_over_both_ranks_orders() -> None:
    (f,) = probe_findings("data_seeded_augment", "DD303")
    assert f.evidence["dataset_len"] == 45 and f.evidence["num_samples_per_rank"] == 23
    assert f.evidence["duplicated"] == 1 and f.evidence["duplicated_indices"] == [0]
    assert f.evidence["measured_from_orders"] is True
    assert f.line == 37 and f.severity == Severity.LOW
    assert "1 sample is evaluated twice (index 0)" in f.message and "46 results for 45 samples" in f.message
    assert f.magnitude == pytest.approx(1 / 45)


def test_dd303_silent_on_an_evenly_split_evaluation_set_and_on_training_samplers() -> None:
    assert probe_findings("data_synthetic_unseeded", "DD303") == []  # 48 samples on 2 ranks
    assert probe_findings("data_uneven_shards", "DD303") == []


def test_dd303_merges_with_the_static_finding_as_certain() -> None:
    (f,) = [f for f in report_run(RUNS / "data_seeded_augment").findings if f.rule == "DD303"]
    assert f.sources == ("static", "probe") and f.confidence == Confidence.CERTAIN


def test_dd303_measured_without_padding_clears_the_static_finding() -> None:
    report = report_run(RUNS / "data_synthetic_unseeded")
    assert "DD303" not in {f.rule for f in report.findings}
    assert (
        "static DD303 at fixtures/probe/data/synthetic_unseeded.py:31 cleared by the probe: its 48 evaluation "
        "samples split evenly over 2 ranks (24 each), none padded (counted over the orders of all ranks)"
    ) in report.notes


def test_dd303_drop_last_counts_dropped_samples(tmp_path: Path) -> None:
    created = {"kind": "sampler_created", "sampler": 1, "sampler_kind": "distributed", "site": SITE, "len": 10,
               "num_replicas": 4, "num_samples": 2, "drop_last": True}
    ranks = {
        r: [created,
            {"kind": "loader_iter", "loader": 2, "it": 3, "sampler": 1, "sampler_kind": "distributed",
             "grad_enabled": False},
            {"kind": "loader_iter_end", "it": 3, "training": False, "steps": 0}]
        for r in range(4)
    }
    (f,) = probe_findings(make_run(tmp_path, ranks), "DD303")
    assert f.evidence["dropped"] == 2 and f.evidence["measured_from_orders"] is False
    assert "2 of its 10 samples are never evaluated" in f.message


# -------------------------------------------------------------------------------- DD301: samplers as objects


def test_dd301_training_sampler_of_a_helper_is_not_mixed_with_the_validation_one() -> None:
    """`get_ddp_loader(ds, shuffle)` builds the training (shuffle=True) and the validation (shuffle=False) sampler at
    one line; the validation loader's worker prefetches its order before the iteration's own event."""
    from ddpdoctor.rundata import read_run

    (f,) = probe_findings("data_sampler_helper", "DD301")
    assert f.line == 14 and f.ranks == (0, 1) and f.severity == Severity.HIGH
    assert "set_epoch was never called" in f.message and f.magnitude == 1.0
    for r in ("0", "1"):
        ev = f.evidence["per_rank"][r]
        assert ev["position_identity_epoch0_vs_1"] == 1.0 and ev["sampler_epoch_values"] == [0, 0]
        assert ev["samplers"] == 1
    p = read_run(RUNS / "data_sampler_helper").rank_processes[0]
    created = [e for e in p.of("sampler_created")]
    assert [e["site"]["line"] for e in created] == [14, 14] and [e["shuffle"] for e in created] == [True, False]
    val = created[1]["sampler"]
    first_val_order = next(e for e in p.of("sampler_iter") if e["sampler"] == val)
    first_val_iter = next(e for e in p.of("loader_iter") if e["sampler"] == val)
    assert first_val_order["seq"] < first_val_iter["seq"]  # prefetched while the iterator was built
    # the validation sampler is recognised as one: 48 samples split evenly, measured without padding
    assert probe_findings("data_sampler_helper", "DD303") == []
    (cleared,) = [c for c in analyze_run(RUNS / "data_sampler_helper").clearances if c.rule == "DD303"]
    assert cleared.line == 14 and "48 evaluation samples split evenly over 2 ranks (24 each)" in cleared.reason


def _sampler_events(sampler: int, loader: int, it: int, digest: str, *, shuffle: bool = True, training: bool = True,
                    line: int = 20, epoch: int = 0, created: bool = True) -> list[dict[str, Any]]:
    site = {**SITE, "line": line}
    evs: list[dict[str, Any]] = []
    if created:
        evs.append({"kind": "sampler_created", "sampler": sampler, "sampler_kind": "distributed", "site": site,
                    "shuffle": shuffle})
    evs += [
        {"kind": "loader_iter", "loader": loader, "it": it, "sampler": sampler, "site": SITE,
         "sampler_kind": "distributed", "grad_enabled": training},
        {"kind": "sampler_iter", "sampler": sampler, "iteration": 0, "epoch": epoch, "shuffle": shuffle,
         "digest": digest, "sample_mod": None},
        {"kind": "loader_iter_end", "loader": loader, "it": it, "training": training, "steps": 4 if training else 0},
    ]
    return evs


def test_dd301_a_sampler_re_created_every_epoch_with_the_same_seed(tmp_path: Path) -> None:
    ranks = {}
    for r in range(2):
        evs = []
        for epoch in range(2):
            evs += _sampler_events(10 + epoch, 20 + epoch, 30 + epoch, f"same{r}")  # a new sampler, one pass each
            evs += _sampler_events(40 + epoch, 50 + epoch, 60 + epoch, f"val{r}", shuffle=False, training=False)
        ranks[r] = evs
    (f,) = probe_findings(make_run(tmp_path, ranks), "DD301")
    assert "a new sampler is created every epoch" in f.message and f.evidence["per_rank"]["0"]["samplers"] == 2


def test_dd301_an_evaluation_pass_over_the_training_loader_is_not_an_epoch(tmp_path: Path) -> None:
    ranks = {}
    for r in range(2):
        evs = _sampler_events(1, 2, 3, f"e0-{r}")
        evs += _sampler_events(1, 2, 4, f"e0-{r}", training=False, created=False)  # train accuracy, same order
        evs += [{"kind": "set_epoch", "sampler": 1, "epoch": 1, "site": SITE}]
        evs += _sampler_events(1, 2, 5, f"e1-{r}", created=False, epoch=1)
        ranks[r] = evs
    run = make_run(tmp_path, ranks)
    assert probe_findings(run, "DD301") == []
    (cleared,) = [c for c in analyze_run(run).clearances if c.rule == "DD301"]
    assert cleared.line == 20
    assert cleared.reason == ("set_epoch was called with 1 and the order changed from epoch to epoch in the 2 "
                              "observed epochs on ranks 0, 1")


# -------------------------------------------------------------------------------- DD302 and Subset shards


@pytest.mark.parametrize("run", ["bn_noniid_small", "bn_rank0_eval_hang", "bn_uneven_hang", "data_uneven_shards"])
def test_dd302_silent_on_shards_made_by_hand_with_subset(run: str) -> None:
    """`Subset(ds, range(rank * n, (rank + 1) * n))` and `Subset(ds, range(rank, N, world))`: positions 0..n-1 of
    each rank's Subset are different samples. The probe records them as indices of the dataset underneath."""
    from ddpdoctor.analyses import build_context
    from ddpdoctor.analyses.orders import order, shared_fraction

    assert probe_findings(run, "DD302") == []
    (cleared,) = [c for c in analyze_run(RUNS / run).clearances if c.rule == "DD302"]  # measured, not skipped
    assert cleared.evidence["overlap_fraction"] == 0.0
    ctx = build_context(RUNS / run)
    shards = {}
    for r, p in ctx.ranks.items():
        (created,) = [e for e in p.of("loader_created") if e.get("subset")]
        assert created["subset"]["depth"] == 1
        shards[r] = order(ctx, created["subset"]["indices"])
        trained = [e for e in p.of("loader_iter_end") if e.get("training")]
        drawn = order(ctx, trained[0]["indices"])
        assert trained[0]["subset_depth"] == 1 and set(drawn.tolist()) <= set(shards[r].tolist())
    assert shared_fraction(shards[0], [shards[1]]) == 0.0
    if run == "data_uneven_shards":  # range(rank, 41, 2)
        assert sorted(shards[0].tolist()) == list(range(0, 41, 2))
        assert sorted(shards[1].tolist()) == list(range(1, 41, 2))


def test_dd301_and_dd302_measured_absent_clear_the_static_findings(tmp_path: Path) -> None:
    """A run whose training sampler reshuffles every epoch and whose ranks' shards are disjoint, recorded with
    static findings the linter could only guess at (likely / possible) and one it is certain of."""
    import zlib

    import numpy as np

    static_json = []
    for rule, line, confidence in (("DD301", 20, "likely"), ("DD302", 21, "possible"), ("DD301", 40, "certain")):
        static_json.append({"rule": rule, "severity": "high", "confidence": confidence, "source": "static",
                            "file": "train.py", "line": line, "message": f"{rule} guessed", "fix": "fix"})
    ranks, blobs = {}, {}
    for r in range(2):
        raw = b""
        refs = []
        for epoch in range(2):
            order = np.arange(r, 48, 2)[::(1 if epoch == 0 else -1)].astype(np.int64)
            data = zlib.compress(order.tobytes())
            refs.append({"file": f"vm-p{100 + r}.bin", "offset": len(raw), "nbytes": len(data), "codec": "zlib",
                         "dtype": "int64", "count": len(order)})
            raw += data
        blobs[r] = raw
        evs = [{"kind": "sampler_created", "sampler": 1, "sampler_kind": "distributed", "site": SITE, "shuffle": True}]
        for epoch in range(2):
            evs += [
                {"kind": "set_epoch", "sampler": 1, "epoch": epoch, "site": SITE},
                {"kind": "loader_iter", "loader": 2, "it": 3 + epoch, "sampler": 1, "sampler_kind": "distributed",
                 "site": SITE, "created_site": {**SITE, "line": 21}, "grad_enabled": True, "dataset_len": 48},
                {"kind": "sampler_iter", "sampler": 1, "iteration": epoch, "epoch": epoch, "shuffle": True,
                 "digest": f"d{r}{epoch}", "order": refs[epoch], "sample_mod": None, "count": 24, "dataset_len": 48,
                 "num_replicas": 2},
                {"kind": "loader_iter_end", "loader": 2, "it": 3 + epoch, "training": True, "steps": 4},
            ]
        ranks[r] = evs
    run = make_run(tmp_path, ranks)
    for r, raw in blobs.items():
        (run / "events" / f"vm-p{100 + r}.bin").write_bytes(raw)
    (run / "static.json").write_text(json.dumps(static_json))
    report = report_run(run)
    assert [(f.rule, f.line) for f in report.findings] == [("DD301", 40)]  # certain from syntax: kept
    assert sorted(n for n in report.notes if "cleared by the probe" in n) == [
        "static DD301 at train.py:20 cleared by the probe: set_epoch was called with 0, 1 and the order changed "
        "from epoch to epoch in the 2 observed epochs on ranks 0, 1",
        "static DD302 at train.py:21 cleared by the probe: the training DataLoader's shards on ranks 0, 1 measured "
        "disjoint: 0% of a rank's samples also seen by another rank (rank 0: 24, rank 1: 24 distinct samples)",
    ]


def _run_with_blobs(tmp_path: Path, shards: dict[int, list[int]], sampler: str = "RandomSampler") -> Path:
    """Two ranks iterating a Subset shard each (the same for an overlapping split), with the probe's blobs."""
    import zlib

    import numpy as np

    ranks = {}
    for r, indices in shards.items():
        raw = zlib.compress(np.asarray(indices, dtype=np.int64).tobytes())
        ref = {"file": f"vm-p{100 + r}.bin", "offset": 0, "nbytes": len(raw), "codec": "zlib", "dtype": "int64",
               "count": len(indices)}
        ranks[r] = (raw, [
            {"kind": "loader_created", "loader": 2, "site": SITE, "dataset_len": len(indices),
             "subset": {"depth": 1, "base_len": 100, "len": len(indices), "indices": ref, "sample_mod": None}},
            {"kind": "sampler_created", "sampler": 3, "sampler_kind": "random", "len": len(indices),
             "replacement": False, "num_samples": len(indices)},
            {"kind": "loader_iter", "loader": 2, "it": 4, "site": SITE, "created_site": SITE, "sampler": 3,
             "sampler_kind": "random", "sampler_cls": sampler, "dataset_len": len(indices), "grad_enabled": True},
            {"kind": "loader_iter_end", "loader": 2, "it": 4, "training": True, "steps": 4},
        ])
    run = make_run(tmp_path, {r: evs for r, (_, evs) in ranks.items()})
    for r, (raw, _) in ranks.items():
        (run / "events" / f"vm-p{100 + r}.bin").write_bytes(raw)
    return run


def test_dd302_measures_the_samples_under_the_subsets(tmp_path: Path) -> None:
    disjoint = _run_with_blobs(tmp_path / "a", {0: list(range(0, 50)), 1: list(range(50, 100))})
    assert probe_findings(disjoint, "DD302") == []
    # the same Subset on every rank (a split that forgot the rank): every sample is seen twice
    same = _run_with_blobs(tmp_path / "b", {0: list(range(10, 60)), 1: list(range(10, 60))})
    (f,) = probe_findings(same, "DD302")
    assert f.evidence["overlap_fraction"] == 1.0 and f.evidence["distinct_samples"] == {"0": 50, "1": 50}
    assert "of a Subset of a 100-sample dataset" in f.evidence["index_source"]["0"]
    half = _run_with_blobs(tmp_path / "c", {0: list(range(0, 60)), 1: list(range(40, 100))})
    (g,) = probe_findings(half, "DD302")
    assert g.evidence["overlap_fraction"] == pytest.approx(20 / 60)


# ------------------------------------------------------------------------------------------------ DD304


def test_dd304_dropout_and_main_process_augmentation_with_the_same_seed() -> None:
    (f,) = probe_findings("data_seeded_augment", "DD304")
    dropout = f.evidence["dropout"]
    assert dropout["identical_drawing_forwards"] == 8 and dropout["drawing_forwards"] == 8
    assert dropout["generators"] == ["torch"]
    (pipeline,) = f.evidence["data_pipeline"]
    assert pipeline["where"] == "main process" and pipeline["generators"] == ["torch"]
    assert pipeline["dataset_cls"] == "FlippedImages" and pipeline["draws_from"] == ["torch"]
    assert f.evidence["same_seed_calls"][0]["seed"] == 0
    assert f.line == 33  # torch.manual_seed(0)
    assert "dropout masks and augmentations" in f.message


def test_dd304_through_dataloader_workers() -> None:
    (f,) = probe_findings("data_uneven_shards", "DD304")
    assert f.evidence["dropout"] is None
    (pipeline,) = f.evidence["data_pipeline"]
    assert pipeline["where"] == "workers" and pipeline["num_workers"] == 2
    assert pipeline["dataset_cls"] == "CroppedImages (in a Subset)"
    assert isinstance(pipeline["worker_base_seed"], int)


def test_dd304_silent_when_ranks_are_not_seeded_alike() -> None:
    assert probe_findings("data_synthetic_unseeded", "DD304") == []


def test_dd304_silent_when_nothing_draws(tmp_path: Path) -> None:
    state = {"torch": {"digest": "aaa", "next": [0.1, 0.2, 0.3]}, "device": None}
    ranks = {r: [{"kind": "rng_forward", "n": 1, "step": 0, "generators": state, "advanced": {"torch": False}}]
             for r in range(2)}
    assert probe_findings(make_run(tmp_path, ranks), "DD304") == []


# ------------------------------------------------------------------------------------------------ DD305


def test_dd302_names_the_per_rank_sampler_seeds() -> None:
    """A DistributedSampler seeded per process (KAIR's `random.randint` when the config sets no seed): the
    finding says so and fixes the seed, not the sampler the loader already has (issue 20, KAIR trial)."""
    (f,) = probe_findings("data_sampler_seed_per_rank", "DD302")
    assert "different seed on each rank" in f.message
    seeds = f.evidence["shuffle_seed_epoch"]
    assert seeds["0"][0] != seeds["1"][0]
    assert f.fix.startswith("Give every rank's DistributedSampler the same seed")


def test_dd305_unseeded_synthetic_data() -> None:
    (f,) = probe_findings("data_synthetic_unseeded", "DD305")
    assert f.severity == Severity.HIGH and f.ranks == (0, 1)
    assert f.evidence["indices_compared"] == [0, 1, 32, 63]
    assert f.evidence["differing_fraction"] == 1.0 and len(f.evidence["differing"]) == 4
    assert f.evidence["datasets_of_this_class_differing"] == 2  # the training and the validation set
    assert f.evidence["sampler"] == "DistributedSampler"
    assert "identical seeds" in f.message and "unseeded synthetic data" in f.message
    assert "seeded to the same constant" in f.evidence["method"]
    assert f.line == 30  # the DataLoader over the dataset


def test_dd305_silent_when_items_differ_only_by_augmentation() -> None:
    assert probe_findings("data_seeded_augment", "DD305") == []


def test_dd305_random_split_differing_per_rank(tmp_path: Path) -> None:
    def items(digest: str) -> list[dict[str, Any]]:
        return [{"index": i, "digest": f"{digest}{i}", "parts": None} for i in (0, 1, 5, 9)]

    def event(r: int) -> dict[str, Any]:
        return {"kind": "dataset_items", "loader": 1, "dataset_cls": "Subset", "base_cls": "Images", "site": SITE,
                "len": 10, "sampler_cls": "DistributedSampler", "sharded": True, "deterministic": True,
                "subsets": [{"len": 10, "digest": f"split{r}", "head": [r]}], "items": items(f"d{r}-")}

    (f,) = probe_findings(make_run(tmp_path, {0: [event(0)], 1: [event(1)]}), "DD305")
    assert "random_split" in f.message and f.evidence["subset_index_digests"] == {"0": ["split0"], "1": ["split1"]}


def test_dd305_silent_without_an_index_sharding_sampler_or_with_a_private_generator(tmp_path: Path) -> None:
    def event(r: int, **over: Any) -> dict[str, Any]:
        return {"kind": "dataset_items", "loader": 1, "dataset_cls": "Shard", "site": SITE, "len": 4,
                "sampler_cls": "RandomSampler", "sharded": False, "deterministic": True,
                "items": [{"index": 0, "digest": f"x{r}"}], **over}

    assert probe_findings(make_run(tmp_path / "a", {0: [event(0)], 1: [event(1)]}), "DD305") == []
    private = {r: [event(r, sharded=True, deterministic=False)] for r in range(2)}
    assert probe_findings(make_run(tmp_path / "b", private), "DD305") == []


# ------------------------------------------------------------------------------------------------ DD306


def test_dd306_uneven_manual_shards() -> None:
    (f,) = probe_findings("data_uneven_shards", "DD306")
    assert f.severity == Severity.HIGH  # a count mismatch hangs a real run at the end of the epoch
    assert f.evidence["batches_per_epoch"] == {"0": 6, "1": 5}
    assert f.evidence["last_batch_size"] == {"0": 1, "1": 4}
    assert f.evidence["sampler_len"] == {"0": 21, "1": 20}
    assert "rank 0: 6, rank 1: 5" in f.message and "ddp.join()" in f.message
    assert f.magnitude == 1.0


def test_dd306_silent_with_a_distributed_sampler() -> None:
    for run in ("data_synthetic_unseeded", "data_seeded_augment"):
        assert probe_findings(run, "DD306") == []


def test_dd306_last_batch_only_is_medium(tmp_path: Path) -> None:
    def plan(n: int) -> dict[str, Any]:
        return {"kind": "loader_plan", "loader": 1, "iteration": 0, "site": SITE, "grad_enabled": True,
                "batches": 3, "sampler_len": n, "batch_size": 8, "drop_last": False, "sampler_cls": "RandomSampler"}

    (f,) = probe_findings(make_run(tmp_path, {0: [plan(23)], 1: [plan(22)]}), "DD306")
    assert f.severity == Severity.MEDIUM and f.evidence["last_batch_size"] == {"0": 7, "1": 6}
    assert "different numbers of batches" not in f.message
