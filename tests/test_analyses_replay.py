"""Replay: the analyses re-run on probe runs recorded from the fixture scripts (fixtures/runs/probe_*, recorded by
python -m ddpdoctor.dev.record). Pure and fast: no process is started, no torch is imported."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ddpdoctor.analyses import analyze_run, load_static_findings
from ddpdoctor.check import report_run
from ddpdoctor.errors import UsageError
from ddpdoctor.findings import Finding, Severity

RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "runs"


def _probe(name: str, **overrides) -> dict[str, Finding]:
    result = analyze_run(RUNS / f"probe_{name}", overrides=overrides or None)
    assert not [n for n in result.notes if "analysis" in n and "failed" in n], result.notes
    return {f.rule: f for f in result.findings}


def test_replay_needs_no_torch() -> None:
    import subprocess

    code = (
        "import sys; from pathlib import Path; from ddpdoctor.analyses import analyze_run; "
        f"analyze_run(Path({str(RUNS / 'probe_forward_bypass')!r})); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_dd301_missing_set_epoch() -> None:
    f = _probe("missing_set_epoch")["DD301"]
    assert (f.file, f.line, f.ranks, f.severity) == ("fixtures/probe/missing_set_epoch.py", 16, (0, 1), Severity.HIGH)
    assert f.evidence["per_rank"]["0"]["position_identity_epoch0_vs_1"] == 1.0
    assert "set_epoch was never called" in f.message and f.magnitude == 1.0


def test_dd302_no_distributed_sampler() -> None:
    found = _probe("no_distributed_sampler")
    f = found["DD302"]
    assert f.evidence["overlap_fraction"] == 1.0 and f.evidence["identical_batches_fraction"] == 1.0
    assert f.line == 14 and "DD301" not in found


def test_dd102_dd103_forward_bypass() -> None:
    found = _probe("forward_bypass")
    assert found["DD102"].severity == Severity.CRITICAL and found["DD102"].line == 26
    assert "8 forwards in 8 optimizer steps on each of ranks 0, 1" in found["DD102"].message
    d = found["DD103"]
    assert d.evidence["first_step"] == 1 and d.evidence["steps_compared"] == 8
    assert d.evidence["max_abs_diff_final"] == pytest.approx(d.magnitude) and d.magnitude > 1e-3
    assert all(t["ranks_differing"] == [1] for t in d.evidence["trace"])
    assert "DD301" not in found


def test_dd401_follows_the_reference_recipe_and_the_rule() -> None:
    f = _probe("unscaled_lr")["DD401"]  # recorded with --base-lr 0.1 --base-batch 16
    assert f.evidence["global_batch"] == 32 and f.evidence["expected_lr"] == pytest.approx(0.2)
    assert f.magnitude == pytest.approx(1.0)  # |log2(0.1 / 0.2)|
    assert "DD401" not in _probe("unscaled_lr", base_lr=0.05, base_batch=16)
    adam_like = _probe("unscaled_lr", base_lr=0.1, base_batch=16, lr_scaling="sqrt")["DD401"]
    assert adam_like.evidence["expected_lr"] == pytest.approx(0.1 * 2**0.5)
    assert "DD401" not in _probe("unscaled_lr", lr_scaling="none")


def test_dd401_without_a_reference_recipe_only_notes_the_global_batch() -> None:
    result = analyze_run(RUNS / "probe_missing_set_epoch")
    assert "DD401" not in {f.rule for f in result.findings}
    assert any("global batch 16 (8 per rank × 2 ranks × 1 accumulation step)" in n for n in result.notes)


def test_dd401_a_measured_match_with_the_scaled_reference_clears_the_static_finding() -> None:
    """unscaled_lr: SGD lr 0.1 on 2 × 16; static says "possible"; a 0.1 @ 32 recipe is the linear match, a
    0.1 @ 16 recipe is off by 2× (the probe's finding merges with the static one instead)."""
    static = [f for f in load_static_findings(RUNS / "probe_unscaled_lr") if f.rule == "DD401"]
    assert [(f.line, f.confidence.label) for f in static] == [(24, "possible")]
    matched = report_run(RUNS / "probe_unscaled_lr", base_lr=0.1, base_batch=32)
    assert "DD401" not in {f.rule for f in matched.findings}
    assert (
        "static DD401 at fixtures/probe/unscaled_lr.py:24 cleared by the probe: SGD lr 0.1 matches the linearly "
        "scaled reference lr 0.1 (0.1 at batch 32; measured global batch 32 = 16 per rank × 2 ranks × 1 "
        "accumulation step)"
    ) in matched.notes
    near = report_run(RUNS / "probe_unscaled_lr", base_lr=0.095, base_batch=32)  # within 10%
    assert any("is within 5% of the linearly scaled reference lr 0.095" in n for n in near.notes)
    off = report_run(RUNS / "probe_unscaled_lr", base_lr=0.1, base_batch=16)
    (f,) = [f for f in off.findings if f.rule == "DD401"]
    assert f.sources == ("static", "probe") and not any("cleared" in n for n in off.notes)
    # 10–25% off: neither measured wrong nor a match: the static finding stays as it is
    between = report_run(RUNS / "probe_unscaled_lr", base_lr=0.085, base_batch=32)
    assert [f.sources for f in between.findings if f.rule == "DD401"] == [("static",)]


def test_dd104_hardcoded_rank() -> None:
    f = _probe("hardcoded_rank")["DD104"]
    assert f.severity == Severity.CRITICAL and f.line == 11
    assert "passes rank=0" in f.message and "launcher's RANK/WORLD_SIZE" in f.message


def test_dd108_legacy_local_rank_measured_as_under_torchrun() -> None:
    found = _probe("legacy_local_rank")
    f = found["DD108"]
    assert f.line == 14 and f.evidence["per_rank"]["1"] == {"default": 0, "value": 0, "LOCAL_RANK": "1"}
    assert not f.evidence["injected_by_probe"] and "parsed --local_rank=0 and never read LOCAL_RANK" in f.message
    assert found["DD105"].evidence["shared_device"] == "cuda:0"
    (top, *_) = report_run(RUNS / "probe_legacy_local_rank").ranked()
    assert top.rule == "DD108" and [c.finding.rule for c in top.consequences] == ["DD105"]


def test_dd108_default_minus_one_is_measured_then_overridden_so_the_run_goes_on() -> None:
    """torchrun leaves the legacy option at -1 on every rank (`.cuda(-1)` would raise before the first step): the
    probe records that, gives each rank its LOCAL_RANK as the legacy launcher did, and measures the rest."""
    found = _probe("legacy_local_rank_minus_one")
    f = found["DD108"]
    assert f.evidence["per_rank"] == {"0": {"default": -1, "value": -1, "LOCAL_RANK": "0"},
                                      "1": {"default": -1, "value": -1, "LOCAL_RANK": "1"}}
    assert f.evidence["overridden_by_probe"] == {"0": 0, "1": 1} and not f.evidence["injected_by_probe"]
    assert "parsed --local_rank=-1 and never read LOCAL_RANK" in f.message and "-1 names no GPU" in f.message
    assert "the probe then gave each rank its LOCAL_RANK instead (rank 0: 0, rank 1: 1)" in f.message
    assert not {"DD902", "DD105", "DD904"} & set(found)
    report = report_run(RUNS / "probe_legacy_local_rank_minus_one")
    (dd108,) = [f for f in report.ranked() if f.rule == "DD108"]
    assert dd108.sources == ("static", "probe")
    steps = {row[0]: row[3] for row in report.tables["ranks"]["rows"]}
    assert steps == {0: 8, 1: 8}


def test_dd108_silent_when_the_script_falls_back_to_local_rank_itself() -> None:
    result = analyze_run(RUNS / "probe_legacy_local_rank_env_fallback")
    assert not {"DD108", "DD105", "DD902"} & {f.rule for f in result.findings}
    assert not load_static_findings(RUNS / "probe_legacy_local_rank_env_fallback") or not [
        f for f in load_static_findings(RUNS / "probe_legacy_local_rank_env_fallback") if f.rule == "DD108"]


def test_dd108_cleared_when_every_rank_binds_its_own_gpu_whatever_the_option_holds() -> None:
    """The ranks all parse --local_rank=0 under torchrun, but the device comes from RANK % device count: each rank
    holds its replica on a GPU of its own, so the static suspicion that the default picks every rank's GPU is
    dropped with the devices measured (and nothing is shared: no DD105)."""
    result = analyze_run(RUNS / "probe_legacy_local_rank_device_from_rank")
    assert not {"DD108", "DD105"} & {f.rule for f in result.findings}
    report = report_run(RUNS / "probe_legacy_local_rank_device_from_rank")
    assert not [f for f in report.ranked() if f.rule == "DD108"]
    (note,) = [n for n in report.notes if n.startswith("static DD108 at ")]
    assert "parsed --local_rank=0" in note and "rank 0 cuda:0, rank 1 cuda:1" in note


def test_dd202_on_shuffle_bn_keeps_per_gpu_bn_and_asks_for_a_larger_batch() -> None:
    """MoCo-v1-style shuffle-BN needs per-GPU statistics: the small per-GPU batch is still reported, but the fix
    must not recommend SyncBatchNorm; a plain small per-GPU batch keeps the SyncBatchNorm advice."""
    found = _probe("shuffle_bn")
    f = found["DD202"]
    shuffle = f.evidence["batch_shuffle"]
    assert shuffle["permutation"] == 8 and shuffle["gather_op"] == "all_gather"
    assert (shuffle["gather_site"]["line"], shuffle["broadcast_site"]["line"]) == (19, 29)
    assert "shuffle-BN" in f.message and "not SyncBatchNorm" in f.message
    assert f.fix.startswith("Keep per-GPU BatchNorm") and "would undo the shuffle" in f.fix
    assert "DD207" not in found
    plain = _probe("device_bound")["DD202"]
    assert "batch_shuffle" not in plain.evidence and "nn.SyncBatchNorm" in plain.fix


def test_dd201_on_shuffle_bn_reconciles_the_buffers_and_keeps_per_gpu_bn() -> None:
    """The key encoder's running statistics diverge across ranks under shuffle-BN: worth reporting (rank 0's
    checkpoint carries rank 0's), but the fix is to average the buffers, never SyncBatchNorm (it was)."""
    f = _probe("shuffle_bn")["DD201"]
    assert f.evidence["batch_shuffle"]["gather_op"] == "all_gather" and "shuffle-BN" in f.message
    assert f.fix.startswith("Keep per-GPU BatchNorm") and "average running_mean and running_var across ranks" in f.fix
    assert "use SyncBatchNorm" not in f.fix


def test_dd108_silent_when_a_helper_reads_local_rank() -> None:
    result = analyze_run(RUNS / "probe_local_rank_from_helper")
    assert not {"DD108", "DD105"} & {f.rule for f in result.findings}
    (c,) = [c for c in result.clearances if c.rule == "DD108"]
    assert "launch_helpers.py:11" in c.reason


def test_self_spawning_run_is_read_by_rank() -> None:
    result = analyze_run(RUNS / "probe_self_spawn")
    assert {f.rule for f in result.findings} >= {"DD301"}
    assert [row[0] for row in result.tables["ranks"]["rows"]] == [0, 1]
    assert result.environment["nproc"] == 2


def test_correct_cuda_syncbn_run_has_nothing_above_low() -> None:
    result = analyze_run(RUNS / "probe_cuda_syncbn_correct")
    assert [f.rule for f in result.findings if f.severity > Severity.LOW] == []
    assert result.environment == {"torch": "2.13.0+cpu", "python": result.environment["python"], "nproc": 2,
                                  "backend": "gloo", "device": "cpu", "cuda_emulated": True}
    assert result.notes[0].startswith("CUDA was emulated on CPU: 2 virtual devices")


def test_dd101_measured_harmless_is_low() -> None:
    f = _probe("cuda_syncbn_after_wrap")["DD101"]
    assert f.severity == Severity.LOW and "measured harmless" in f.message
    assert f.evidence["bn_buffers_disagreeing"] == []


def test_dd902_exception_root_cause() -> None:
    found = _probe("rank_raises")
    f = found["DD902"]
    assert f.ranks == (1,) and f.line == 14
    assert f.message.startswith("rank 1 raised ValueError: corrupt sample in batch 2 on rank 1")
    assert "DD903" not in found and "DD901" not in found


def test_dd902_native_abort_root_cause() -> None:
    f = _probe("collective_mismatch")["DD902"]
    assert f.ranks == (0,) and f.line == 23 and f.evidence["root_cause"]["signal"] == "SIGABRT"


def test_dd901_hang() -> None:
    found = _probe("stuck_collective")
    f = found["DD901"]
    stuck = {s["rank"]: s for s in f.evidence["stuck"]}
    assert stuck[0]["blocked_in"]["function"] == "recv" and stuck[0]["user_frame"]["line"] == 29
    assert f.ranks == (0, 1) and "DD902" not in found


def test_a_slow_run_that_runs_out_of_time_is_not_a_hang() -> None:
    """slow_steps.py: 1.5 s per step, --timeout 10: both ranks were still stepping when the timeout hit. No DD901,
    a note with what was observed and what would cover the run, and the analyses ran on the 4 steps recorded."""
    from ddpdoctor.analyses import build_context
    from ddpdoctor.analyses.outcome import timeout_view

    result = analyze_run(RUNS / "probe_slow_steps")
    found = {f.rule for f in result.findings}
    assert not {"DD901", "DD206", "DD902"} & found
    assert "DD202" in found  # measured on the recorded steps: 8 samples per rank through a local BatchNorm
    note = next(n for n in result.notes if "timeout ended the run" in n)
    assert note.startswith("the probe's 10 s timeout ended the run while ranks 0, 1 were still making progress — "
                           "not a hang: 4 optimizer steps per rank observed")
    assert "about 1.5 s per step" in note
    assert "to observe all 2 epochs × 4 steps, rerun with --timeout 40 (or keep this timeout with --steps 1)" in note
    assert [row[2:4] for row in result.tables["ranks"]["rows"]] == [["running at timeout", 4]] * 2
    view = timeout_view(build_context(RUNS / "probe_slow_steps"))
    assert view.pace == pytest.approx(1.5, abs=0.1) and view.at - view.launched == pytest.approx(10.0)
    assert all(r.state == "running" and r.silent < r.allowance for r in view.ranks.values())


def test_dd903_not_distributed() -> None:
    f = _probe("not_distributed")["DD903"]
    assert f.severity == Severity.INFO and "never initialised a process group" in f.message


def test_report_reproduces_the_merged_check_report(tmp_path: Path) -> None:
    from ddpdoctor.cli import main

    out = tmp_path / "r.json"
    main(["report", str(RUNS / "probe_missing_set_epoch"), "--format", "json", "--output", str(out)])
    report = json.loads(out.read_text())
    dd301 = next(f for f in report["findings"] if f["rule"] == "DD301")
    assert dd301["sources"] == ["static", "probe"]  # the static finding recorded with the run merged in
    assert report["target"]["script"] == "fixtures/probe/missing_set_epoch.py"
    assert load_static_findings(RUNS / "probe_missing_set_epoch")
    direct = report_run(RUNS / "probe_missing_set_epoch", select=("DD3",)).to_json()
    assert {f["rule"] for f in direct["findings"]} == {"DD301"}


def test_bad_run_directories_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a ddpdoctor run directory"):
        analyze_run(tmp_path)
    with pytest.raises(UsageError, match="not a directory"):
        analyze_run(tmp_path / "nope")
    (tmp_path / "meta.json").write_text("{broken")
    with pytest.raises(UsageError, match="unreadable"):
        analyze_run(tmp_path)


def test_recorded_runs_use_only_documented_event_kinds_and_fields() -> None:
    """events.EVENT_KINDS is the one list: every kind and field a recorded run holds is documented there."""
    from ddpdoctor.events import BASE_FIELDS, EVENT_KINDS

    problems = []
    for log in sorted(RUNS.glob("*/events/*.jsonl")):
        for line in log.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            event = json.loads(line)
            kind = EVENT_KINDS.get(event["kind"])
            if kind is None:
                problems.append(f"{log.parent.parent.name}: undocumented kind {event['kind']}")
                continue
            extra = set(event) - set(BASE_FIELDS) - set(kind.fields)
            if extra:
                problems.append(f"{log.parent.parent.name}: {event['kind']} has undocumented {sorted(extra)}")
    assert sorted(set(problems)) == []


# ---------------------------------------------------------------------------------------------- relocated runs

ELSEWHERE = "/nonexistent/another/machine"


def _relocated(tmp_path: Path, name: str) -> Path:
    """A copy of a recorded run as another machine holds it: every path under the recording's working directory
    (the script, the recording checkout of ddpdoctor, its venv) moved under a prefix that does not exist."""
    import shutil

    src = RUNS / name
    dst = tmp_path / name
    shutil.copytree(src, dst)
    recorded_cwd = json.loads((src / "meta.json").read_text())["cwd"]
    assert not Path(ELSEWHERE).exists()
    for f in dst.rglob("*"):
        if f.is_file() and f.suffix != ".bin" and "source" not in f.relative_to(dst).parts:
            text = f.read_text(encoding="utf-8")
            f.write_text(text.replace(recorded_cwd, ELSEWHERE), encoding="utf-8")
    assert recorded_cwd not in (dst / "meta.json").read_text()
    return dst


def _shown(findings) -> list[tuple]:
    return sorted((f.rule, f.file, f.line, f.ranks, f.severity.label, f.confidence.label, f.message)
                  for f in findings)


def test_a_recorded_run_is_analysed_the_same_on_another_machine(tmp_path: Path, monkeypatch) -> None:
    """bn_rank0_eval_hang moved where its recorded paths do not exist, replayed from another working directory:
    the same findings on the same lines — DD206 included, which parses the script around the stuck frame from
    the copy the launcher kept in the run directory."""
    here = analyze_run(RUNS / "bn_rank0_eval_hang")
    moved = _relocated(tmp_path, "bn_rank0_eval_hang")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    there = analyze_run(moved)
    assert _shown(there.findings) == _shown(here.findings)
    assert there.notes == here.notes
    dd206 = next(f for f in there.findings if f.rule == "DD206")
    assert (dd206.file, dd206.line, dd206.evidence["stuck"][0]["branch_test"]) == (
        "fixtures/probe/bn/final_eval.py", 80, "rank == 0")
    copy = moved / "source" / "fixtures" / "probe" / "bn" / "final_eval.py"
    assert copy.read_text() == (RUNS.parent / "probe" / "bn" / "final_eval.py").read_text()
    assert there.sources == {"fixtures/probe/bn/final_eval.py": copy.resolve()}
    merged_here = report_run(RUNS / "bn_rank0_eval_hang").to_json()["findings"]
    merged_there = report_run(moved).to_json()["findings"]
    assert [(f["rule"], f["file"], f["line"], f["message"]) for f in merged_there] == [
        (f["rule"], f["file"], f["line"], f["message"]) for f in merged_here]
    # the copy is what makes it work: without it, nothing on this machine holds the script
    import shutil

    shutil.rmtree(moved / "source")
    assert "DD206" not in {f.rule for f in analyze_run(moved).findings}


def test_a_run_without_copies_reads_the_recorded_paths(tmp_path: Path, monkeypatch) -> None:
    """Runs recorded before the copies were kept: the source is read where it was recorded, or at the same path
    relative to this working directory (a clone of the recording checkout)."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(RUNS / "bn_rank0_eval_hang", old)
    shutil.rmtree(old / "source")
    meta = json.loads((old / "meta.json").read_text())
    del meta["sources"]
    (old / "meta.json").write_text(json.dumps(meta))
    monkeypatch.chdir(RUNS.parents[1])
    dd206 = next(f for f in analyze_run(old).findings if f.rule == "DD206")
    assert dd206.line == 80


def test_inline_suppressions_are_read_from_the_kept_copy(tmp_path: Path, monkeypatch) -> None:
    """`ddpdoctor report` away from the user's tree honours `# ddpdoctor: ignore[...]` through the run's copy."""
    moved = _relocated(tmp_path, "bn_rank0_eval_hang")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    dd206 = next(f for f in report_run(moved).to_json()["findings"] if f["rule"] == "DD206")
    copy = moved / "source" / "fixtures" / "probe" / "bn" / "final_eval.py"
    lines = copy.read_text().splitlines()
    lines[dd206["line"] - 1] += "  # ddpdoctor: ignore[DD206]"
    copy.write_text("\n".join(lines) + "\n")
    assert "DD206" not in {f["rule"] for f in report_run(moved).to_json()["findings"]}


def test_dd110_model_not_wrapped_is_the_root_cause() -> None:
    found = _probe("model_not_wrapped")
    f = found["DD110"]
    assert f.severity == Severity.CRITICAL
    assert (f.file, f.line, f.ranks) == ("fixtures/probe/model_not_wrapped.py", 24, (0, 1))
    assert f.evidence["replicas_diverged"] is True and f.evidence["first_diverged_step"] == 1
    assert f.evidence["data_sharded_by"] == "DistributedSampler" and f.magnitude > 1e-3
    assert "never wrapped in DistributedDataParallel" in f.message and "differed from step 1" in f.message
    assert "DD903" not in found and "DD103" not in found
    report = report_run(RUNS / "probe_model_not_wrapped")
    top = report.ranked()[0]
    assert top.rule == "DD110" and "static" in top.sources, [g.rule for g in report.ranked()]
    folded = {c.finding.rule for c in top.consequences}
    assert folded and folded <= {"DD103", "DD201", "DD203"}
    assert not folded & {f.rule for f in report.findings}


def test_dd110_silent_when_the_script_averages_gradients_itself() -> None:
    found = _probe("grads_averaged_by_hand")
    assert not {"DD110", "DD903", "DD404", "DD103"} & set(found), {r: f.message for r, f in found.items()}


def test_dd105_ranks_share_the_current_device() -> None:
    found = _probe("device_not_bound")
    f = found["DD105"]
    assert f.ranks == (0, 1) and f.severity == Severity.HIGH and f.line == 15
    assert f.evidence["shared_device"] == "cuda:0"
    assert {r: v["params"] for r, v in f.evidence["per_rank"].items()} == {"0": "cuda:0", "1": "cuda:0"}
    assert {v["inputs"] for v in f.evidence["per_rank"].values()} == {"cuda:0"}
    assert "hold their DDP replica on cuda:0 and feed their batches there" in f.message


def test_dd105_silent_and_cleared_when_each_rank_has_its_device() -> None:
    result = analyze_run(RUNS / "probe_device_bound")
    assert "DD105" not in {f.rule for f in result.findings}
    (clearance,) = [c for c in result.clearances if c.rule == "DD105"]
    assert "rank 0 cuda:0, rank 1 cuda:1" in clearance.reason


def test_dd207_silent_on_a_momentum_encoder_and_firing_on_the_real_evaluation() -> None:
    result = analyze_run(RUNS / "probe_momentum_encoder")
    assert "DD207" not in {f.rule for f in result.findings}
    assert any("momentum / EMA / teacher encoder" in n and "momentum_encoder.py:35" in n for n in result.notes)
    assert [c.line for c in result.clearances if c.rule == "DD207"] == [35]

    f = _probe("momentum_encoder_eval_bug")["DD207"]
    assert f.line == 46 and f.ranks == (0, 1)
    assert [s["line"] for s in f.evidence["sites"]] == [46]


def test_dd202_message_follows_its_numbers() -> None:
    f = _probe("small_bn_batch_uniform_data")["DD202"]
    noise = f.evidence["batch_noise"]
    assert noise["rank_vs_global_mean"] < 0.05 and noise["rank_vs_global_var"] < 0.05
    assert f.severity == Severity.LOW and "noisy batch statistics in training" not in f.message
    assert "stayed close to the global batch's" in f.message


def test_static_lr_suspicions_are_settled_by_the_lr_the_ranks_used() -> None:
    dd401 = report_run(RUNS / "probe_lr_set_in_loop")
    assert "DD401" not in {f.rule for f in dd401.findings}
    (note,) = [n for n in dd401.notes if n.startswith("static DD401")]
    assert "never the 0.001 the optimizer was constructed with" in note and "5.00e-05 → 4.00e-04" in note
    assert any("AdamW lr 5.00e-05 → 4.00e-04 over 8 observed steps" in n for n in dd401.notes)

    dd402 = report_run(RUNS / "probe_warmup_in_loop")
    assert "DD402" not in {f.rule for f in dd402.findings}
    assert any(n.startswith("static DD402") and "ramps up: 0.01, 0.02" in n for n in dd402.notes)


def test_dd207_silent_on_a_precise_bn_recalibration() -> None:
    result = analyze_run(RUNS / "probe_precise_bn")
    assert "DD207" not in {f.rule for f in result.findings}
    assert any("momentum None" in n and "precise BN" in n for n in result.notes)
    assert [c.line for c in result.clearances if c.rule == "DD207"] == [30]
