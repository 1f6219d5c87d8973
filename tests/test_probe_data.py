"""The data recorders (ddpdoctor/probe/recorders/rng.py, dataset.py): unit tests in this process, and the real
probe on 2 CPU ranks over the data fixtures (fixtures/probe/data/), whose recorded runs (fixtures/runs/data_*/,
`python -m ddpdoctor.dev.record`) tests/test_analyses_data.py replays."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from ddpdoctor.probe.recorders import dataset as dataset_rec
from ddpdoctor.probe.recorders import rng as rng_rec

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "fixtures" / "runs"


# ------------------------------------------------------------------------------------------------ helpers


class Augmented(Dataset):
    """Deterministic data, random flips drawn from the global torch generator and numpy."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(10, 4, generator=g)

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i):
        x = self.x[i]
        if torch.rand(()) < 0.5:
            x = x.flip(0)
        return x * float(np.random.uniform(0.9, 1.1)), i


class PrivateGenerator(Dataset):
    """Draws from its own unseeded generator: not reproducible under a fixed global seed."""

    def __init__(self) -> None:
        self.g = torch.Generator()
        self.g.seed()

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i):
        return torch.rand(3, generator=self.g)


def _global_streams() -> tuple[list[float], list[float], list[float]]:
    return torch.rand(3).tolist(), np.random.random_sample(3).tolist(), [random.random() for _ in range(3)]


# ------------------------------------------------------------------------------------------------ unit tests


def test_reading_items_restores_every_global_generator() -> None:
    torch.manual_seed(11)
    np.random.seed(11)
    random.seed(11)
    expected = _global_streams()
    torch.manual_seed(11)
    np.random.seed(11)
    random.seed(11)
    info = dataset_rec.read_items(Augmented(), dataset_rec.fixed_indices(10))
    assert _global_streams() == expected  # the script's streams are untouched
    assert info["indices"] == [0, 1, 5, 9]
    assert len(info["items"]) == 4
    assert info["deterministic"] is True
    assert info["seed_dependent"] is True
    assert info["draws_from"] == ["numpy", "torch"]
    assert info["error"] is None


def test_reading_items_gives_the_same_digests_whatever_the_callers_state() -> None:
    torch.manual_seed(1)
    first = dataset_rec.read_items(Augmented(), [0, 3])
    torch.manual_seed(999)
    np.random.seed(5)
    second = dataset_rec.read_items(Augmented(), [0, 3])
    assert [i["digest"] for i in first["items"]] == [i["digest"] for i in second["items"]]


def test_a_private_generator_is_reported_as_not_reproducible() -> None:
    info = dataset_rec.read_items(PrivateGenerator(), [0, 4])
    assert info["deterministic"] is False
    assert info["draws_from"] == []


def test_deterministic_dataset_draws_nothing() -> None:
    ds = TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))
    info = dataset_rec.read_items(ds, dataset_rec.fixed_indices(len(ds)))
    assert info["deterministic"] is True and info["seed_dependent"] is False and info["draws_from"] == []
    assert info["items"][0]["parts"] is not None and len(info["items"][0]["parts"]) == 2
    assert info["items"][0]["first"] == {"shape": [2], "dtype": "float32", "mean": 0.5}


def test_item_digest_is_by_value_and_not_by_identity() -> None:
    a = dataset_rec.digest_item((torch.ones(2, 3), 4, {"name": "x", "obj": object()}))
    b = dataset_rec.digest_item((torch.ones(2, 3).clone(), 4, {"name": "x", "obj": object()}))
    c = dataset_rec.digest_item((torch.ones(2, 3), 5, {"name": "x", "obj": object()}))
    d = dataset_rec.digest_item((torch.ones(3, 2), 4, {"name": "x", "obj": object()}))
    assert a["digest"] == b["digest"]
    assert a["digest"] != c["digest"] and a["digest"] != d["digest"]
    assert a["opaque"] == 1 and a["tensors"] == 1
    assert a["parts"][0] == c["parts"][0] and a["parts"][1] != c["parts"][1]


def test_fixed_indices_are_the_same_rule_for_every_length() -> None:
    assert dataset_rec.fixed_indices(1) == [0]
    assert dataset_rec.fixed_indices(2) == [0, 1]
    assert dataset_rec.fixed_indices(45) == [0, 1, 22, 44]


def test_subset_chain_records_the_split() -> None:
    base = TensorDataset(torch.zeros(10))
    a = dataset_rec._subset_chain(Subset(Subset(base, [9, 8, 7, 6, 5]), [0, 2]))
    assert [s["len"] for s in a] == [2, 5]
    assert a[0]["head"] == [0, 2]
    assert type(dataset_rec._innermost(Subset(Subset(base, [1]), [0]))) is TensorDataset


def test_subset_indices_map_to_the_dataset_underneath() -> None:
    """Nested Subsets compose; every index container a Subset accepts (range, list, tensor, numpy array) maps."""
    import numpy as np
    from torch.utils.data import Subset, TensorDataset

    from ddpdoctor.probe.recorders.data import consistent_sample, subset_map

    base = TensorDataset(torch.arange(100))
    assert subset_map(base).depth == 0 and subset_map(base).apply([3, 1]).tolist() == [3, 1]
    strided = Subset(base, range(1, 100, 2))  # rank 1 of 2, sharded by hand
    m = subset_map(strided)
    assert (m.depth, m.base_len) == (1, 100) and m.apply([0, 1, 49]).tolist() == [1, 3, 99]
    nested = Subset(Subset(base, torch.arange(50, 100)), [4, 0, 2])
    assert subset_map(nested).depth == 2 and subset_map(nested).apply([0, 1, 2]).tolist() == [54, 50, 52]
    assert subset_map(Subset(base, np.array([7, 9]))).apply([1]).tolist() == [9]
    assert subset_map(strided) is m  # computed once per dataset
    # a consistent sample of mapped indices keeps the same samples whatever rank's Subset they come from
    big = Subset(TensorDataset(torch.arange(400_000)), range(0, 400_000, 2))
    kept, k = consistent_sample(subset_map(big).base, 400_000)
    whole, k2 = consistent_sample(torch.arange(400_000), 400_000)
    assert k == k2 and set(kept.tolist()) == {i for i in whole.tolist() if i % 2 == 0}


def test_generator_states_are_read_without_drawing() -> None:
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    t = rng_rec.torch_state(torch.default_generator)
    n = rng_rec.numpy_state()
    p = rng_rec.python_state()
    after = _global_streams()
    assert [round(v, 6) for v in after[0]] == t["next"]
    assert [round(v, 6) for v in after[1]] == n["next"]
    assert [round(v, 6) for v in after[2]] == p["next"]
    torch.manual_seed(3)
    assert rng_rec.torch_state(torch.default_generator)["digest"] == t["digest"]
    torch.manual_seed(4)
    assert rng_rec.torch_state(torch.default_generator)["digest"] != t["digest"]


def test_index_sharded_samplers() -> None:
    from torch.utils.data import DistributedSampler, RandomSampler

    ds = TensorDataset(torch.zeros(8))
    assert dataset_rec.is_index_sharded(DistributedSampler(ds, num_replicas=2, rank=0))
    assert not dataset_rec.is_index_sharded(RandomSampler(ds))

    class Sharder:
        num_replicas, rank = 2, 1

    assert dataset_rec.is_index_sharded(Sharder())


# ------------------------------------------------------------------------------------------------ the real probe

DATA_FIXTURES = {
    # fixture: (rules the probe must report, rules it must not)
    "synthetic_unseeded": ({"DD305"}, {"DD303", "DD304", "DD306"}),
    "seeded_augment": ({"DD303", "DD304"}, {"DD305", "DD306"}),
    "sampler_seed_per_rank": ({"DD302"}, {"DD305", "DD306"}),
    "uneven_shards": ({"DD304", "DD306"}, {"DD302", "DD303", "DD305"}),
    "sampler_helper": ({"DD301"}, {"DD302", "DD303", "DD305", "DD306"}),
}
LIVE = {"seeded_augment"}  # recorded runs replay the others (tests/test_analyses_data.py)


def probe_fixture(area: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options):
    """Run the real probe (2 CPU ranks) on fixtures/probe/<area>/<name>.py from the repository root."""
    from ddpdoctor.check import run_check
    from ddpdoctor.config import CheckConfig

    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    cfg = CheckConfig(script=Path(f"fixtures/probe/{area}/{name}.py"), device="cpu", nproc=2, timeout=600,
                      keep_run=run_dir, **options)
    report = run_check(cfg)
    return report, run_dir


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DATA_FIXTURES))
def test_probe_finds_the_data_rules(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if name not in LIVE:
        pytest.skip("replayed from fixtures/runs (recorded by python -m ddpdoctor.dev.record)")
    report, run_dir = probe_fixture("data", name, tmp_path, monkeypatch)
    fire, silent = DATA_FIXTURES[name]
    probe_rules = {f.rule for f in report.findings if "probe" in f.sources}
    assert fire <= probe_rules, report.to_json()["findings"]
    assert not (silent & probe_rules)
    errors = [json.loads(line) for log in (run_dir / "events").glob("*.jsonl") for line in log.read_text().splitlines()
              if '"internal_error"' in line]
    assert not [e for e in errors if any(m in e["where"] for m in ("rng", "dataset", "loader_plan"))], errors
