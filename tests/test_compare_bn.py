"""`ddpdoctor compare-bn`: the batch plans, option and factory validation, and real 2-rank gloo comparisons.

The slow tests launch the command for real (2 rank processes on 127.0.0.1): SyncBN must match the exact
global-batch reference to <= 1e-5 relative on i.i.d., label-sorted and file shards with uneven per-rank batches,
local BN on sorted shards must be orders of magnitude worse, and failures must come back as one line with no
process left behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from ddpdoctor.bn.plan import build_plan, read_shard_file
from ddpdoctor.cli import main
from ddpdoctor.comparebn.compare import CompareConfig, run_compare
from ddpdoctor.errors import InternalError, UsageError
from ddpdoctor.findings import Finding
from ddpdoctor.report.compare_bn import render_compare

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "fixtures" / "compare_bn" / "toy.py"
SYNC_TOL = 1e-5
# one xdist worker runs this module (`make test` runs two): its two 2-rank compare-bn runs (iid, sorted) are made
# once each, by module-scoped fixtures, for all the tests that read them (spread over two workers, made on each)
pytestmark = pytest.mark.xdist_group("compare_bn")


# ------------------------------------------------------------------------------------------------ plans


def test_iid_plan_deals_each_epoch_once_with_an_uneven_tail():
    plan = build_plan("iid", n_items=71, nproc=2, batch_size=8, steps=10, seed=3)
    first_epoch = [i for s in range(5) for i in plan.global_batch(s)]
    assert sorted(first_epoch) == list(range(71))  # 4 full global batches + a 7-sample tail
    assert plan.rank_sizes[0][:5] == [8, 8, 8, 8, 4] and plan.rank_sizes[1][:5] == [8, 8, 8, 8, 3]
    assert plan.global_sizes[5] == 16  # the next epoch starts full again
    assert plan.global_batch(5) != plan.global_batch(0)  # and is reshuffled
    assert build_plan("iid", n_items=71, nproc=2, batch_size=8, steps=10, seed=3) == plan


def test_iid_plan_merges_a_tail_too_small_for_every_rank():
    plan = build_plan("iid", n_items=35, nproc=2, batch_size=8, steps=3, seed=0)
    assert plan.global_sizes == [16, 19, 16]  # 16 + 16 + 3 -> the 3 leftovers join the second batch
    assert sorted(plan.global_batch(0) + plan.global_batch(1)) == list(range(35))


def test_sorted_plan_gives_each_rank_a_contiguous_label_slice():
    labels = [i % 4 for i in range(40)]
    plan = build_plan("sorted", n_items=40, nproc=2, batch_size=5, steps=8, seed=0, labels=labels)
    rank0 = {labels[i] for s in range(8) for i in plan.rank_batch(s, 0)}
    rank1 = {labels[i] for s in range(8) for i in plan.rank_batch(s, 1)}
    assert rank0 == {0, 1} and rank1 == {2, 3}
    assert sorted(i for s in range(4) for i in plan.rank_batch(s, 0)) == sorted(
        i for i in range(40) if labels[i] in (0, 1)
    )


def test_file_plan_and_its_errors(tmp_path):
    f = tmp_path / "shards.json"
    f.write_text(json.dumps([[0, 1, 2, 3, 4], [5, 6, 7]]))
    lists = read_shard_file(f, 2)
    plan = build_plan("file", n_items=10, nproc=2, batch_size=2, steps=4, seed=0, rank_lists=lists)
    assert [plan.rank_batch(s, 0) for s in range(4)] == [(0, 1), (2, 3, 4), (0, 1), (2, 3, 4)]
    assert [plan.rank_batch(s, 1) for s in range(4)] == [(5, 6, 7), (5, 6, 7), (5, 6, 7), (5, 6, 7)]
    with pytest.raises(ValueError, match="outside"):
        build_plan("file", n_items=6, nproc=2, batch_size=2, steps=1, seed=0, rank_lists=lists)
    with pytest.raises(ValueError, match="3 index lists for --nproc 2"):
        f.write_text("[[1, 2], [3, 4], [5, 6]]")
        read_shard_file(f, 2)
    with pytest.raises(ValueError, match="not valid JSON"):
        f.write_text("{")
        read_shard_file(f, 2)
    with pytest.raises(ValueError, match="need at least 4"):
        build_plan("iid", n_items=3, nproc=2, batch_size=2, steps=1, seed=0)


# ------------------------------------------------------------------------------------- option validation


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "1"], "--nproc must be at least 2"),
        (["--model", "no_colon"], "expected MODULE:FACTORY"),
        (["--model", "missing/file.py:make"], "no such file"),
        (["--data", "fixtures:"], "expected MODULE:FACTORY"),
        (["--shard", "random"], "not iid, sorted, or an existing JSON file"),
        (["--device", "tpu"], "--device"),
        (["--format", "xml"], "--format"),
    ],
)
def test_bad_options_exit_2_with_one_line(args, message, capsys):
    assert main(["compare-bn", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_shard_file_with_the_wrong_number_of_lists(tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text("[[0, 1, 2]]")
    assert main(["compare-bn", "--shard", str(f)]) == 2
    assert "1 index lists for --nproc 2" in capsys.readouterr().err


# --------------------------------------------------------------------------- factories (in this process)


def test_factories_are_checked_with_one_line_messages():
    pytest.importorskip("torch")
    from ddpdoctor.bn._worker import WorkerUsageError, build_dataset, build_model, resolve_device

    model, bns = build_model(f"{TOY}:model", 0)
    assert [name for name, _ in bns] == ["bn_cma", "bn_plain", "bn_1d", "bn_untracked"]
    _, n = build_dataset(f"{TOY}:data", 0)
    assert n == 71
    model, bns = build_model("ddpdoctor.bn.demo:demo_model", 0)  # a dotted module works too
    assert len(bns) == 4
    cases = [
        (lambda: build_model(f"{TOY}:broken_model", 0), "the factory raised RuntimeError: cannot download"),
        (lambda: build_model(f"{TOY}:not_a_model", 0), "returned dict, not a torch.nn.Module"),
        (lambda: build_model(f"{TOY}:model_without_bn", 0), "has no batch-norm layers"),
        (lambda: build_model(f"{TOY}:nope", 0), "has no attribute 'nope'"),
        (lambda: build_model("no_such_module_xyz:make", 0), "cannot import no_such_module_xyz"),
        (lambda: build_dataset(f"{TOY}:iterable_data", 0), "needs a map-style Dataset"),
        (lambda: resolve_device("cuda", 2, 0), "--device cuda"),
    ]
    for call, message in cases:
        with pytest.raises(WorkerUsageError, match=None) as info:
            call()
        assert message in str(info.value) and "\n" not in str(info.value)


def test_sorted_shards_need_labels():
    pytest.importorskip("torch")
    import torch

    from ddpdoctor.bn._worker import Samples, WorkerUsageError, build_dataset

    dataset, _ = build_dataset(f"{TOY}:data_without_labels", 0)
    with pytest.raises(WorkerUsageError, match="--shard sorted needs labels"):
        Samples(dataset, 0, torch).labels()
    dataset, _ = build_dataset(f"{TOY}:data", 0)
    assert Samples(dataset, 0, torch).labels()[:5] == [0, 1, 2, 3, 0]
    # items are loaded under a per-(step, index) seed: the random augmentation repeats exactly
    s = Samples(dataset, 0, torch)
    assert torch.equal(s.inputs((3, 4), 2), s.inputs((3, 4), 2))
    assert not torch.equal(s.inputs((3, 4), 2), s.inputs((3, 4), 5))


# ------------------------------------------------------------------------------------- real comparisons


def _max_sync_error(result) -> float:
    return max(
        max(layer.running_var_rel_err["sync"], layer.running_mean_rel_err["sync"])
        for layer in result.layers
        if layer.tracked
    )


@pytest.fixture(scope="module")
def demo_iid():
    return run_compare(CompareConfig(shard="iid", steps=20))


@pytest.fixture(scope="module")
def demo_sorted():
    return run_compare(CompareConfig(shard="sorted", steps=20))


@pytest.mark.slow
def test_demo_iid(demo_iid):
    r = demo_iid
    assert r.environment["device"] == "cpu" and r.environment["backend"] == "gloo"
    assert [layer.layer for layer in r.layers] == ["stem.bn", "layer1.bn", "layer2.bn", "head.bn"]
    assert _max_sync_error(r) <= SYNC_TOL
    assert r.noniid.p_value > 1e-3
    assert "DD203" not in {f.rule for f in r.findings}
    for layer in r.layers:
        # DDP's broadcast at the start of each forward leaves rank 0 with exactly its own local statistics
        assert layer.running_var_rel_err["local"] == layer.running_var_rel_err["local_no_broadcast"]
        assert layer.norm_batch["local"] == 16 and layer.norm_batch["sync"] == 32
        assert layer.rank_spread["running_var"]["sync"] == 0.0
        assert layer.rank_spread["running_var"]["local_no_broadcast"] > 0.0
    assert "shards look i.i.d." in r.verdict[0] and "SyncBN matches" in r.verdict[0]


@pytest.mark.slow
def test_demo_sorted(demo_sorted):
    r = demo_sorted
    sync = _max_sync_error(r)
    assert sync <= SYNC_TOL
    local = max(layer.running_var_rel_err["local"] for layer in r.layers)
    assert local >= 0.1 and local >= 1e4 * sync  # local BN is orders of magnitude off
    assert r.noniid.p_value < 1e-3
    rules = {f.rule: f for f in r.findings}
    assert {"DD201", "DD203"} <= set(rules)
    assert rules["DD203"].sources == ("compare-bn",)
    assert "p=" in rules["DD203"].message
    assert "shards are not i.i.d." in r.verdict[0] and "use SyncBN or fix the sharding" in r.verdict[0]


@pytest.mark.slow
def test_reduce_mode_is_biased_low_when_the_ranks_means_differ(demo_sorted, demo_iid):
    """timm's --dist-bn reduce averages the ranks' running statistics: the means average right, the variances lose
    the spread between the ranks' means, so on sorted shards running_var is biased low and SyncBN is not."""
    sorted_bias = [layer.reduce_var_bias for layer in demo_sorted.layers]
    assert min(sorted_bias) < -0.03, sorted_bias  # the first layer, where the shards' means differ most
    for layer in demo_sorted.layers:
        assert layer.running_var_rel_err["local_reduce"] > 1e3 * layer.running_var_rel_err["sync"]
        assert layer.rank_spread["running_var"]["local_reduce"] == 0.0  # every rank holds the average
    stem_iid = demo_iid.layers[0].reduce_var_bias
    assert abs(stem_iid) < abs(demo_sorted.layers[0].reduce_var_bias) / 2, (stem_iid, sorted_bias)
    assert any("--dist-bn reduce" in line and "biased low" in line for line in demo_sorted.verdict)


@pytest.mark.slow
def test_json_document(demo_sorted):
    doc = json.loads(render_compare(demo_sorted, "json", color=False))
    assert doc["schema"] == "ddpdoctor.compare-bn/1"
    assert doc["config"] == {
        "model": None, "data": None, "nproc": 2, "batch_size": 16, "steps": 20, "shard": "sorted",
        "seed": 0, "device": "auto", "timeout": 300.0,
    }
    layer = doc["layers"][0]
    assert layer["features"] == 16 and layer["norm_batch"]["local"] == 16 and layer["norm_batch"]["sync"] == 32
    assert set(layer["running_mean_rel_err"]) >= {"local", "local_no_broadcast", "sync"}
    assert set(layer["running_var_rel_err"]) >= {"local", "local_no_broadcast", "sync"}
    assert set(layer["rank_spread"]["running_var"]) == {"local", "local_no_broadcast", "local_reduce", "sync"}
    assert "Cauchy" in doc["noniid"]["method"] and doc["noniid"]["p_value"] < 1e-3
    assert doc["noniid"]["statistic"] > 0
    findings = [Finding.from_json(f) for f in doc["findings"]]
    assert {f.rule for f in findings} >= {"DD201", "DD203"}
    assert all(f.sources == ("compare-bn",) for f in findings)


@pytest.mark.slow
def test_text_report(demo_sorted):
    text = render_compare(demo_sorted, "text", color=False)
    assert "stem.bn" in text and "head.bn" in text
    assert "█" in text  # the bar chart
    assert "verdict" in text and "DD203" in text
    assert "\x1b[" not in text
    assert all(line == line.rstrip() for line in text.splitlines())


@pytest.mark.slow
def test_user_factories_with_uneven_batches():
    """71 samples, global batch 16: step 5 splits a 7-sample tail 4/3 across the ranks; the toy model has a
    cumulative-average BN, an affine-free BN, a BatchNorm1d, an untracked BN and a dropout."""
    r = run_compare(CompareConfig(model=f"{TOY}:model", data=f"{TOY}:data", batch_size=8, steps=6, shard="iid"))
    assert r.plan["uneven_steps"] >= 1 and 7 in r.plan["global_batch_sizes"]
    assert _max_sync_error(r) <= SYNC_TOL
    untracked = next(layer for layer in r.layers if layer.layer == "bn_untracked")
    assert not untracked.tracked and untracked.running_var_rel_err == {}
    assert "DD202" in {f.rule for f in r.findings}  # 8 samples per rank


@pytest.mark.slow
def test_shard_file(tmp_path):
    f = tmp_path / "shards.json"
    f.write_text(json.dumps([list(range(0, 21)), list(range(40, 53))]))  # uneven: 21 and 13 samples
    r = run_compare(CompareConfig(model=f"{TOY}:model", data=f"{TOY}:data", batch_size=8, steps=5, shard=str(f)))
    assert r.plan["shard"] == "file" and r.plan["uneven_steps"] >= 1
    assert _max_sync_error(r) <= SYNC_TOL


def _workers_alive(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "ddpdoctor.bn._worker" in cmdline and marker in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to look for leftover processes")
def test_timeout_kills_the_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(UsageError, match=r"did not finish within --timeout 4 s; ranks were at: rank 0: "):
        run_compare(CompareConfig(model=f"{TOY}:hanging_model", data=f"{TOY}:data", timeout=4.0))
    assert _workers_alive(str(tmp_path)) == []
    assert list(tmp_path.iterdir()) == []  # the work directory is gone too


@pytest.mark.slow
def test_rank_failures_come_back_as_one_line(capsys):
    with pytest.raises(InternalError, match=r"^compare-bn rank 1 exited with code 7"):
        run_compare(CompareConfig(model=f"{TOY}:dying_model", data=f"{TOY}:data", steps=3))
    # --quiet: the progress lines before it are another test's (test_compare_bn_progress.py)
    code = main(["compare-bn", "--model", f"{TOY}:broken_model", "--data", f"{TOY}:data", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        f"ddpdoctor: error: --model '{TOY}:broken_model': the factory raised RuntimeError: cannot download "
        "pretrained weights\n"
    )


@pytest.mark.slow
def test_data_that_differs_across_ranks_is_refused():
    with pytest.raises(UsageError, match="different data on different ranks"):
        run_compare(CompareConfig(model=f"{TOY}:model", data=f"{TOY}:unseeded_data", steps=2))


def test_forward_errors_are_usage_errors():
    pytest.importorskip("torch")
    import torch

    from ddpdoctor.bn._worker import WorkerUsageError, build_model, forward_or_usage_error

    model, _ = build_model(f"{TOY}:wrong_input_model", 0)
    with pytest.raises(WorkerUsageError, match="the model's forward failed on the data: RuntimeError"):
        forward_or_usage_error(model, torch.zeros(4, 2, 5, 5))


def test_cwd_is_not_written(tmp_path, monkeypatch):
    """Validation failures create nothing in the user's directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError):
        run_compare(CompareConfig(nproc=1))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("columns", [80, 100, 132])
def test_text_report_fits_the_terminal_and_never_cuts_a_number(demo_sorted, monkeypatch, columns):
    """The table splits into tables per meaning (sizes, var errors, mean errors, spread and test), each led by
    the layer, rather than cutting cells to "…" (issue 22); COLUMNS is honoured when piped."""
    monkeypatch.setenv("COLUMNS", str(columns))
    text = render_compare(demo_sorted, "text", color=False)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= columns
    table = text[: text.index("local = rank 0")]
    for layer in demo_sorted.layers:
        assert table.count(layer.layer) >= 1
        assert f"{layer.norm_batch['local']}/{layer.norm_batch['sync']}" in table


POOL_FACTORY = """
import importlib.util
import multiprocessing

spec = importlib.util.spec_from_file_location("toy_for_the_pool", {toy!r})
toy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(toy)
data = toy.data


def model():
    with multiprocessing.get_context("forkserver").Pool(1) as pool:  # its sockets live in a pymp-* folder
        assert pool.map(abs, [-1, 2]) == [1, 2]
    return toy.model()
"""


@pytest.mark.slow
def test_no_temporary_file_is_left_behind_by_a_factorys_forkserver_pool(tmp_path, monkeypatch):
    """A model factory that uses a forkserver pool makes multiprocessing create pymp-* folders in TMPDIR, which a
    rank ending with os._exit never removes: they went to the user's TMPDIR and stayed."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    factory = tmp_path / "factory.py"
    factory.write_text(POOL_FACTORY.format(toy=str(TOY)))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # this process's cached choice: TMPDIR again
    r = run_compare(CompareConfig(model=f"{factory}:model", data=f"{factory}:data", batch_size=8, steps=2))
    assert r.layers
    assert sorted(os.listdir(tmp)) == []
