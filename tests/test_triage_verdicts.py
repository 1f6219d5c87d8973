"""The pure parts of triage's decision (fast): ranking, folding consequences (through ddpdoctor.causes, the one
"X explains Y" relation), headlines, --arms parsing, and the JSON `triage` object's shape."""

from __future__ import annotations

import pytest

from ddpdoctor.causes import EXPLAINS
from ddpdoctor.errors import UsageError
from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.triage.model import Cause, TriageResult
from ddpdoctor.triage.run import arm_settings, parse_arms
from ddpdoctor.triage.verdicts import fold, headline, rank_causes


def cause(rule: str, verdict: str, favours: str = "none", severity: Severity = Severity.LOW, port: bool = False,
          source: Finding | None = None, **measured) -> Cause:
    return Cause(cause=f"c-{rule}", rule=rule, verdict=verdict, favours=favours, measured=dict(measured),
                 message=f"m {rule}", fix="f", severity=severity, port=port, source=source)


def port(rule: str, severity: Severity = Severity.MEDIUM, verdict: str = "both_arms", **evidence) -> Cause:
    f = Finding(rule=rule, severity=severity, confidence=Confidence.CERTAIN, message=f"{rule} seen", fix="f",
                sources=("probe",), evidence=dict(evidence))
    return cause(rule, verdict, severity=severity, port=True, source=f)


def test_confirmed_first_then_high_both_arms_then_likely():
    ranked = rank_causes([
        cause("DD204", "likely", "plain"),
        port("DD402", Severity.LOW),
        port("DD401", Severity.HIGH),
        cause("DD203", "ruled_out", severity=Severity.HIGH),
        cause("DD208", "confirmed", "fix_conversion", Severity.CRITICAL),
        cause("DD213", "possible"),
    ])
    assert [c.rule for c in ranked] == ["DD208", "DD401", "DD204", "DD213", "DD402", "DD203"]


def test_ruled_out_in_favour_of_an_arm_ranks_above_low_both_arms_causes():
    ranked = rank_causes([port("DD402", Severity.LOW), cause("DD204", "ruled_out", "syncbn")])
    assert [c.rule for c in ranked] == ["DD204", "DD402"]


def test_triage_relations_are_declared_in_causes():
    pairs = {(e.cause, e.consequence) for e in EXPLAINS}
    for root in ("DD203", "DD204", "DD215"):
        assert {(root, "DD213"), (root, "DD214")} <= pairs


def test_running_stats_worse_per_rank_are_explained_by_small_batches_but_never_ranked_under_a_ruled_out_row():
    """Verdicts first (issue 20): the LIKELY rows lead; each says that the small batches (RULED OUT in favour of
    SyncBN) explain it, and the headline answers with that explanation."""
    causes = [cause("DD213", "likely", "syncbn"), cause("DD214", "likely", "syncbn"),
              cause("DD204", "ruled_out", "syncbn", per_rank_samples=4)]
    fold(causes)
    ranked = rank_causes(causes)
    assert [c.rule for c in ranked] == ["DD213", "DD214", "DD204"]
    assert ranked[0].explained_by is None and ranked[0].related is ranked[2]
    assert "per-rank batches of 4" in ranked[0].because
    assert "explained by c-DD204 (DD204)" in ranked[0].message
    assert "(DD204)" in headline(ranked, mirror=False)


def test_a_consequence_with_an_equal_verdict_is_still_folded():
    causes = [cause("DD213", "likely", "syncbn"), cause("DD203", "likely", "syncbn", severity=Severity.HIGH)]
    fold(causes)
    assert causes[0].explained_by is causes[1]


def test_running_stats_are_not_folded_without_the_evidence():
    # large per-rank batches: running statistics worse per rank are not explained by noisy batches
    causes = [cause("DD213", "likely", "syncbn"), cause("DD204", "ruled_out", "syncbn", per_rank_samples=64)]
    fold(causes)
    assert all(c.explained_by is None for c in causes)
    # running statistics that favour plain BN are not what non-i.i.d. shards do
    causes = [cause("DD213", "likely", "plain"), cause("DD203", "likely", "syncbn")]
    fold(causes)
    assert all(c.explained_by is None for c in causes)


def test_non_iid_shards_explain_worse_per_rank_running_statistics_before_small_batches():
    causes = [cause("DD213", "possible", "syncbn"), cause("DD204", "ruled_out", "syncbn", per_rank_samples=4),
              cause("DD203", "likely", "syncbn", severity=Severity.HIGH)]
    fold(causes)
    assert causes[0].explained_by is causes[2]


def test_port_causes_fold_with_the_check_relation():
    split = port("DD305", Severity.HIGH, split_differs=True)
    overlap = port("DD302", Severity.HIGH, splits_differ_across_ranks=True)
    causes = [overlap, split, cause("DD204", "ruled_out", "syncbn", per_rank_samples=4)]
    fold(causes)
    assert overlap.explained_by is split
    assert [c.rule for c in rank_causes(causes)] == ["DD305", "DD302", "DD204"]
    # the headline names the root port cause only
    assert "DD302" not in headline(rank_causes(causes), False)


def test_headlines():
    assert headline([cause("DD208", "confirmed", "fix_conversion")], False).startswith(
        "The conversion to SyncBN changed the model itself")
    assert "hurts both arms" in headline([port("DD401", Severity.HIGH)], False)
    noise = cause("DD204", "likely", "plain", per_rank_samples=64)
    assert "removes the BN noise" in headline([noise], False) and "64" in headline([noise], False)
    assert "SyncBN is right here" in headline([cause("DD203", "likely", "syncbn")], False)
    assert headline([cause("DD203", "ruled_out")], False).startswith("No SyncBN-specific defect found")
    assert "would" in headline([cause("DD204", "ruled_out", "syncbn", per_rank_samples=4)], True)


@pytest.mark.parametrize("mirror", [False, True])
def test_a_port_cause_never_leads_the_headline(mirror):
    """timm `train.py --sync-bn` once got a headline led by a static DD108 (a launch-argument finding unrelated to
    BatchNorm). The headline answers the SyncBN question first and names port causes after it; they stay
    BOTH ARMS rows of the table, ranked as such."""
    dd108 = port("DD108", Severity.MEDIUM)
    noise = cause("DD204", "ruled_out", "syncbn", per_rank_samples=4)
    ranked = rank_causes([noise, dd108, cause("DD203", "ruled_out", severity=Severity.HIGH)])
    assert ranked[0] is dd108 and ranked[0].verdict == "both_arms"  # the table still ranks it as BOTH ARMS
    text = headline(ranked, mirror)
    assert text.startswith("No SyncBN-specific defect found")
    assert text.index("DD204") < text.index("DD108")
    assert "the regression is elsewhere: c-DD108 (DD108) hurts both arms" in text
    # with nothing about BatchNorm measured, the port cause still comes after the answer
    alone = headline(rank_causes([dd108]), mirror)
    assert alone.startswith("No SyncBN-specific defect found") and alone.index("nothing measured") < alone.index(
        "DD108")
    # a likely noise verdict is not contradicted: port causes are named beside it
    beside = headline(rank_causes([dd108, cause("DD204", "likely", "plain", per_rank_samples=64)]), False)
    assert "removes the BN noise" in beside and "beside it, c-DD108 (DD108) hurts both arms" in beside
    # a port cause seen in one arm only is a row, not the headline's answer
    one_arm = port("DD502", Severity.MEDIUM, verdict="possible")
    assert "DD502" not in headline(rank_causes([one_arm, noise]), mirror)


def test_triage_json_has_exactly_the_spec_keys():
    result = TriageResult(arms=[{"name": "A", "what": "as written", "steps": 30}], paired=True, pairing={},
                          headline="h", causes=[cause("DD204", "likely", "plain")], emulated=True, mirror=False)
    data = result.to_json()
    assert set(data) == {"arms", "paired", "headline", "causes"}
    assert set(data["causes"][0]) == {"cause", "rule", "verdict", "favours", "measured", "message", "fix"}


def test_parse_arms():
    assert parse_arms(None, None) == ("A", "L", "P")
    assert parse_arms(None, 2) == ("A", "L", "P", "G")
    assert parse_arms("p,a", None) == ("A", "P")
    for bad in ("A,L", "A,P,X", "A,P,G"):
        with pytest.raises(UsageError):
            parse_arms(bad, None)


def testarm_settings_of_a_syncbn_script_and_of_the_mirror_question():
    assert arm_settings("L", False, 0, None, False)["bn_mode"] == "local"
    assert arm_settings("P", False, 0, None, False)["bn_mode"] == "plain"
    assert arm_settings("A", True, 0, None, False)["bn_convert"] == 1
    assert "bn_mode" not in arm_settings("P", True, 0, None, False) and "bn_convert" not in arm_settings(
        "P", True, 0, None, False)
    assert arm_settings("G", False, 3, 2, False) == {"arm": "G", "seed": 3, "bn_mode": "group", "bn_group_size": 2}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arms", "A,L"], "--arms must include A and P"),
        (["--arms", "A,P,X"], "unknown arm"),
        (["--arms", "A,P,G"], "--arms G needs --group-size"),
        (["--group-size", "3"], "--group-size 3: needs 2 <= G < --nproc (2)"),
        (["--group-size", "2"], "--group-size 2: needs 2 <= G < --nproc (2)"),
        (["--format", "xml"], "--format"),
    ],
)
def test_triage_bad_options_exit_2_with_one_line(args, message, capsys, tmp_path):
    from ddpdoctor.cli import main

    script = tmp_path / "train.py"
    script.write_text("print('never run')\n", encoding="utf-8")
    assert main(["triage", str(script), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_triage_missing_script_exits_2(capsys, tmp_path):
    from ddpdoctor.cli import main

    assert main(["triage", str(tmp_path / "nope.py")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_port_cause_that_cannot_change_accuracy_is_a_row_not_the_answer():
    """SimSiam on the torchrun path once got "the regression is elsewhere: device-not-bound (DD105) and
    module-prefix-checkpoint (DD501)": real problems in both arms, but neither changes what the arms learn."""
    from ddpdoctor.triage.model import Arm
    from ddpdoctor.triage.verdicts import port_causes

    def finding(rule: str, severity: Severity) -> Finding:
        return Finding(rule=rule, severity=severity, confidence=Confidence.CERTAIN, message=f"{rule} seen", fix="f",
                       sources=("probe",))

    seen = [finding("DD501", Severity.MEDIUM), finding("DD105", Severity.HIGH), finding("DD401", Severity.HIGH)]
    a = Arm(name="A", what="as written", ctx=None, findings=seen, as_written=True)
    p = Arm(name="P", what="plain", ctx=None, findings=seen, as_written=False)
    ports = port_causes(a, p)
    assert {c.rule: c.run_only for c in ports} == {"DD501": True, "DD105": True, "DD401": False}
    assert all(c.verdict == "both_arms" for c in ports)
    ranked = rank_causes(ports + [cause("DD204", "ruled_out", "syncbn", per_rank_samples=4),
                                  cause("DD213", "possible")])
    assert [c.rule for c in ranked] == ["DD401", "DD213", "DD204", "DD105", "DD501"]
    text = headline(ranked, False)
    assert "DD401" in text and "DD105" not in text and "DD501" not in text, text
    assert "does not change what either arm learns" in ranked[-1].message
