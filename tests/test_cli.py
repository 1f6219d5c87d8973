"""The command line contract: `rules`, `explain`, `--version`, and bad input ending as exit 2 with exactly one
line on stderr and no traceback. In-process through `ddpdoctor.cli.main(argv)`, plus subprocesses for what only
a real process shows (the console entry, sys.exit codes, that these commands never import torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddpdoctor import __version__
from ddpdoctor.cli import main
from ddpdoctor.rules import RULES, get_rule


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *fragments: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ddpdoctor: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


def test_rules_json_lists_the_whole_catalog(capsys):
    code, out, err = run_main(capsys, "rules", "--format", "json")
    assert (code, err) == (0, "")
    rules = json.loads(out)
    assert [r["rule"] for r in rules] == [r.code for r in RULES]
    for entry in rules:
        assert {"rule", "name", "severity", "summary", "static", "probe", "category"} <= set(entry)
    first = rules[0]
    assert (first["name"], first["severity"], first["category"]) == ("sync-bn-after-ddp", "medium", "setup")
    assert (first["static"], first["probe"]) == (True, True)


def test_rules_text(capsys):
    code, out, err = run_main(capsys, "rules")
    assert (code, err) == (0, "")
    assert "DD101" in out and "sync-bn-after-ddp" in out and "DD903" in out


def test_explain_prints_the_documentation(capsys):
    code, out, err = run_main(capsys, "explain", "DD101")
    assert (code, err) == (0, "")
    from ddpdoctor.consequences import explain_section

    assert out == get_rule("DD101").documentation() + explain_section(get_rule("DD101"))  # + its measured cost
    for heading in ("What it detects", "Why it hurts accuracy", "Example", "Fix"):
        assert f"\n{heading}\n" in out
    code, out, _ = run_main(capsys, "explain", "dd301")
    assert code == 0 and out.startswith("DD301 sampler-not-reshuffled")


def test_explain_unknown_rule_is_exit_2_with_one_line(capsys):
    code, out, err = run_main(capsys, "explain", "DD999")
    assert code == 2 and out == ""
    assert_one_line_error(err, "DD999", "ddpdoctor rules")


@pytest.mark.parametrize(
    "argv",
    [
        ["rules", "--format", "xml"],
        ["check", "train.py", "--format", "xml"],
        ["report", "run-dir", "--format", "xml"],
    ],
)
def test_unknown_format_is_exit_2(capsys, argv):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert_one_line_error(err, "--format", "xml")


@pytest.mark.parametrize(
    "argv",
    [["check", "train.py", "--no-such-option"], ["rules", "--bogus"], ["frobnicate"], ["explain"]],
)
def test_bad_command_lines_are_exit_2(capsys, argv):
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    assert_one_line_error(err)


def test_missing_script_is_exit_2(capsys, tmp_path):
    code, out, err = run_main(capsys, "check", str(tmp_path / "missing.py"), "--static")
    assert code == 2
    assert_one_line_error(err, "missing.py", "no such file")


def test_version(capsys):
    code, out, err = run_main(capsys, "--version")
    assert (code, out, err) == (0, f"ddpdoctor {__version__}\n", "")


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)


def test_process_exit_codes_and_no_traceback():
    bad = _python("-m", "ddpdoctor", "explain", "DD999")
    assert bad.returncode == 2 and bad.stdout == ""
    assert_one_line_error(bad.stderr, "DD999")

    ok = _python("-m", "ddpdoctor", "rules", "--format", "json")
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)) == len(RULES)


def test_catalog_and_renderers_never_import_torch():
    # `rules`/`explain` and every report format must stay fast: torch costs over a second to import
    code = (
        "import sys\n"
        "from ddpdoctor.cli import main\n"
        "from ddpdoctor.report import Report\n"
        "from ddpdoctor.report.render import render\n"
        "assert main(['rules', '--format', 'json']) == 0\n"
        "assert main(['explain', 'DD204']) == 0\n"
        "for fmt in ('text', 'json', 'sarif', 'github'):\n"
        "    render(Report(script='train.py'), fmt, color=False)\n"
        "sys.stderr.write('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
    )
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "torch not imported"


def _params(command) -> list[tuple]:
    return [(p.name, p.opts, p.secondary_opts, p.type.name, p.required, repr(p.default), p.nargs, p.multiple,
             getattr(p, "help", None), p.is_eager, p.callback is None) for p in command.params]


def test_a_command_line_naming_a_command_runs_that_command_as_the_whole_group_does():
    """`ddpdoctor CMD ...` builds a group of CMD alone (typer converts every command on every run): each command
    converts to the same parameters and help as in the whole group; anything else gets the whole group."""
    import typer

    from ddpdoctor import cli

    whole = typer.main.get_command(cli.app)
    assert len(whole.commands) == len(cli.app.registered_commands) > 1
    for name, command in whole.commands.items():
        group = cli._click_command([name, "--help"])
        assert list(group.commands) == [name]
        alone = group.commands[name]
        ctx = typer.Context(command, info_name=name, parent=typer.Context(whole, info_name="ddpdoctor"))
        alone_ctx = typer.Context(alone, info_name=name, parent=typer.Context(group, info_name="ddpdoctor"))
        assert _params(alone) == _params(command), name
        assert alone.get_help(alone_ctx) == command.get_help(ctx), name
    assert list(typer.main.get_command(cli.app).commands) == list(whole.commands)  # the app is left whole
    for args in ([], ["--help"], ["--version"], ["chek"], ["-h", "check"]):
        assert list(cli._click_command(args).commands) == list(whole.commands), args
