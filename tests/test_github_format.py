"""`--format github`: GitHub Actions workflow commands (`::error file=...,line=...,title=...::message`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.report import Report
from ddpdoctor.report.github import escape_data, escape_property
from ddpdoctor.report.render import render
from ddpdoctor.rules import get_rule

REPO = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"^::(?P<level>error|warning|notice) (?P<props>[^:]*)::(?P<data>.*)$")


def _finding(rule: str, severity: Severity, **kw) -> Finding:
    return Finding(rule=rule, severity=severity, confidence=Confidence.CERTAIN, message=kw.pop("message", "m"),
                   fix=get_rule(rule).fix, **kw)


def _parse(line: str) -> tuple[str, dict[str, str], str]:
    m = COMMAND.match(line)
    assert m, line
    props = dict(p.split("=", 1) for p in m.group("props").split(","))
    return m.group("level"), props, m.group("data")


def _unescape(text: str) -> str:
    return text.replace("%0A", "\n").replace("%0D", "\r").replace("%3A", ":").replace("%2C", ",").replace("%25", "%")


def test_one_annotation_per_finding_with_level_file_line_and_title(tmp_path: Path) -> None:
    report = Report(
        script="train.py",
        findings=(
            _finding("DD301", Severity.HIGH, file="train.py", line=41, sources=("static", "probe"),
                     message="Epochs 0 and 1 iterated the same 64 indices on ranks [0, 1], 100% repeated"),
            _finding("DD502", Severity.LOW, file="utils/ckpt.py", line=7),
            _finding("DD103", Severity.CRITICAL, sources=("probe",), message="replicas differ: 0.14, after 3 steps"),
            _finding("DD101", Severity.MEDIUM, file="train.py", line=60),
        ),
        notes=("CUDA was emulated on CPU",),
    )
    lines = render(report, "github", color=False, base_dir=tmp_path).splitlines()
    assert len(lines) == 6
    parsed = [_parse(line) for line in lines[:4]]
    # ranked as every format ranks them: critical first
    assert [(lv, p["title"].split()[0]) for lv, p, _ in parsed] == [
        ("error", "DD103"), ("error", "DD301"), ("warning", "DD101"), ("notice", "DD502")]
    _level, props, data = parsed[0]
    assert props == {"file": "train.py", "title": "DD103 replicas-diverged (critical%2C certain%2C probe)"}  # no line
    assert _unescape(data) == f"replicas differ: 0.14, after 3 steps.\nFix: {get_rule('DD103').fix}"
    _level, props, data = parsed[1]
    assert props["file"] == "train.py" and props["line"] == "41"
    assert "%25 repeated" in data and "\n" not in data  # escaped: one command per line
    assert parsed[3][1]["file"] == "utils/ckpt.py" and parsed[3][1]["line"] == "7"
    assert lines[4] == "ddpdoctor: note: CUDA was emulated on CPU"
    assert lines[5] == "ddpdoctor: 1 critical, 1 high, 1 medium, 1 low, 0 info (4 findings)"


def test_absolute_paths_inside_the_tree_become_relative(tmp_path: Path) -> None:
    f = _finding("DD101", Severity.MEDIUM, file=str(tmp_path / "pkg" / "train.py"), line=3)
    out = render(Report(script="x.py", findings=(f,)), "github", color=False, base_dir=tmp_path)
    assert _parse(out.splitlines()[0])[1]["file"] == "pkg/train.py"


def test_escaping_follows_the_workflow_command_rules() -> None:
    assert escape_data("50% a\r\nb: c, d") == "50%25 a%0D%0Ab: c, d"
    assert escape_property("dir,x/a:b.py") == "dir%2Cx/a%3Ab.py"


def test_check_static_format_github_exit_code_and_output() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "check", "--static", "--format", "github", "fixtures/demo/train.py"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1, done.stderr  # findings at or above the default --fail-on medium
    commands = [_parse(line) for line in done.stdout.splitlines() if line.startswith("::")]
    assert {p["title"].split()[0] for _, p, _ in commands} >= {"DD104", "DD101", "DD302"}
    assert all(p["file"] == "fixtures/demo/train.py" and p["line"].isdigit() for _, p, _ in commands)
    assert done.stdout.splitlines()[-1].startswith("ddpdoctor: 1 critical")
