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
