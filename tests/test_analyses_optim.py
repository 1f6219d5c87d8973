"""Optimisation analyses (DD402–DD406) replayed from recorded probe runs (fixtures/runs/optim_*, recorded by
tests/test_probe_optim.py from fixtures/probe/optim/), plus edge cases built as event logs by hand."""

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
RULES = ("DD402", "DD403", "DD404", "DD405", "DD406")
SITE = {"file": "/w/train.py", "line": 30, "function": "<module>"}
# `where` of the internal_error events the optimisation-health recorder can produce
OPTIM_HEALTH_WHERE = {"install optim_health", "loss module", "backward", "train_step", "grad collective",
                      "grad collective norm", "step hook install.<locals>.optim_health_after_step"}


def probe_findings(run: str | Path, rule: str, **overrides: Any) -> list:
    path = run if isinstance(run, Path) else RUNS / run
    return [f for f in analyze_run(path, overrides=overrides).findings if f.rule == rule]


def make_run(
    tmp_path: Path, per_rank: dict[int, list[dict[str, Any]]], static: list | None = None, **meta: Any
) -> Path:
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"schema": SCHEMA, "script": "train.py", "script_abs": "/w/train.py",
                                               "cwd": "/w", "nproc": len(per_rank), **meta}))
    if static is not None:
        (run / "static.json").write_text(json.dumps(static))
    for r, evs in per_rank.items():
        pid = 100 + r
        head = [{"kind": "process_start", "role": "rank"},
                {"kind": "pg_init", "ok": True, "rank": r, "world_size": len(per_rank)}]
        lines = [{"t": 1.0 + i, "pid": pid, "seq": i + 1, "rank": r, **e} for i, e in enumerate(head + evs)]
        (run / "events" / f"vm-p{pid}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return run


def lr_run(tmp_path: Path, lrs: list[float], initial: float | None = None, **kw: Any) -> Path:
    evs: list[dict[str, Any]] = [{"kind": "optimizer_init", "opt": 1, "cls": "SGD", "site": SITE,
                                  "groups": [{"lr": lrs[0], "numel": 10}]}]
    for i, lr in enumerate(lrs, 1):
        evs.append({"kind": "train_step", "step": i, "opt": 1, "initial_lrs": [initial]})
        evs.append({"kind": "optimizer_step", "opt": 1, "step": i, "lrs": [lr]})
    return make_run(tmp_path, {0: evs}, **kw)


# ------------------------------------------------------------------------------------------------ DD402


def test_dd402_scaled_lr_from_the_first_step() -> None:
    (f,) = probe_findings("optim_accumulate_hand_reduce", "DD402")
    assert f.evidence["ratio"] == pytest.approx(4.0) and f.evidence["lr_trace"] == [0.4] * 8
    assert f.evidence["base_lr"] == 0.1 and f.line == 22 and f.severity == Severity.LOW
    assert "4× the reference recipe's lr 0.1" in f.message


def test_dd402_silent_with_a_warmup_or_below_4x() -> None:
    assert probe_findings("optim_good_accumulate", "DD402") == []  # LinearLR ramps from 0.1 to 0.4
    assert probe_findings("optim_accumulate_hand_reduce", "DD402", base_lr=0.2) == []  # 2x only


def test_dd402_uses_the_static_finding_when_no_recipe_is_given(tmp_path: Path) -> None:
    static = [{"rule": "DD402", "name": "no-warmup", "severity": "low", "confidence": "likely", "source": "static",
               "file": "train.py", "line": 12, "message": "lr * world_size", "fix": "warm up", "evidence": {}}]
    (f,) = probe_findings(lr_run(tmp_path, [0.8, 0.8, 0.8], static=static), "DD402")
    assert f.evidence["scaled_per_static_analysis"] is True and "train.py:12" in f.message
    merged = [m for m in report_run(tmp_path / "run").findings if m.rule == "DD402"]
    assert len(merged) == 1 and merged[0].sources == ("static", "probe") and merged[0].confidence == Confidence.CERTAIN
    assert probe_findings(lr_run(tmp_path / "x", [0.8, 0.8]), "DD402") == []  # neither recipe nor static finding


def test_dd402_a_scheduler_target_above_the_first_lr_is_a_warmup(tmp_path: Path) -> None:
    assert probe_findings(lr_run(tmp_path, [0.1, 0.1, 0.1], initial=0.8, base_lr=0.1), "DD402") == []
    (f,) = probe_findings(lr_run(tmp_path / "d", [0.8, 0.7, 0.6], initial=0.8, base_lr=0.1), "DD402")
    assert "only decays" in f.message and f.magnitude == pytest.approx(8.0)


# ------------------------------------------------------------------------------------------------ DD403


def test_dd403_every_micro_step_all_reduces() -> None:
    (f,) = probe_findings("optim_accumulate_hand_reduce", "DD403")
    assert f.evidence["backwards_per_step"] == [2] * 8
    assert f.evidence["allreducing_backwards_per_step"] == [2] * 8
    assert f.evidence["gradient_elements"] == 227 and f.line == 29
    (merged,) = [m for m in report_run(RUNS / "optim_accumulate_hand_reduce").findings if m.rule == "DD403"]
    assert merged.sources == ("static", "probe") and merged.confidence == Confidence.CERTAIN


def test_dd403_silent_under_no_sync() -> None:
    assert probe_findings("optim_good_accumulate", "DD403") == []


# ------------------------------------------------------------------------------------------------ DD404


def test_dd404_hand_sum_doubles_the_gradient() -> None:
    (f,) = probe_findings("optim_accumulate_hand_reduce", "DD404")
    assert f.severity == Severity.HIGH
    assert f.evidence["gradient_ratio_optimizer_vs_ddp"] == pytest.approx(2.0, rel=1e-5)
    assert f.evidence["parameters_reduced"] == 4 and f.evidence["elements_reduced"] == 227
    assert f.evidence["first_calls"][0]["norm_after"] == pytest.approx(2 * f.evidence["first_calls"][0]["norm_before"])
    assert f.line == 32 and "2× what DDP produced" in f.message
    (merged,) = [m for m in report_run(RUNS / "optim_accumulate_hand_reduce").findings if m.rule == "DD404"]
    assert merged.sources == ("static", "probe")


def test_dd404_silent_for_collectives_on_other_tensors() -> None:
    assert probe_findings("optim_good_accumulate", "DD404") == []  # all_reduce of the logged loss


def test_dd404_divided_again_is_low(tmp_path: Path) -> None:
    hand = {"params": 2, "numel": 8, "ops": ["all_reduce"], "sites": [SITE], "after_ddp": 2, "ratio_median": 1.0}
    evs = [{"kind": "train_step", "step": 1, "opt": 1, "hand_reduced": hand},
           {"kind": "grad_collective", "op": "all_reduce", "site": SITE, "param": "w", "after_ddp": True}]
    (f,) = probe_findings(make_run(tmp_path, {0: evs, 1: evs}), "DD404")
    assert f.severity == Severity.LOW and "divided again" in f.message


# ------------------------------------------------------------------------------------------------ DD405


def test_dd405_identically_zero_loss() -> None:
    (f,) = probe_findings("optim_zero_loss", "DD405")
    assert f.ranks == (0, 1) and f.line == 25
    rank0 = f.evidence["per_rank"]["0"]
    assert rank0["loss_constant"] and rank0["loss_hex"] == "0x0.0p+0" and rank0["losses_seen"] == 8
    assert rank0["all_grads_zero_or_none"] and rank0["grads_zero"] == [4] * 8


def test_dd405_silent_when_learning() -> None:
    for run in ("optim_good_accumulate", "optim_accumulate_hand_reduce", "optim_corrupt_sample"):
        assert probe_findings(run, "DD405") == []


def test_dd405_gradients_none_at_every_step(tmp_path: Path) -> None:
    steps = [{"kind": "train_step", "step": i, "opt": 1, "losses": [[0.5 + i, (0.5 + i).hex()]],
              "grads": {"params": 3, "none": 3, "zero": 0}} for i in range(1, 4)]
    (f,) = probe_findings(make_run(tmp_path, {0: steps}), "DD405")
    assert "none of the optimizer's 3 parameters had a gradient" in f.message
    assert f.evidence["per_rank"]["0"]["loss_constant"] is False


# ------------------------------------------------------------------------------------------------ DD406


def test_dd406_first_step_rank_and_tensor() -> None:
    (f,) = probe_findings("optim_corrupt_sample", "DD406")
    assert f.evidence["first"] == {"rank": 1, "step": 3, "tensor": "loss", "names": ["output of the loss module"],
                                   "count": 1, "total": 1, "value": "nan"}
    assert f.ranks == (0, 1)
    assert {e["tensor"] for e in f.evidence["events"]} == {"loss", "grad", "param", "running_var", "running_mean"}
    assert "step 3 on rank 1" in f.message and "in the same step" in f.message


def test_dd406_silent_on_finite_runs() -> None:
    for run in ("optim_good_accumulate", "optim_zero_loss", "optim_accumulate_hand_reduce"):
        assert probe_findings(run, "DD406") == []


def test_no_internal_errors_from_the_optimisation_recorder() -> None:
    for run in ("optim_good_accumulate", "optim_zero_loss", "optim_accumulate_hand_reduce", "optim_corrupt_sample"):
        for log in (RUNS / run / "events").glob("*.jsonl"):
            for line in log.read_text().splitlines():
                e = json.loads(line)
                assert not (e["kind"] == "internal_error" and e.get("where") in OPTIM_HEALTH_WHERE), e


def test_dd405_names_a_cross_entropy_over_a_single_output(tmp_path: Path) -> None:
    module = {"cls": "CrossEntropyLoss", "input_shape": [32, 1], "reduction": "mean"}
    steps = [{"kind": "train_step", "step": i, "opt": 1, "losses": [[0.0, "0x0.0p+0"]], "loss_module": module,
              "grads": {"params": 2, "none": 0, "zero": 2}} for i in range(1, 4)]
    (f,) = probe_findings(make_run(tmp_path, {0: steps, 1: steps}), "DD405")
    assert "CrossEntropyLoss over a single output (input shape [32, 1])" in f.message
    assert f.evidence["per_rank"]["1"]["loss_module"] == module
