"""What `ddpdoctor check --static` (the pre-commit hook's command) imports, per output format (issue 23).

The static path reads source and prints findings: it never needs torch, nothing that measures (numpy, scipy), and
rich only to lay out the text report. Each case runs the command as the hook runs it, a fresh
`python -X importtime -m ddpdoctor ...` process, and reads every module the process imported from the import-time
log (the process ends through `os._exit`, so nothing in it can report `sys.modules` afterwards; the log is what the
interpreter itself saw, nested imports included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "fixtures" / "demo" / "train.py"
PROJECT = REPO / "fixtures" / "projects"

NEVER = ("torch", "numpy", "scipy")  # measuring and training libraries: never on the static path
RICH = "rich"


def imported_modules(args: list[str], cwd: Path) -> tuple[int, set[str], str]:
    """(exit code, top-level names of every module the process imported, the rest of stderr)."""
    env = dict(os.environ)
    env.pop("PYTHONIMPORTTIME", None)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddpdoctor", *args],
        cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=300,
    )
    modules, other = set(), []
    for line in done.stderr.splitlines():
        if line.startswith("import time:"):
            name = line.rsplit("|", 1)[-1].strip()
            if name != "imported package":  # the header line
                modules.add(name.split(".")[0])
        else:
            other.append(line)
    return done.returncode, modules, "\n".join(other)


@pytest.mark.parametrize(
    "extra",
    [
        ["--format", "text"],
        ["--format", "json"],
        ["--format", "sarif"],
        ["--format", "github"],
        ["--format", "concise"],
        ["--format", "markdown"],
        ["--statistics"],
        ["--statistics", "--format", "json"],
    ],
    ids=lambda extra: "-".join(a.lstrip("-") for a in extra),
)
def test_static_check_imports_only_what_the_format_needs(extra: list[str]) -> None:
    code, modules, err = imported_modules(["check", "--static", str(DEMO), *extra], REPO)
    assert code == 1, err  # the demo's findings, at or above medium: the report was printed
    assert "ddpdoctor" in modules and "typer" in modules  # the log is read (typer is the CLI)
    assert not modules & set(NEVER), sorted(modules & set(NEVER))
    text_report = "--statistics" not in extra and extra[-1] == "text"
    assert (RICH in modules) == text_report, f"rich imported: {RICH in modules}, text report: {text_report}"


def test_pre_commit_path_several_files_and_a_report_file(tmp_path: Path) -> None:
    """As the hook passes them: several files (a project's, importing each other) and a directory; the report
    written to a file as JSON."""
    files = [*sorted(str(p) for p in (PROJECT / "mingpt_like").rglob("*.py")), str(PROJECT / "dino_like")]
    out = tmp_path / "report.json"
    code, modules, err = imported_modules(
        ["check", "--static", *files, "--format", "json", "-o", str(out), "--exit-zero"], tmp_path
    )
    assert code == 0, err
    assert out.read_text(encoding="utf-8").startswith("{")
    assert not modules & {*NEVER, RICH}, sorted(modules & {*NEVER, RICH})
