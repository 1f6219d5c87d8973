"""The pure parts of triage's decision (fast): ranking, folding consequences, headlines, --arms parsing, and the
JSON `triage` object's shape."""

from __future__ import annotations

import pytest

from ddpdoctor.errors import UsageError
from ddpdoctor.findings import Severity
from ddpdoctor.triage.run import _arm_settings, parse_arms
from ddpdoctor.triage.verdicts import Cause, TriageResult, fold_consequences, headline, rank_causes


def cause(rule: str, verdict: str, favours: str = "none", severity: Severity = Severity.LOW, **measured) -> Cause:
    return Cause(cause=f"c-{rule}", rule=rule, verdict=verdict, favours=favours, measured=dict(measured),
                 message=f"m {rule}", fix="f", severity=severity)


def test_confirmed_first_then_high_both_arms_then_likely():
    ranked = rank_causes([
        cause("DD204", "likely", "plain"),
        cause("DD402", "both_arms"),
        cause("DD401", "both_arms", severity=Severity.HIGH),
        cause("DD203", "ruled_out", severity=Severity.HIGH),
        cause("DD208", "confirmed", "fix_conversion", Severity.CRITICAL),
        cause("DD213", "possible"),
    ])
    assert [c.rule for c in ranked] == ["DD208", "DD401", "DD204", "DD213", "DD402", "DD203"]


def test_ruled_out_in_favour_of_an_arm_ranks_above_low_both_arms_causes():
    ranked = rank_causes([cause("DD402", "both_arms"), cause("DD204", "ruled_out", "syncbn")])
    assert [c.rule for c in ranked] == ["DD204", "DD402"]


def test_running_stats_worse_per_rank_are_a_consequence_of_small_batches():
    causes = [cause("DD213", "likely", "syncbn"), cause("DD214", "likely", "syncbn"),
              cause("DD204", "ruled_out", "syncbn", per_rank_samples=4)]
    fold_consequences(causes)
    ranked = rank_causes(causes)
    assert [c.rule for c in ranked] == ["DD204", "DD213", "DD214"]
    assert "consequence" in ranked[1].message


def test_headlines():
    assert headline([cause("DD208", "confirmed", "fix_conversion")], False).startswith(
        "The conversion to SyncBN changed the model itself")
    assert "hurts both arms" in headline([cause("DD401", "both_arms", severity=Severity.HIGH)], False)
    noise = cause("DD204", "likely", "plain", per_rank_samples=64)
    assert "removes the BN noise" in headline([noise], False) and "64" in headline([noise], False)
    assert "SyncBN is right here" in headline([cause("DD203", "likely", "syncbn")], False)
    assert headline([cause("DD203", "ruled_out")], False).startswith("No SyncBN-specific defect found")
    assert "would" in headline([cause("DD204", "ruled_out", "syncbn", per_rank_samples=4)], True)


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


def test_arm_settings_of_a_syncbn_script_and_of_the_mirror_question():
    assert _arm_settings("L", False, 0, None, False)["bn_mode"] == "local"
    assert _arm_settings("P", False, 0, None, False)["bn_mode"] == "plain"
    assert _arm_settings("A", True, 0, None, False)["bn_convert"] == 1
    assert "bn_mode" not in _arm_settings("P", True, 0, None, False) and "bn_convert" not in _arm_settings(
        "P", True, 0, None, False)
    assert _arm_settings("G", False, 3, 2, False) == {"arm": "G", "seed": 3, "bn_mode": "group", "bn_group_size": 2}


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
