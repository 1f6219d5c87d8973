"""Every static suspicion the probe can measure is confirmed or dropped by the measurement, whatever the rule
(SPEC "Root causes first", issue 8).

A rule with both a static and a probe half declares in its probe half what it measures of the condition the
static half suspects (`MEASURES`, ddpdoctor.findings.Measures) and, in each run, calls `RunContext.measured` where
it measured it (or `not_measured` where it could not). For each such rule two recorded runs hold it to that (the
PENDING tables say why a rule has none yet): one where static analysis suspected the condition below `certain`
and the probe measured it absent (the static finding is dropped, with a note giving the numbers), and one where
the probe found it (one finding, static and probe). The runs are real probe runs of the fixtures in
fixtures/measured/ (or of older fixtures that show the same), recorded by fixtures/runs/record_probe_runs.py and
replayed here through `ddpdoctor report`.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from ddpdoctor.analyses import analyze_run, load_static_findings
from ddpdoctor.causes import flatten
from ddpdoctor.check import report_run
from ddpdoctor.findings import Confidence, Finding, Measurement, Measures, apply_clearances, resolve_measurements
from ddpdoctor.levels import Severity
from ddpdoctor.rules import RULES

RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "runs"

# rule -> the recorded run where static analysis suspected the condition below `certain` and the probe measured it
# absent (the static finding is dropped, with a note giving the numbers)
CLEARED: dict[str, str] = {
    "DD106": "measured_dd106_dataparallel_branch_not_taken",
    "DD108": "probe_legacy_local_rank_device_from_rank",
    "DD110": "measured_dd110_wrap_under_launcher_condition",
    "DD206": "measured_dd206_ddp_forward_on_every_rank",
    "DD207": "probe_precise_bn",
    "DD209": "measured_dd209_exact_class_before_conversion",
    "DD303": "data_synthetic_unseeded",
    "DD401": "measured_dd401_optimizer_branch_not_taken",
    "DD402": "measured_dd402_lr_scaled_down",
    "DD403": "measured_dd403_accumulation_off",
    "DD404": "measured_dd404_manual_sync_flag_off",
    "DD216": "measured_dd216_converter_reuses_parameters",
    "DD502": "measured_dd502_save_guarded_by_rank_string",
    "DD503": "ckpt_save_rank0",
}
# rule -> the recorded run where the probe found what static analysis suspected: one finding, static and probe
CONFIRMED: dict[str, str] = {
    "DD101": "probe_cuda_syncbn_after_wrap",
    "DD102": "probe_forward_bypass",
    "DD104": "probe_hardcoded_rank",
    "DD105": "probe_device_not_bound",
    "DD106": "styles_dataparallel_bad",
    "DD108": "probe_legacy_local_rank",
    "DD110": "probe_model_not_wrapped",
    "DD205": "bn_syncbn_cpu",
    "DD206": "bn_rank0_eval_hang",
    "DD207": "probe_momentum_encoder_eval_bug",
    "DD209": "measured_dd209_exact_class_after_conversion",
    "DD216": "measured_dd216_converter_clones_parameters",
    "DD301": "probe_missing_set_epoch",
    "DD302": "probe_no_distributed_sampler",
    "DD303": "data_seeded_augment",
    "DD401": "measured_dd401_optimizer_branch_taken",
    "DD402": "measured_dd402_lr_scaled_up",
    "DD403": "optim_accumulate_hand_reduce",
    "DD404": "optim_accumulate_hand_reduce",
    "DD501": "ckpt_save_every_rank",
    "DD502": "ckpt_save_every_rank",
    "DD503": "ckpt_save_every_rank",
    "DD504": "styles_horovod_bad",
}

# Rules with both halves whose measurement a recorded run does not hold yet, and why. Empty it, don't grow it: a
# rule's MEASURES code path without a recorded run that exercises it is untested.
NO_CLEARED_RUN_YET = ("no recorded run yet where static analysis suspects it below certain and the probe measures it "
                      "absent")
PENDING_CLEARED: dict[str, str] = {code: NO_CLEARED_RUN_YET for code in (
    "DD101", "DD102", "DD104", "DD105", "DD205", "DD301", "DD302", "DD501", "DD504",
)}
PENDING_CLEARED["DD904"] = ("static DD904 fires below certain on an unknown trainer of an installed package; none "
                            "that trains through torch.optim without ddpdoctor modelling it is installed with the "
                            "test extra")
PENDING_CLEARED["DD109"] = ("one node with one process per emulated GPU cannot show a device-count world size "
                            "wrong; a clearance needs a world size passed that is not the device count")
PENDING_CONFIRMED: dict[str, str] = {
    "DD109": "a confirmation needs a launch across nodes or --nproc unlike the GPU count (tests/test_rule_dd109.py)",
    "DD904": "static DD904 names an engine not modelled (DeepSpeed); none is installed with the test extra to run "
    "under the probe without a step",
}


def both_halves() -> list[str]:
    return [r.code for r in RULES if r.static and r.probe]


def test_every_rule_with_both_halves_declares_what_its_probe_half_measures() -> None:
    missing = []
    for rule in RULES:
        if not (rule.static and rule.probe):
            continue
        module = importlib.import_module(f"{rule.package}.probe")
        if not isinstance(getattr(module, "MEASURES", None), Measures):
            missing.append(rule.code)
    assert not missing, f"probe halves without a MEASURES declaration: {missing}"


@pytest.mark.parametrize(("held", "pending"), [(CLEARED, PENDING_CLEARED), (CONFIRMED, PENDING_CONFIRMED)],
                         ids=["cleared", "confirmed"])
def test_every_rule_with_both_halves_has_a_recorded_run_or_says_why_not(held: dict, pending: dict) -> None:
    codes = set(both_halves())
    assert codes <= set(held) | set(pending), f"no recorded run for {sorted(codes - set(held) - set(pending))}"
    assert not set(held) & set(pending), f"held and pending: {sorted(set(held) & set(pending))}"
    assert set(held) | set(pending) <= codes  # a rule that lost a half leaves the table


def _static_suspicions(run: str, code: str) -> list[Finding]:
    return [f for f in load_static_findings(RUNS / run) if f.rule == code and f.confidence < Confidence.CERTAIN]


@pytest.mark.parametrize("code", sorted(CLEARED))
def test_a_static_suspicion_the_probe_measured_absent_is_dropped_with_the_numbers(code: str) -> None:
    run = CLEARED[code]
    suspected = _static_suspicions(run, code)
    assert suspected, f"{run}: no static {code} suspicion below certain to measure"
    report = report_run(RUNS / run)
    assert not [f for f in flatten(report.findings) if f.rule == code], f"{run}: {code} still reported"
    for f in suspected:
        notes = [n for n in report.notes if n.startswith(f"static {code} at {f.location} cleared by the probe: ")]
        assert notes, f"{run}: no note for the dropped static {code} at {f.location}"
        assert any(ch.isdigit() for ch in notes[0].split("cleared by the probe: ", 1)[1])  # it gives numbers


@pytest.mark.parametrize("code", sorted(CONFIRMED))
def test_a_static_suspicion_the_probe_confirmed_is_one_finding_from_both(code: str) -> None:
    run = CONFIRMED[code]
    assert [f for f in load_static_findings(RUNS / run) if f.rule == code], f"{run}: no static {code}"
    report = report_run(RUNS / run)
    found = [f for f in flatten(report.findings) if f.rule == code]
    assert [f.sources for f in found] == [("static", "probe")], [(f.location, f.sources) for f in found]
    assert not [n for n in report.notes if n.startswith(f"static {code} at {found[0].location} ")]


# ------------------------------------------------------------------ the mechanism itself


def make(rule: str = "DD502", line: int = 10, **kw) -> Finding:
    base = {"rule": rule, "severity": Severity.LOW, "confidence": Confidence.POSSIBLE, "message": "m", "fix": "f",
            "sources": ("static",), "file": "train.py", "line": line}
    base.update(kw)
    return Finding(**base)


def test_a_measurement_with_no_probe_finding_in_its_scope_clears_and_one_with_a_finding_confirms() -> None:
    at10 = Measurement(rule="DD502", reason="1 writer (rank 0), 2 saves", file="train.py", line=10)
    at20 = Measurement(rule="DD502", reason="2 writers", file="train.py", line=20)
    run_wide = Measurement(rule="DD404", reason="0 of 8 steps")
    probe = [make(line=20, sources=("probe",), confidence=Confidence.CERTAIN)]
    clearances, unmeasured = resolve_measurements(probe, [at10, at20, run_wide])
    assert [(c.rule, c.line) for c in clearances] == [("DD502", 10), ("DD404", None)] and unmeasured == []
    kept, notes = apply_clearances([make(line=10), make(line=20), make("DD404", line=3)], clearances)
    assert [(f.rule, f.line) for f in kept] == [("DD502", 20)]
    assert notes[0] == "static DD502 at train.py:10 cleared by the probe: 1 writer (rank 0), 2 saves"
    # a run-wide measurement is confirmed by a finding of its rule anywhere
    clearances, _ = resolve_measurements([make("DD404", line=99, sources=("probe",))], [run_wide])
    assert clearances == []


def test_a_probe_finding_whose_call_sites_include_the_place_confirms_it() -> None:
    m = Measurement(rule="DD501", reason="r", file="train.py", line=12)
    f = make("DD501", line=40, file="utils.py", sources=("probe",),
             evidence={"call_sites": [{"file": "utils.py", "line": 40}, {"file": "train.py", "line": 12}]})
    assert m.in_scope(f)
    assert resolve_measurements([f], [m]) == ([], [])


def test_not_measured_keeps_the_static_finding_and_says_why() -> None:
    m = Measurement(rule="DD401", reason="without --base-lr nothing says which lr", measured=False,
                    file="train.py", line=7)
    clearances, unmeasured = resolve_measurements([], [m])
    assert clearances == [] and unmeasured == [m]
    f = make("DD401", line=7)
    kept, notes = apply_clearances([f], clearances, unmeasured)
    assert kept == [f]
    assert notes == ["static DD401 at train.py:7 not measured by the probe: without --base-lr nothing says which lr"]


def test_about_narrows_a_measurement_to_the_static_suspicions_it_speaks_to() -> None:
    m = Measurement(rule="DD104", reason="each process passed its own rank", file="train.py", line=5,
                    about=("literal_rank",))
    rank = make("DD104", line=5, evidence={"literal_rank": 0})
    world = make("DD104", line=5, evidence={"literal_world_size": 4})
    kept, _ = apply_clearances([rank, world], [m.clearance()])
    assert kept == [world]


def test_analyze_run_turns_measurements_into_clearances() -> None:
    result = analyze_run(RUNS / "measured_dd402_lr_scaled_down")
    assert [c.line for c in result.clearances if c.rule == "DD402"] == [24, 23]  # the optimizer, the scaling expression
