"""`python -m ddpdoctor.dev.show_events`: the static and probe events a rule reads, for contributors."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.dev.show_events import kinds_read, main

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "fixtures" / "demo" / "train.py"


def test_the_kinds_a_rule_reads_come_from_its_hooks():
    assert "iterate" in kinds_read("DD301", "static")
    assert "set_epoch" in kinds_read("DD301", "probe")
    assert kinds_read("DD103", "static") == []  # a probe-only rule


def test_it_prints_a_rules_static_and_probe_events(capsys):
    assert main([str(DEMO), "--rule", "DD301", "--run", str(REPO / "fixtures" / "runs" / "demo")]) == 0
    out = capsys.readouterr().out.splitlines()
    static = out.index(next(line for line in out if line.startswith("# static events")))
    probe = out.index(next(line for line in out if line.startswith("# probe events")))
    assert any(" iterate " in line and line.startswith("train.py:") for line in out[static:probe])
    assert any(line.startswith("rank 0") and " loader_iter " in line for line in out[probe:])


def test_without_a_run_it_says_how_to_record_one(capsys):
    assert main([str(DEMO), "--rule", "DD301"]) == 0
    assert "--keep-run DIR" in capsys.readouterr().out


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path: Path):
    assert main([str(tmp_path / "missing.py"), "--rule", "DD301"]) == 2
    assert main([str(DEMO), "--rule", "DD999"]) == 2
    assert main([str(DEMO)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("show_events: error: ") for line in err)
    assert "unknown rule code 'DD999'" in err[1]
