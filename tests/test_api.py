"""The Python API (issue 22): `ddpdoctor.check/triage/compare_bn` return the result object, the same data as
`--format json`, shown as Markdown in a notebook; `import ddpdoctor` stays cheap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ddpdoctor
from ddpdoctor.cli import main
from ddpdoctor.errors import UsageError
from ddpdoctor.report import Report
from ddpdoctor.report.markdown import render_markdown

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "fixtures" / "demo" / "train.py"


def test_import_ddpdoctor_imports_nothing_heavy():
    code = ("import sys, ddpdoctor\n"
            "top = {m.split('.')[0] for m in sys.modules}\n"
            "heavy = sorted(top & {'torch', 'rich', 'scipy', 'numpy', 'typer'})\n"
            "own = sorted(m for m in sys.modules if m.startswith('ddpdoctor'))\n"
            "print(heavy, own)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                          check=True)
    assert done.stdout.strip() == "[] ['ddpdoctor']"


def test_check_static_returns_the_report_of_the_command(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    report = ddpdoctor.check(DEMO.relative_to(REPO), static=True)
    assert isinstance(report, Report)
    assert {f.rule for f in report.findings} == {"DD101", "DD104", "DD302", "DD401"}
    assert report.exit_code() == 1 and report.exit_code(None) == 0
    main(["check", "--static", str(DEMO.relative_to(REPO)), "--format", "json"])
    assert report.to_json() == json.loads(capsys.readouterr().out)
    assert report["summary"]["critical"] == 1 and report["findings"][0]["rule"] == "DD104"
    assert report._repr_markdown_() == render_markdown(report)
    from ddpdoctor.report.render import render

    assert render(report, "concise", color=False).count("\n") == 4


def test_check_options_and_bad_input(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    report = ddpdoctor.check(DEMO, static=True, select=["DD1"])
    assert {f.rule for f in report.findings} == {"DD101", "DD104"}
    with pytest.raises(UsageError, match="no such file"):
        ddpdoctor.check(tmp_path / "missing.py", static=True)
    with pytest.raises(UsageError, match="--device"):
        ddpdoctor.check(DEMO, device="tpu")
    with pytest.raises(UsageError, match="group-size"):
        ddpdoctor.triage(DEMO, nproc=2, group_size=2)
    with pytest.raises(UsageError, match="batch_size"):
        ddpdoctor.compare_bn(batch_size=0)


def test_the_modules_of_the_same_name_still_work_as_modules():
    import ddpdoctor.check as check_module
    import ddpdoctor.triage.run as triage_run
    from ddpdoctor.check import run_check

    assert check_module.run_check is run_check and callable(ddpdoctor.check)
    assert ddpdoctor.triage.run is triage_run and callable(ddpdoctor.triage)
    assert ddpdoctor.check.__call__.__doc__ and "Report" in ddpdoctor.check.__call__.__doc__


@pytest.mark.slow
def test_compare_bn_returns_the_comparison():
    result = ddpdoctor.compare_bn(steps=4, shard="sorted")
    assert result["schema"] == "ddpdoctor.compare-bn/1"
    assert [layer.layer for layer in result.layers] == [layer["layer"] for layer in result["layers"]]
    md = result._repr_markdown_()
    assert md.startswith("### ddpdoctor compare-bn") and "| stem.bn |" in md


@pytest.mark.parametrize("argv", [["report", "fixtures/runs/demo"], ["compare-bn"],
                                  ["triage", "fixtures/demo/train.py"], ["check", "fixtures/demo/train.py"]])
def test_without_numpy_and_scipy_what_needs_them_says_so_in_one_line(capsys, monkeypatch, argv):
    """numpy and scipy are the `probe` extra (issue 22: a light pre-commit hook): a command that needs them and
    does not find them says which and how to install them, exit 2."""
    monkeypatch.chdir(REPO)
    monkeypatch.setitem(sys.modules, "scipy", None)  # find_spec → None, as in an environment without it
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "needs scipy" in err and "pip install 'ddpdoctor[probe]'" in err


def test_check_static_imports_neither_numpy_nor_scipy_nor_torch_and_rich_only_for_text(tmp_path):
    code = ("import sys\nfrom ddpdoctor.cli import main\n"
            "main(sys.argv[1:])\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'scipy', 'torch', 'rich'}))\n")
    for fmt, expected in (("json", "[]"), ("sarif", "[]"), ("concise", "[]"), ("github", "[]"), ("text", "['rich']")):
        done = subprocess.run([sys.executable, "-c", code, "check", "--static", str(DEMO), "--format", fmt,
                               "-o", str(tmp_path / f"out.{fmt}")], capture_output=True, text=True, cwd=REPO,
                              timeout=120, check=False)
        assert done.stdout.strip().splitlines()[-1] == expected, (fmt, done.stdout, done.stderr)


def test_the_entry_point_printing_to_stdout_imports_what_the_report_needs_only():
    """As a pre-commit hook runs it (`python -m ddpdoctor`, the report on stdout), read from `-X importtime`: no
    numpy, scipy or torch; rich only for a text report; no tempfile (only a report written to a file needs one)."""
    for fmt, rich in (("github", False), ("json", False), ("text", True)):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ddpdoctor", "check", "--static", str(DEMO),
                               "--format", fmt], capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
        assert done.returncode == 1 and done.stdout, (fmt, done.stderr[-2000:])  # the demo's findings
        imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                    if line.startswith("import time:")}
        top = {m.split(".")[0] for m in imported}
        assert not top & {"numpy", "scipy", "torch", "tempfile"}, (fmt, sorted(top))
        assert ("rich" in top) == rich, (fmt, sorted(top))
