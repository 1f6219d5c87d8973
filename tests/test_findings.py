"""The finding model: ranking order, static+probe merging, de-duplication, JSON round trip."""

from __future__ import annotations

import json

import pytest

from ddpdoctor.findings import (
    Clearance,
    Confidence,
    Finding,
    Severity,
    apply_clearances,
    merge_findings,
    rank_findings,
    summarize,
)
from ddpdoctor.report import Report


def make(rule: str = "DD301", **kw) -> Finding:
    base = dict(
        rule=rule,
        severity=Severity.HIGH,
        confidence=Confidence.CERTAIN,
        message=f"{rule} message",
        fix=f"{rule} fix",
        sources=("static",),
        file="train.py",
        line=10,
    )
    base.update(kw)
    return Finding(**base)


def test_severity_and_confidence_parse_and_order():
    assert Severity.parse(" High ") is Severity.HIGH
    assert Severity.INFO < Severity.LOW < Severity.MEDIUM < Severity.HIGH < Severity.CRITICAL
    assert Confidence.POSSIBLE < Confidence.LIKELY < Confidence.CERTAIN
    with pytest.raises(ValueError, match="unknown severity"):
        Severity.parse("severe")
    with pytest.raises(ValueError):
        Confidence.parse("sure")


def test_finding_rejects_unknown_source_and_untyped_levels():
    with pytest.raises(ValueError):
        make(sources=("runtime",))
    with pytest.raises(TypeError):
        make(severity="high")


def test_ranking_severity_then_confidence_then_magnitude_then_rule_then_location():
    findings = [
        make("DD504", severity=Severity.LOW),
        make("DD302", confidence=Confidence.LIKELY),
        make("DD301", line=30),
        make("DD301", line=12),
        make("DD302", magnitude=0.5),
        make("DD102", severity=Severity.CRITICAL, confidence=Confidence.POSSIBLE),
        make("DD401", file="a.py", line=99),
    ]
    ranked = rank_findings(findings)
    assert [(f.rule, f.file, f.line) for f in ranked] == [
        ("DD102", "train.py", 10),  # critical beats any high
        ("DD302", "train.py", 10),  # certain, magnitude 0.5 beats magnitude 0
        ("DD301", "train.py", 12),  # then by rule, then by location
        ("DD301", "train.py", 30),
        ("DD401", "a.py", 99),
        ("DD302", "train.py", 10),  # likely after every certain
        ("DD504", "train.py", 10),
    ]
    assert ranked[1].magnitude == 0.5


def test_within_a_severity_the_measured_loss_of_training_ranks_before_the_rule_number():
    """Rank by the size of the measured consequence, not by rule family (issue 20): on one run, a model that learns
    nothing (DD405, every rank without a gradient: the whole training lost) ranks above the ranks' differing data
    (DD305, same severity, certain, a larger rule-local magnitude but no training lost); a strict=False load that
    left half the keys at their initialisation (DD503) above small BN batches (DD202) of the same severity. A
    measured loss never lifts a finding over a higher severity."""
    from ddpdoctor.analyses.consequence import keep_consistent
    from ddpdoctor.rules import hook

    nothing = make("DD405", sources=("probe",), magnitude=1.0,
                   evidence={"per_rank": {"0": {}, "1": {}}, "ranks_observed": 2})
    differs = make("DD305", sources=("probe",), magnitude=1.0,
                   evidence={"differing": [{"index": 0}], "lengths": {"0": 8, "1": 8}, "differing_fraction": 1.0})
    half = make("DD503", sources=("probe",), severity=Severity.MEDIUM, magnitude=0.5,
                evidence={"missing": 3, "model_keys": 6})
    small = make("DD202", sources=("probe",), severity=Severity.MEDIUM, magnitude=4.0, evidence={"layers": ["bn1"]})
    critical = make("DD103", sources=("probe",), severity=Severity.CRITICAL, evidence={"steps_differing": 3})
    notes: list[str] = []
    kept = [g for f in (differs, small, half, nothing, critical)
            for g in keep_consistent(hook(f.rule, "probe"), [f], notes)]
    assert notes == []
    ranked = rank_findings(kept)
    assert [f.rule for f in ranked] == ["DD103", "DD405", "DD305", "DD503", "DD202"]
    by_rule = {f.rule: f for f in ranked}
    assert by_rule["DD405"].evidence["training_lost"] == 1.0
    assert by_rule["DD503"].evidence["training_lost"] == 0.5
    assert "training_lost" not in by_rule["DD305"].evidence and "training_lost" not in by_rule["DD202"].evidence
    # one rank of two without a learning signal: half the training lost, still before the ranks' differing data
    one = keep_consistent(hook("DD405", "probe"), [make("DD405", sources=("probe",), evidence={
        "per_rank": {"1": {}}, "ranks_observed": 2})], notes)
    assert one[0].evidence["training_lost"] == 0.5 and rank_findings([differs, *one])[0].rule == "DD405"
    # non-finite parameters from step 3 of 8: the 6 steps from there on are lost; a NaN loss a GradScaler skipped
    # (no parameter ever non-finite) loses nothing
    nan = make("DD406", sources=("probe",), evidence={"events": [{}], "params_nonfinite_from_step": 3,
                                                       "steps_observed": 8})
    skipped = make("DD406", sources=("probe",), evidence={"events": [{}], "params_nonfinite_from_step": None,
                                                           "steps_observed": 8})
    kept = keep_consistent(hook("DD406", "probe"), [nan, skipped], notes)
    assert [f.evidence.get("training_lost") for f in kept] == [0.75, None]


def test_static_and_probe_on_the_same_line_merge_into_one_certain_finding():
    static = make(confidence=Confidence.LIKELY, evidence={"call": "DistributedSampler(ds)"})
    probe = make(
        sources=("probe",),
        severity=Severity.HIGH,
        confidence=Confidence.LIKELY,
        message="epochs 0 and 1 iterated the same order on ranks 0 and 1",
        evidence={"epochs_identical": [0, 1]},
        ranks=(0, 1),
    )
    merged = merge_findings([static, probe])
    assert len(merged) == 1
    (f,) = merged
    assert f.sources == ("static", "probe") and f.source == "static+probe"
    assert f.confidence is Confidence.CERTAIN
    assert f.message == probe.message  # the measurement speaks
    assert f.ranks == (0, 1)
    assert f.evidence["epochs_identical"] == [0, 1] and f.evidence["static"] == {"call": "DistributedSampler(ds)"}


def test_single_static_and_probe_of_a_rule_merge_across_lines_and_the_static_line_wins():
    static = make(line=41)
    probe = make(sources=("probe",), line=57, severity=Severity.MEDIUM, magnitude=3.0)
    (f,) = merge_findings([probe, static])
    assert (f.file, f.line) == ("train.py", 41)
    assert f.severity is Severity.MEDIUM  # the probe measured the consequence
    assert f.magnitude == 3.0


def test_probe_finding_without_location_takes_the_static_location():
    (f,) = merge_findings([make(sources=("probe",), file=None, line=None), make(line=7)])
    assert (f.file, f.line, f.sources) == ("train.py", 7, ("static", "probe"))


def test_ambiguous_pairs_are_not_merged():
    statics = [make(line=5), make(line=9)]
    probe = make(sources=("probe",), line=20)
    merged = merge_findings([*statics, probe])
    assert len(merged) == 3
    assert sorted(f.source for f in merged) == ["probe", "static", "static"]


def test_different_rules_or_files_do_not_merge():
    merged = merge_findings(
        [make("DD301"), make("DD302", sources=("probe",)), make("DD301", sources=("probe",), file="other.py")]
    )
    assert sorted((f.rule, f.source, f.file) for f in merged) == [
        ("DD301", "probe", "other.py"),
        ("DD301", "static", "train.py"),
        ("DD302", "probe", "train.py"),
    ]


def test_merge_accepts_a_generator():
    # regression: the input used to be iterated twice, so a generator lost every probe finding
    merged = merge_findings(f for f in [make(line=3), make(sources=("probe",), line=3, message="measured")])
    assert [(f.source, f.message) for f in merged] == [("static+probe", "measured")]


def test_exact_duplicates_are_dropped_but_distinct_findings_kept():
    a = make(line=3)
    merged = merge_findings([a, make(line=3), make(line=4)])
    assert [(f.line, f.source) for f in merged] == [(3, "static"), (4, "static")]


def test_a_clearance_drops_static_findings_of_its_rule_below_certain_at_its_place():
    cleared = Clearance(rule="DD303", file="train.py", line=88, reason="48 eval samples on 2 ranks, no padding")
    possible = make("DD303", line=88, confidence=Confidence.POSSIBLE, severity=Severity.LOW)
    likely = make("DD303", line=88, confidence=Confidence.LIKELY, severity=Severity.LOW)
    assert cleared.covers(possible) and cleared.covers(likely)
    assert not cleared.covers(make("DD303", line=88))  # certain from syntax: stays
    assert not cleared.covers(make("DD303", line=90, confidence=Confidence.POSSIBLE))  # another place
    assert not cleared.covers(make("DD303", line=88, file="other.py", confidence=Confidence.POSSIBLE))
    assert not cleared.covers(make("DD301", line=88, confidence=Confidence.POSSIBLE))
    assert not cleared.covers(make("DD303", line=88, confidence=Confidence.POSSIBLE, sources=("probe",)))
    anywhere = Clearance(rule="DD303", file="train.py", reason="r")
    assert anywhere.covers(make("DD303", line=3, confidence=Confidence.POSSIBLE))
    other = make("DD401", line=12, confidence=Confidence.POSSIBLE)
    kept, notes = apply_clearances([possible, likely, other], [cleared])
    assert kept == [other]
    assert notes == ["static DD303 at train.py:88 cleared by the probe: 48 eval samples on 2 ranks, no padding"]
    assert Clearance.from_json(json.loads(json.dumps(cleared.to_json()))) == cleared


def test_clearances_apply_before_merging_so_a_cleared_finding_cannot_pair_with_another_place():
    """One static DD301 at line 10 (cleared there) and one probe DD301 at line 30: without the clearance they
    would merge as one cause; with it the probe finding stays alone."""
    from ddpdoctor.check import merge_static_and_probe

    static = [make("DD301", line=10, confidence=Confidence.LIKELY)]
    probe = [make("DD301", line=30, sources=("probe",))]
    assert [f.source for f in merge_findings(static + probe)] == ["static+probe"]
    clearance = Clearance(rule="DD301", file="train.py", line=10, reason="orders changed every epoch")
    merged, notes = merge_static_and_probe(static, probe, [clearance])
    assert [(f.source, f.line) for f in merged] == [("probe", 30)] and len(notes) == 1
    # a rule the report does not show gets no note
    _, quiet = merge_static_and_probe(static, probe, [clearance], ignore=("DD3",))
    assert quiet == []


def test_json_round_trip_is_lossless():
    f = make(
        "DD203",
        sources=("static", "probe"),
        confidence=Confidence.LIKELY,
        ranks=(0, 3),
        evidence={"p_value": 1.5e-9, "layers": ["bn1", "layer2.0.bn1"], "n": 4},
        magnitude=12.5,
    )
    data = json.loads(json.dumps(f.to_json()))
    back = Finding.from_json(data)
    assert back == f
    assert back.evidence == f.evidence  # evidence is not part of equality; check it separately
    assert back.magnitude == 12.5
    assert data["name"] == "non-iid-shards" and data["source"] == "static+probe"
    assert data["severity"] == "high" and data["confidence"] == "likely" and data["ranks"] == [0, 3]


def test_from_json_accepts_the_minimal_spec_shape():
    spec_finding = {
        "rule": "DD301",
        "name": "sampler-not-reshuffled",
        "severity": "high",
        "confidence": "certain",
        "source": "probe",
        "file": "train.py",
        "line": 41,
        "ranks": [0, 1],
        "message": "one sentence",
        "evidence": {},
        "fix": "short imperative",
    }
    f = Finding.from_json(spec_finding)
    assert f.sources == ("probe",) and f.line == 41 and f.ranks == (0, 1) and f.magnitude == 0.0


def test_summary_counts_every_severity_in_order():
    counts = summarize([make(severity=Severity.LOW), make(severity=Severity.LOW), make(severity=Severity.CRITICAL)])
    assert list(counts) == ["critical", "high", "medium", "low", "info"]
    assert counts == {"critical": 1, "high": 0, "medium": 0, "low": 2, "info": 0}


@pytest.mark.parametrize(
    ("fail_on", "expected"),
    [(Severity.INFO, 1), (Severity.LOW, 1), (Severity.MEDIUM, 1), (Severity.HIGH, 0), (Severity.CRITICAL, 0)],
)
def test_exit_code_follows_fail_on(fail_on, expected):
    report = Report(script="train.py", findings=(make(severity=Severity.MEDIUM), make(severity=Severity.LOW)))
    assert report.exit_code(fail_on) == expected
    assert Report(script="train.py").exit_code(Severity.INFO) == 0


def test_one_finding_per_cause_same_rule_same_place_merge_with_the_count() -> None:
    a = make("DD502", sources=("static", "probe"), line=313, ranks=(0, 1), evidence={"path": "ckpt_0.pt", "bytes": 9})
    b = make("DD502", sources=("probe",), line=313, ranks=(0, 1), evidence={"path": "ckpt_1.pt", "bytes": 9})
    elsewhere = make("DD502", sources=("probe",), line=400, evidence={"path": "last.pt"})
    merged = merge_findings([a, b, elsewhere])
    assert [(f.rule, f.line) for f in merged] == [("DD502", 313), ("DD502", 400)]
    f = merged[0]
    assert f.evidence["occurrences"] == 2 and f.evidence["path"] == "ckpt_0.pt"
    assert f.evidence["other_occurrences"] == [{"path": "ckpt_1.pt", "message": "DD502 message"}]
    assert f.sources == ("static", "probe") and "the same at this place 1 more time" in f.message
