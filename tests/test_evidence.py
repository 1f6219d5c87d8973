"""The index of the rules' evidence (ddpdoctor.dev.evidence): every rule of the catalog has an entry, the places
it derives hold what their names say, and what it declares exists."""

from __future__ import annotations

from ddpdoctor.dev import evidence
from ddpdoctor.rules import RULES


def test_every_rule_has_an_entry_and_every_static_half_a_bad_and_a_good_fixture():
    index = evidence.index()
    assert list(index) == [r.code for r in RULES]
    for rule in RULES:
        names = [p.name for p in index[rule.code].static]
        if rule.static:
            assert any(n.startswith("bad_") for n in names) and any(n.startswith("good_") for n in names), rule.code
        for path in index[rule.code].static:
            if path.name.startswith("bad_"):
                assert rule.code in evidence.expected_codes(path), path


def test_every_rule_with_a_probe_half_has_probe_fixtures_or_a_recorded_run():
    # DD208-DD216 are measured by triage's arms (fixtures/runs/triage_fused_act, tests/test_triage_*); DD904 (the
    # probe saw no training) is run live by tests/test_nothing_observed.py: no recorded run fires it
    index = evidence.index()
    bare = [r.code for r in RULES if r.probe and not (index[r.code].probe or index[r.code].runs)
            and not "DD208" <= r.code <= "DD216"]
    assert bare == ["DD904"]


def test_what_the_index_declares_exists():
    runs = {p.name for p in evidence.recorded_runs()}
    for table in (evidence.CLEARED, evidence.CONFIRMED):
        assert set(table.values()) <= runs, sorted(set(table.values()) - runs)
    for run in evidence.recorded_runs():
        for fmt in evidence.GOLDEN_FORMATS:
            assert evidence.golden(run, fmt).is_file(), run.name
    for code in ("DD301", "DD402"):
        entry = evidence.evidence(code)
        assert entry.confirmed in {p.name for p in entry.runs}  # the confirming run's report names the rule
        assert all(p.is_file() for p in entry.goldens) and len(entry.goldens) == 2 * len(entry.runs)


def test_the_command_prints_a_rules_evidence(capsys):
    assert evidence.main(["DD301"]) == 0
    out = capsys.readouterr().out
    assert "fixtures/static/DD301/bad_no_set_epoch.py" in out and "fixtures/runs/probe_missing_set_epoch" in out
    assert evidence.main(["DD999"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_one_recorder_records_every_recorded_run():
    """python -m ddpdoctor.dev.record: one table, one way (`ddpdoctor check --keep-run`), for every run of
    fixtures/runs/ that a golden report pins; the triage's run (a `triage --keep-run` directory) is not a check run."""
    from ddpdoctor.dev import record

    table = record.recordings()
    assert set(table) == {p.name for p in evidence.recorded_runs()}
    for name, (script, _args) in table.items():
        assert (evidence.REPO / script).is_file(), name
        cmd = record.command(name, scratch="/tmp/x")
        assert cmd[:4] == ["check", script, "--keep-run", f"fixtures/runs/{name}"] and record.SCRATCH not in cmd
    assert record.main(["no_such_run"]) == 2
