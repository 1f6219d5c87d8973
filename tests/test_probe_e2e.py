"""End to end: `ddpdoctor check` runs each fixture script on 2 real gloo ranks on 127.0.0.1 and must report the
right findings with measured evidence, within its timeout, leaving no process behind.

Every test marks its environment with a unique variable that all processes of the run inherit, and asserts that
no process carrying it is alive afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.check import report_run, run_check
from ddpdoctor.config import CheckConfig
from ddpdoctor.findings import Severity

REPO = Path(__file__).resolve().parents[1]
MARK = "DDPD_TEST_MARK"  # not DDPDOCTOR_*: the launcher drops those from the environment it passes on
pytestmark = pytest.mark.slow


def _marked_processes(mark: str) -> list[int]:
    found: list[int] = []
    if not Path("/proc").is_dir():
        return found
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"{MARK}={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _kill_marked(mark: str) -> None:
    """A failing test must not leak its run into the next ones."""
    for pid in _marked_processes(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Run `check` on a fixture script; returns (report JSON, run directory, wall seconds)."""
    monkeypatch.chdir(REPO)
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    yield _runner(tmp_path, mark)
    _kill_marked(mark)


def _runner(tmp_path: Path, mark: str):
    # a run that is expected to end by itself gets a timeout no loaded machine reaches; one that must hit its
    # timeout waits for the ranks to have done something first (_once_the_ranks_stepped)
    def run(name: str, *args: str, timeout: float = 600.0, **options: Any) -> tuple[dict, Path, float]:
        run_dir = tmp_path / "run"
        cfg = CheckConfig(
            script=Path("fixtures/probe") / f"{name}.py",
            script_args=tuple(args),
            nproc=2,
            timeout=timeout,
            keep_run=run_dir,
            **options,
        )
        t0 = time.monotonic()
        report = run_check(cfg)
        wall = time.monotonic() - t0
        assert _marked_processes(mark) == [], "processes of the run are still alive"
        return report.to_json(), run_dir, wall

    return run


def _by_rule(report: dict, source: str = "probe") -> dict[str, dict]:
    return {f["rule"]: f for f in report["findings"] if source in f["sources"]}


def _above(report: dict, severity: Severity) -> list[dict]:
    return [f for f in report["findings"] if Severity.parse(f["severity"]) > severity]


def test_missing_set_epoch_repeats_the_order(probe, tmp_path: Path) -> None:
    """Also `check --quiet` as the user runs it (the installed module in its own process, stderr a pipe): the report
    on stdout and nothing on stderr (one launch for both: test_progress's quiet test was this same run)."""
    import json

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}  # MARK stays: it is DDPD_TEST_*
    done = subprocess.run([sys.executable, "-m", "ddpdoctor", "check", "fixtures/probe/missing_set_epoch.py",
                           "--format", "json", "--quiet", "--keep-run", str(run_dir), "--timeout", "600"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode in (0, 1) and done.stderr == "", done.stderr
    assert _marked_processes(os.environ[MARK]) == [], "processes of the run are still alive"
    report = json.loads(done.stdout)  # stdout is the report alone
    f = _by_rule(report)["DD301"]
    assert f["severity"] == "high" and f["line"] == 16 and f["ranks"] == [0, 1]
    for r in ("0", "1"):
        ev = f["evidence"]["per_rank"][r]
        assert ev["position_identity_epoch0_vs_1"] == 1.0
        assert ev["set_epoch_calls"] == [] and ev["sampler_epoch_values"] == [0, 0]
    # the two ranks still see different shards
    assert f["evidence"]["per_rank"]["0"]["digests"][0] != f["evidence"]["per_rank"]["1"]["digests"][0]
    assert "DD302" not in _by_rule(report) and "DD103" not in _by_rule(report)
    assert report["environment"]["backend"] == "gloo" and report["environment"]["nproc"] == 2
    assert (run_dir / "meta.json").is_file() and (run_dir / "static.json").is_file()


def test_missing_distributed_sampler_overlaps_the_ranks(probe) -> None:
    report, _, _ = probe("no_distributed_sampler")
    f = _by_rule(report)["DD302"]
    ev = f["evidence"]
    assert ev["overlap_fraction"] == 1.0
    assert ev["distinct_samples"] == {"0": 96, "1": 96}
    assert ev["identical_batches_fraction"] == 1.0  # same torch.manual_seed(0) on every rank
    assert f["line"] == 14 and "2×" in f["message"]


def test_forward_through_unwrapped_model_and_diverged_replicas(probe) -> None:
    report, _, _ = probe("forward_bypass")
    found = _by_rule(report)
    bypass = found["DD102"]
    assert bypass["severity"] == "critical" and bypass["line"] == 26
    for r in ("0", "1"):
        assert bypass["evidence"]["per_rank"][r]["bypass_forwards"] == 8
        assert bypass["evidence"]["per_rank"][r]["ddp_forwards"] == 0
        assert bypass["evidence"]["per_rank"][r]["steps"] == 8
    # the diverged replicas are the bypass's consequence: folded under DD102, not ranked beside it
    assert "DD103" not in found
    diverged = next(c for c in bypass["consequences"] if c["rule"] == "DD103")
    assert "bypassed DDP" in diverged["because"]
    # the initial weights (step 0) agree, DDP's constructor broadcast them; the unreduced first step splits them
    assert diverged["evidence"]["first_step"] == 1 and diverged["evidence"]["steps_compared"] == 9
    assert diverged["evidence"]["trace"][0] == {"step": 0, "ranks_differing": [], "max_abs_diff_sampled": 0.0}
    assert diverged["evidence"]["max_abs_diff_final"] > 1e-3
    # the evaluation pass over the same loader repeats the order within an epoch: not a DD301
    assert "DD301" not in found


def test_unscaled_lr_against_the_reference_recipe(probe) -> None:
    report, run_dir, _ = probe("unscaled_lr", base_lr=0.1, base_batch=16)
    f = _by_rule(report)["DD401"]
    ev = f["evidence"]
    assert (ev["per_rank_batch"], ev["world_size"], ev["accumulation"], ev["global_batch"]) == (16, 2, 1, 32)
    assert ev["lr"] == pytest.approx(0.1) and ev["expected_lr"] == pytest.approx(0.2) and ev["rule"] == "linear"
    assert f["line"] == 24 and "expects lr 0.2" in f["message"]
    # `report DIR` reproduces it, and a recipe that matches the measured batch clears it
    again = report_run(run_dir).to_json()
    assert _by_rule(again)["DD401"]["evidence"]["expected_lr"] == pytest.approx(0.2)
    cleared = report_run(run_dir, base_lr=0.1, base_batch=32).to_json()
    assert "DD401" not in _by_rule(cleared)
    sqrt = report_run(run_dir, base_lr=0.1, base_batch=16, lr_scaling="sqrt").to_json()
    assert _by_rule(sqrt)["DD401"]["evidence"]["expected_lr"] == pytest.approx(0.1 * 2**0.5)


def test_hard_coded_rank_is_overridden_and_measuring_goes_on(probe) -> None:
    report, _, _ = probe("hardcoded_rank")
    f = _by_rule(report)["DD104"]
    assert f["severity"] == "critical" and f["line"] == 11
    calls = {c["rank"]: c for c in f["evidence"]["calls"]}
    assert calls["1"]["overridden"] == {"rank": [0, 1]}
    assert calls["0"]["overridden"] == {}
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][3] == 8 and rows[1][3] == 8  # both ranks trained past the fatal bug
    assert "DD103" not in _by_rule(report) and "DD901" not in _by_rule(report)


def test_self_spawning_script_is_started_once_and_its_children_instrumented(probe) -> None:
    report, run_dir, _ = probe("self_spawn")
    f = _by_rule(report)["DD301"]
    assert f["ranks"] == [0, 1]
    assert any("starts its own ranks" in n and "2 child processes" in n for n in report["notes"])
    import json

    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["mode"] == "spawn"
    roles = sorted(json.loads(p.read_text().splitlines()[0])["role"] for p in (run_dir / "events").glob("*.jsonl"))
    assert roles == ["main", "spawned", "spawned"]


FORKSERVER_STARTS = {
    "torch.multiprocessing.start_processes": (
        "    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)",
        "    mp.start_processes(train, args=(world_size,), nprocs=world_size, start_method='forkserver')",
    ),
    "multiprocessing.get_context": (
        "    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)",
        "    import multiprocessing\n"
        "    ctx = multiprocessing.get_context('forkserver')\n"
        "    ranks = [ctx.Process(target=train, args=(r, world_size)) for r in range(world_size)]\n"
        "    [p.start() for p in ranks]\n"
        "    [p.join() for p in ranks]",
    ),
}


@pytest.mark.parametrize("how", sorted(FORKSERVER_STARTS))
def test_ranks_a_script_starts_through_the_forkserver_are_instrumented(how: str, monkeypatch, tmp_path) -> None:
    """multiprocessing's fork server is started by `python -c 'from multiprocessing.forkserver import main...'`
    and forks the ranks from itself: they are observed like spawned ones (they were not: DD904, DD903)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "common.py").write_text((REPO / "fixtures" / "probe" / "common.py").read_text())
    old, new = FORKSERVER_STARTS[how]
    source = (REPO / "fixtures" / "probe" / "self_spawn.py").read_text()
    assert old in source
    (project / "train.py").write_text(source.replace(old, new))
    monkeypatch.chdir(project)
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    try:
        report = run_check(CheckConfig(script=Path("train.py"), nproc=2, timeout=600.0,
                                       keep_run=tmp_path / "run")).to_json()
        assert _marked_processes(mark) == [], "processes of the run are still alive"
    finally:
        _kill_marked(mark)
    rules = _by_rule(report)
    assert "DD904" not in rules and "DD903" not in rules, sorted(rules)
    assert rules["DD301"]["ranks"] == [0, 1]
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][3] == 8 and rows[1][3] == 8


def test_legacy_local_rank_script_runs_as_under_torchrun(probe) -> None:
    report, _, _ = probe("legacy_local_rank")
    f = _by_rule(report)["DD108"]
    per_rank = f["evidence"]["per_rank"]
    assert per_rank["0"] == {"default": 0, "value": 0, "LOCAL_RANK": "0"}
    assert per_rank["1"] == {"default": 0, "value": 0, "LOCAL_RANK": "1"}
    assert f["line"] == 14 and not f["evidence"]["injected_by_probe"]
    assert [c["rule"] for c in f["consequences"]] == ["DD105"]
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][3] == 8 and rows[1][3] == 8
    assert any("nccl→gloo" in n for n in report["notes"])


def test_legacy_local_rank_default_minus_one_is_overridden_and_the_run_measured(probe) -> None:
    """Live, so that the recorder's attribution is what is tested: an env read made while torch is imported (an
    import hook) is not the script reading LOCAL_RANK, and `os.environ.get` in the fallback script is."""
    report, _, _ = probe("legacy_local_rank_minus_one")
    f = _by_rule(report)["DD108"]
    assert f["sources"] == ["static", "probe"] and f["evidence"]["overridden_by_probe"] == {"0": 0, "1": 1}
    assert "DD902" not in _by_rule(report)
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][3] == 8 and rows[1][3] == 8
    fallback, _, _ = probe("legacy_local_rank_env_fallback")
    assert "DD108" not in _by_rule(fallback)


def test_the_probes_own_local_rank_read_never_clears_dd108(probe) -> None:
    """ddpdoctor reads LOCAL_RANK inside its own parse_known_args wrapper (the legacy --local_rank override): that
    read is not the script's, so a script that binds every rank to cuda:0 from --local_rank 0 keeps DD108; its twin
    that reads LOCAL_RANK after parsing is cleared (issue 20)."""
    report, _, _ = probe("legacy_local_rank_known_args")
    f = _by_rule(report)["DD108"]
    assert not f["evidence"]["reads_local_rank_env"] and f["line"] == 15
    assert [c["rule"] for c in f["consequences"]] == ["DD105"]
    good, _, _ = probe("legacy_local_rank_known_args_env")
    assert "DD108" not in _by_rule(good) and "DD105" not in _by_rule(good)


def test_an_installed_apex_without_parallel_crashes_the_run_as_it_does_for_the_user(probe) -> None:
    """apex is importable (NVIDIA apex after apex.parallel was removed): no stand-in replaces it; the script's
    AttributeError at the wrap is the finding (issue 20)."""
    report, _, _ = probe("apex_without_parallel/train")
    f = _by_rule(report)["DD902"]
    assert "AttributeError" in f["message"] and "parallel" in f["message"] and f["line"] == 17
    assert not any("stand-in" in n for n in report["notes"])


def test_torch_device_of_an_int_runs_under_emulation_and_an_emulation_gap_is_its_limit(probe) -> None:
    """`torch.device(local_rank)` is fine on GPUs: emulated, not reported (it raised, and the user was told to fix
    the script). A call the emulation does not reproduce is reported as the emulation's limit (issue 20)."""
    report, _, _ = probe("device_from_int")
    assert not {"DD902", "DD105", "DD904"} & set(_by_rule(report)), [f["rule"] for f in report["findings"]]
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][3] == 8 and rows[1][3] == 8
    gap, run_dir, _ = probe("cuda_generator")
    f = _by_rule(gap)["DD902"]
    assert "a limit of ddpdoctor's CUDA emulation" in f["message"] and f["line"] == 17, f["message"]
    # the same run as a torch the emulation cannot be installed on records it (torch 2.1 has no
    # torch.amp.grad_scaler): the script's CUDA call failing there is ddpdoctor's limit too, never the script's bug
    import json

    for log in (run_dir / "events").glob("*.jsonl"):
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        for e in events:
            if e["kind"] == "torch_ready":
                e.update(cuda_emulated=False, emulation_error="ImportError: cannot import name 'grad_scaler'")
        log.write_text("".join(json.dumps(e) + "\n" for e in events))
    f = _by_rule(report_run(run_dir).to_json())["DD902"]
    assert "CUDA emulation could not be installed on this torch (ImportError" in f["message"], f["message"]
    assert "not a bug of the script" in f["message"] and f["severity"] == "high"


def test_a_custom_batch_sampler_is_the_index_source(probe) -> None:
    """`batch_sampler=` decides the indices; DataLoader's default sampler is unused. A sharding batch sampler
    measures 0 % shared (no DD302, and the static suspicion, if any, is cleared); one that does not shard is DD302
    with what it measured (issue 20)."""
    good, _, _ = probe("data/batch_sampler_sharded")
    assert "DD302" not in {f["rule"] for f in good["findings"]}, [f["message"] for f in good["findings"]]
    bad, _, _ = probe("data/batch_sampler_unsharded")
    f = _by_rule(bad)["DD302"]
    assert f["evidence"]["overlap_fraction"] == 1.0
    assert all("ShardedBatches" in v for v in f["evidence"]["index_source"].values()), f["evidence"]


def test_repeated_augmentation_is_recognised_by_measurement(probe) -> None:
    """Each sample on 2 ranks by design, each rank its own augmentation stream: no DD302. The same sampler with
    the same stream on every rank repeats the work: DD302 (issue 20)."""
    good, _, _ = probe("data/repeated_views")
    assert "DD302" not in {f["rule"] for f in good["findings"]}, [f["message"] for f in good["findings"]]
    bad, _, _ = probe("data/repeated_views_same_seed")
    assert "DD302" in _by_rule(bad) and "DD304" in {f["rule"] for f in bad["findings"]} | {
        c["rule"] for f in bad["findings"] for c in f.get("consequences", [])}


def test_a_fixed_synthetic_batch_has_no_data_to_call_non_iid(probe) -> None:
    """One random batch per rank fed at every step (a benchmark, no dataset): the non-i.i.d. test has no sampling
    noise to test against, so DD203 stays silent and a note says why; fresh batches whose distribution differs by
    rank are DD203 (issue 20)."""
    fixed, _, _ = probe("data/fixed_synthetic_batch")
    assert "DD203" not in {f["rule"] for f in fixed["findings"]}, [f["message"] for f in fixed["findings"]]
    assert any("DD203 (non-i.i.d. shards) not tested" in n for n in fixed["notes"])
    shifted, _, _ = probe("data/shifted_synthetic_batches")
    assert "DD203" in _by_rule(shifted)


def test_workers_that_set_cuda_visible_devices_to_their_own_gpu_are_bound(probe) -> None:
    """The environment the script sets up counts: cuda:0 of a worker whose CUDA_VISIBLE_DEVICES is its own GPU is
    that GPU. No DD105 (static or probe); the same script giving every worker GPU 0 is DD105 (issue 20)."""
    own, _, _ = probe("visible_devices_own")
    assert "DD105" not in {f["rule"] for f in own["findings"]}, [f["message"] for f in own["findings"]]
    same, _, _ = probe("visible_devices_same")
    f = _by_rule(same)["DD105"]
    assert "cuda:0" in f["message"]


def test_a_load_that_loads_nothing_ranks_above_small_bn_batches(probe) -> None:
    """Rank by measured consequence (issue 20): a strict=False load that loaded nothing trains the whole run from
    random weights — first, above the high DD202 of the same run; loading every key, DD503 is gone."""
    bad, _, _ = probe("ckpt/strict_false_loads_nothing")
    rules = [f["rule"] for f in bad["findings"]]
    assert rules[0] == "DD503" and "DD202" in rules, rules
    assert bad["findings"][0]["severity"] == "critical"
    good, _, _ = probe("ckpt/strict_false_loads_all")
    assert "DD503" not in {f["rule"] for f in good["findings"]} and "DD202" in _by_rule(good)


def test_a_model_that_learns_nothing_ranks_above_the_ranks_differing_data(probe) -> None:
    """Rank by measured consequence, not rule number (issue 20; the shape of PyTorch's DDP tutorial): one logit
    trained with cross-entropy learns nothing (DD405) on per-rank unseeded data (DD305), both high — DD405 first,
    with the whole training measured lost. The twin with two logits learns: DD305 alone."""
    bad, _, _ = probe("ranking/one_logit_per_rank_data")
    rules = [f["rule"] for f in bad["findings"]]
    assert rules[:2] == ["DD405", "DD305"], rules
    assert bad["findings"][0]["evidence"]["training_lost"] == 1.0
    good, _, _ = probe("ranking/two_logits_per_rank_data")
    rules = [f["rule"] for f in good["findings"]]
    assert rules[0] == "DD305" and "DD405" not in rules, rules


def test_a_static_dd206_on_a_ddp_forward_every_rank_ran_is_cleared_by_the_buffer_broadcast_recorded(probe) -> None:
    """Issue 20: DDP's broadcast of rank 0's buffers at the start of a forward is a collective the script never calls
    itself; the probe records it at the forward's line, so a static DD206 on a DDP forward under a rank test every
    rank passes is cleared from what ran (it stayed, high)."""
    report, _, _ = probe("../measured/dd206_ddp_forward_on_every_rank")
    assert "DD206" not in {f["rule"] for f in report["findings"]}, [f["message"] for f in report["findings"]]
    assert any(n.startswith("static DD206 at ") and ":17 cleared" in n
               and "DDP's buffer broadcast" in n for n in report["notes"]), report["notes"]


def test_identical_fresh_random_batches_without_a_dataset_are_a_low_dd302_that_says_synthetic(probe) -> None:
    """Issue 20: a benchmark drawing torch.randn every step with one seed on every rank feeds identical batches —
    identical gradients, the world trains on one rank's data. Measured: no DataLoader or Dataset read and no sample
    recurring across forwards, so synthetic by design: DD302 low, saying so. Drawn from a dataset
    (fsdp2_same_batches.py --ddp, tests/test_fsdp2.py) it stays high."""
    report, _, _ = probe("data/synthetic_fresh_batches_seeded_alike")
    (f,) = [f for f in report["findings"] if f["rule"] == "DD302"]
    assert f["severity"] == "low" and f["evidence"]["synthetic"] is True, f
    assert f["evidence"]["samples_recurring"] == 0 and f["evidence"]["data_pipeline"] is False
    assert "synthetic data" in f["message"] and "seed its generator with its rank" in f["message"]
    assert not [g for g in report["findings"] if g["severity"] in ("medium", "high", "critical")], report["findings"]


def test_correct_cuda_syncbn_script_reports_nothing_above_low(probe) -> None:
    report, _, _ = probe("cuda_syncbn_correct")
    assert _above(report, Severity.LOW) == [], [f["rule"] + " " + f["message"] for f in _above(report, Severity.LOW)]
    env = report["environment"]
    assert env["cuda_emulated"] and env["backend"] == "gloo" and env["device"] == "cpu"
    assert any("SyncBN exact over gloo" in n and "nccl→gloo" in n for n in report["notes"])
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][2] == "finished" and rows[1][3] == 8


def test_cuda_syncbn_converted_after_wrapping_is_measured_harmless(probe) -> None:
    report, _, _ = probe("cuda_syncbn_after_wrap")
    f = _by_rule(report)["DD101"]
    assert f["severity"] == "low" and "measured harmless" in f["message"]
    ev = f["evidence"]
    assert ev["syncbn_layers"] == 1 and ev["plain_bn_layers"] == 0
    assert ev["syncbn_params_in_optimizer"] == 1.0 and ev["syncbn_params_in_ddp"] == 1.0
    assert ev["bn_buffers_disagreeing"] == [] and ev["bn_buffers_compared"] == 1
    assert "DD103" not in _by_rule(report)


def test_a_rank_that_raises_is_the_root_cause(probe) -> None:
    report, run_dir, _ = probe("rank_raises")
    f = _by_rule(report)["DD902"]
    assert f["ranks"] == [1] and f["line"] == 14
    root = f["evidence"]["root_cause"]
    assert root["type"] == "ValueError" and "corrupt sample in batch 2 on rank 1" in root["message"]
    assert root["steps"] == 2 and any("check_batch" in line for line in root["traceback"])
    # rank 0, waiting in the next step's all-reduce, fails of the lost peer (gloo: connection closed), unless the
    # launcher's SIGTERM after rank 1's failure reaches it first (as torchrun's agent, it lists only the failed
    # rank): a loaded machine decides which. Either way it is never a root cause.
    consequences = [x for x in f["evidence"]["failures"] if not x["root_cause"]]
    assert [x["rank"] for x in consequences] in ([0], []) and all(x["peer_caused"] for x in consequences)
    assert "DD901" not in _by_rule(report) and not _timed_out(run_dir)  # the failure ended the run


def test_a_native_abort_is_the_root_cause_not_the_peer(probe) -> None:
    report, _, _ = probe("collective_mismatch")
    f = _by_rule(report)["DD902"]
    assert f["ranks"] == [0] and f["line"] == 23
    assert f["evidence"]["root_cause"]["signal"] == "SIGABRT"
    assert "collective mismatch" in f["message"]
    # rank 1 fails of the aborted peer unless the launcher's SIGTERM reaches it first (a loaded machine decides;
    # seen in a run of the suite on torch 2.11): listed, it is peer-caused; never a root cause
    others = [x for x in f["evidence"]["failures"] if x["rank"] != 0]
    assert [x["rank"] for x in others] in ([1], []) and all(x["peer_caused"] for x in others), others


def _timed_out(run_dir: Path) -> bool:
    import json

    return bool(json.loads((run_dir / "launcher.json").read_text())["timed_out"])


def _steps_per_rank(report: dict) -> dict[int, int]:
    """Optimizer steps each rank recorded, from the report's rank table (none: no rank recorded anything)."""
    rows = report.get("tables", {}).get("ranks", {}).get("rows", [])
    return {row[0]: row[3] for row in rows}


def _stepped(report: dict) -> bool:
    steps = _steps_per_rank(report)
    return len(steps) == 2 and min(steps.values()) >= 1


def _once_the_ranks_stepped(probe, name: str, timeouts: tuple[int, ...], until: Any = _stepped,
                            **options: Any) -> tuple[dict, Path, float, int]:
    """Probe `name` with the first timeout; if the ranks had not got as far as the test needs (`until`: by default
    a step on every rank) before it hit (a loaded machine can spend any fixed timeout starting the ranks), again
    with the next. What the test then holds to is what the ranks did."""
    for timeout in timeouts:
        report, run_dir, wall = probe(name, timeout=timeout, **options)
        if until(report):
            break
    return report, run_dir, wall, timeout


def test_a_rank_stuck_in_a_collective_is_a_hang_with_stacks(probe) -> None:
    def both_waited(report: dict) -> bool:  # not only stepped: the steps came long enough before the timeout
        rows = report.get("tables", {}).get("ranks", {}).get("rows", [])
        return _stepped(report) and {row[2] for row in rows} == {"stuck"}

    report, run_dir, wall, timeout = _once_the_ranks_stepped(probe, "stuck_collective", (15, 45, 135),
                                                             until=both_waited)
    f = _by_rule(report)["DD901"]
    stuck = {s["rank"]: s for s in f["evidence"]["stuck"]}
    assert set(stuck) == {0, 1}
    assert stuck[0]["blocked_in"]["function"] == "recv" and stuck[0]["user_frame"]["line"] == 29
    assert stuck[1]["user_frame"]["line"] in (23, 24, 25)  # waiting for rank 0 in the next step's collectives
    assert f["line"] == 29 and "timeout" in f["message"]
    assert wall >= timeout  # stopped by the timeout, not before
    assert "DD902" not in _by_rule(report)


def test_a_stall_after_the_probe_ended_the_peers_is_not_called_the_scripts_hang(probe) -> None:
    """Rank 0's rank-only eval forward through DDP pairs, in the script's own run, with the other ranks' next
    training forward; the probe's epoch limit ends rank 1 first, so rank 0 waits in the last one until the
    timeout (issue 20: DD901 critical, first, on KAIR's trainer, above the run's real sampler finding)."""
    def rank1_ended(report: dict) -> bool:  # under load the timeout can hit while rank 1 still steps or exits,
        # or soon after rank 0 reached its last step, before it had waited long enough to be told stuck
        rows = {row[0]: row for row in report.get("tables", {}).get("ranks", {}).get("rows", [])}
        return _stepped(report) and str(rows[1][2]).startswith("finished") and rows[0][2] == "stuck"

    report, _, _, _ = _once_the_ranks_stepped(probe, "rank0_eval_through_ddp", (15, 45, 135), until=rank1_ended)
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][2] == "stuck" and rows[1][2].startswith("finished"), rows
    found = _by_rule(report)
    assert "DD902" not in found
    # the last observed step (4 per epoch) is an evaluation step on rank 0: it waits until the timeout
    assert found["DD901"]["severity"] == "medium" and found["DD901"]["confidence"] == "possible"
    # that the forward runs on rank 0 alone stays certain (static and probe agree); that it hangs is not shown
    assert found["DD206"]["severity"] == "medium"
    for code in ("DD901", "DD206"):
        assert "ended by the probe" in found[code]["message"]


def test_a_slow_run_that_runs_out_of_time_is_not_a_hang(probe, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 0.15 × the timeout (1.5 s at 10 s): the 8 planned steps never fit, so both ranks are still training
    when it hits. Not DD901: a note with the steps observed and the timeout that would cover the run; the other
    analyses run on what was recorded. A loaded machine can spend the whole timeout starting the ranks: then the
    run is repeated with twice the timeout (and steps twice as slow) until the ranks have stepped — what the test
    holds to is what the ranks did, not how long the machine took."""
    import json

    for timeout in (10, 20, 40, 80, 160):
        monkeypatch.setenv("SLOW_STEP_SECONDS", str(0.15 * timeout))
        report, run_dir, wall = probe("slow_steps", timeout=timeout)
        steps = _steps_per_rank(report)
        if len(steps) == 2 and min(steps.values()) >= 1:
            break
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    found = _by_rule(report)
    assert not {"DD901", "DD206", "DD902"} & set(found), [found[r]["message"] for r in found]
    assert "DD202" in found  # 8 samples per rank through a local BatchNorm, measured on the recorded steps
    note = next(n for n in report["notes"] if "timeout ended the run" in n)
    assert "not a hang" in note and "rerun with --timeout" in note
    assert rows[0][2] == rows[1][2] == "running at timeout" and rows[0][3] >= 1
    # the launcher kept a copy of the script: the run directory is analysed the same elsewhere
    meta = json.loads((run_dir / "meta.json").read_text())
    script = REPO / "fixtures" / "probe" / "slow_steps.py"
    # (and any project file the run names: common.py too when a rank's stack at the timeout was inside it — the
    # moment decides; seen in a fresh-clone run)
    assert meta["sources"][str(script)] == "source/fixtures/probe/slow_steps.py"
    common = str(REPO / "fixtures" / "probe" / "common.py")
    assert set(meta["sources"]) <= {str(script), common}, meta["sources"]
    assert all((run_dir / copy).is_file() for copy in meta["sources"].values())
    assert (run_dir / "source" / "fixtures" / "probe" / "slow_steps.py").read_text() == script.read_text()
    assert wall >= timeout  # stopped by the timeout, not before


def test_a_rank_slow_to_start_is_the_run_running_out_of_time_not_a_hang(probe) -> None:
    """slow_start.py: rank 1 is still starting when the timeout hits, rank 0 waits for it in the rendezvous (or has
    not got there either, or neither rank has recorded anything: what a loaded machine does with any timeout).
    Every one of those is the run cut short — a note, no DD901, nothing about the script — the same at any load;
    and since no rank took a step, DD904 says that nothing that needs training was measured (never "No findings")."""
    report, _, wall = probe("slow_start", timeout=40)
    found = _by_rule(report)
    assert not {"DD901", "DD902"} & set(found), [found[r]["message"] for r in found]
    assert "no optimizer step was observed" in found["DD904"]["message"]
    note = next(n for n in report["notes"] if "timeout ended the run" in n)
    assert "not a hang" in note and "rerun with a longer --timeout" in note
    assert wall >= 40


def test_a_script_that_never_initialises_a_process_group(probe) -> None:
    report, _, _ = probe("not_distributed")
    f = _by_rule(report)["DD903"]
    assert f["severity"] == "info" and f["evidence"]["optimizer_steps"] == [8, 8]


def _recorded(run_dir: Path, kind: str) -> set[int]:
    """Ranks whose event log holds an event of this kind (complete lines only: the log is being written)."""
    import json

    ranks: set[int] = set()
    for log in (run_dir / "events").glob("*.jsonl"):
        try:
            lines = log.read_text(encoding="utf-8").splitlines(keepends=True)
        except OSError:
            continue
        for line in lines:
            if line.endswith("\n") and f'"kind":"{kind}"' in line:
                event = json.loads(line)
                if event.get("rank") is not None:
                    ranks.add(int(event["rank"]))
    return ranks


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find leftover processes")
def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    """Ctrl-C once both ranks have taken an optimizer step (they are in the run, rank 0 about to wait forever):
    exit 2, nothing left. Sent at that state, however long the machine takes to reach it."""
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark}
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpdoctor", "check", "fixtures/probe/stuck_collective.py", "--timeout", "600",
         "--keep-run", str(run_dir)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        while proc.poll() is None and _recorded(run_dir, "optimizer_step") != {0, 1}:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert len(_marked_processes(mark)) >= 4  # ddpdoctor, the supervisor, the agent, two ranks
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        leftover = _marked_processes(mark)
        _kill_marked(mark)
    assert "Traceback" not in err
    assert proc.returncode == 2 and "interrupted" in err
    assert leftover == []
    import json

    launch = json.loads((run_dir / "launcher.json").read_text())
    assert launch["interrupted"] and not launch["timed_out"] and len(launch["killed"]) >= 3


def test_loader_worker_processes_are_cut_and_stopped(probe) -> None:
    report, run_dir, _ = probe("loader_workers")
    mine = {"DD101", "DD102", "DD103", "DD104", "DD301", "DD302", "DD901", "DD902", "DD903"}
    assert not mine & set(_by_rule(report))
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][2] == "finished" and rows[0][3] == 8 and rows[1][3] == 8
    out = (run_dir / "logs" / "rank0.stdout").read_text().splitlines()
    assert out == ["epoch 0 validated 32", "epoch 1 validated 32"]  # evaluation kept its (short) passes


def _hold_port() -> tuple[Any, int]:
    """A listening socket on a fixed-looking loopback port, as another job on this machine would hold it."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock, int(sock.getsockname()[1])


def test_a_script_that_spawns_behind_a_flag_is_started_once(probe) -> None:
    """pytorch/examples imagenet's launch: with --multiprocessing-distributed the script spawns its ranks; launched
    under torchrun it made 4 processes, a hang until the timeout and a false DD104. Its fixed --dist-url port is
    held by another socket: the probe's ranks must meet elsewhere."""
    import json

    sock, port = _hold_port()
    try:
        report, run_dir, wall = probe("spawn_behind_flag", "--multiprocessing-distributed", "--world-size", "1",
                                      "--rank", "0", "--dist-url", f"tcp://127.0.0.1:{port}")
    finally:
        sock.close()
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["mode"] == "spawn" and "--multiprocessing-distributed given" in meta["plan"]["reason"]
    roles = sorted(json.loads(p.read_text().splitlines()[0])["role"] for p in (run_dir / "events").glob("*.jsonl"))
    assert roles == ["main", "spawned", "spawned"]
    found = _by_rule(report)
    assert not {"DD104", "DD901", "DD902", "DD903"} & set(found), [found[r]["message"] for r in found]
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    # 96 samples, 8 per rank (the script divides its batch of 16 by the 2 GPUs), 4 steps kept per epoch
    assert rows[0][2] == rows[1][2] == "finished" and rows[0][3] == rows[1][3] == 8
    assert any(f"tcp://127.0.0.1:{port} was moved to tcp://127.0.0.1:" in n for n in report["notes"])
    assert not _timed_out(run_dir)


def test_the_same_script_without_the_flag_runs_under_torchrun(probe) -> None:
    report, run_dir, _ = probe("spawn_behind_flag", "--dist-url", "env://")
    import json

    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["mode"] == "torchrun" and "--multiprocessing-distributed not given" in meta["plan"]["reason"]
    assert not {"DD104", "DD901", "DD902", "DD903"} & set(_by_rule(report))
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][3] == rows[1][3] == 6  # 16 per rank: 3 steps per epoch × 2 epochs


def test_a_script_whose_main_process_needs_a_launcher_is_relaunched_under_torchrun(probe) -> None:
    report, run_dir, _ = probe("spawn_decided_at_runtime")
    import json

    meta = json.loads((run_dir / "meta.json").read_text())
    launch = json.loads((run_dir / "launcher.json").read_text())
    assert meta["mode"] == "torchrun" and meta["plan"]["decided_at_runtime"]
    decision = meta["plan"]["runtime_decision"]
    assert decision["mode"] == "torchrun" and decision["site"]["line"] == 48
    assert "init_process_group reads RANK and WORLD_SIZE" in decision["reason"]
    assert launch["first_launch"]["returncode"] == 75 and launch["first_launch"]["mode"] == "spawn"
    roles = sorted(json.loads(p.read_text().splitlines()[0])["role"] for p in (run_dir / "events").glob("*.jsonl"))
    assert roles == ["rank", "rank"]  # the first launch's events are gone
    rows = {row[0]: row for row in report["tables"]["ranks"]["rows"]}
    assert rows[0][3] == rows[1][3] == 8
    assert any("relaunched under torchrun" in n for n in report["notes"])
    assert not {"DD104", "DD901", "DD902", "DD903"} & set(_by_rule(report))
    assert not launch["timed_out"]


def test_a_ddp_wrapped_ema_teacher_and_multi_crop_forwards_are_not_gradient_accumulation(probe) -> None:
    """DINO (lab trial): student and EMA teacher both DDP models, the teacher's parameters frozen after the wrap,
    the student forwarded once per crop, one backward per step. DD215 read the forwards as 2-step gradient
    accumulation (a false alarm on DINO); the same script with real accumulation (two backward passes per step)
    keeps DD215 and DD403."""
    report, _, _ = probe("ema_teacher_ddp")
    rules = {f["rule"] for f in report["findings"]}
    assert not {"DD215", "DD403"} & rules, report["findings"]
    assert any(n.startswith("static DD403") and "cleared by the probe" in n for n in report["notes"]), report["notes"]
    report, _, _ = probe("ema_teacher_ddp", "--accumulate")
    found = _by_rule(report)
    assert found["DD215"]["evidence"]["micro_batches"] == 2 and "2 micro-batches (backward passes)" in found[
        "DD215"]["message"]
    assert "DD403" in found
