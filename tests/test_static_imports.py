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


def imported_modules(args: list[str], cwd: Path, *, full: bool = False) -> tuple[int, set[str], str]:
    """(exit code, top-level names (`full`: whole names) of every module the process imported, the rest of
    stderr)."""
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
                modules.add(name if full else name.split(".")[0])
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



def _rule_modules(code: str, cwd: Path) -> set[str]:
    """The rule modules (`ddpdoctor.rules.ddNNN_*`, their halves included) a fresh process running `code` imported:
    read from `sys.modules`, as the catalog imports them with `importlib.import_module`, which `-X importtime`
    does not log."""
    done = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\nprint(*(m for m in sys.modules if m.startswith("
         "'ddpdoctor.rules.dd')), file=sys.stderr)"],
        cwd=cwd, capture_output=True, text=True, check=True, timeout=300,
    )
    return set(done.stderr.split())


@pytest.mark.parametrize("fmt", ["json", "text", "sarif"])
def test_static_check_imports_every_static_rule_and_no_probe_half(fmt: str, tmp_path: Path) -> None:
    """The catalog is imported as far as it is used (ddpdoctor.rules): `check --static` runs the static half of
    every rule that has one (all of them, whatever the script), imports no probe half, and of the rules without a
    static half only the packages that reading the settings it needs imports. Derived from the registry: a rule
    added to it is in the expectation without a word here. (A pyproject with a [tool.ddpdoctor] table reads
    every rule's settings: there is none above tmp_path.)"""
    from ddpdoctor.rules import NAMES, RULES

    script = tmp_path / "train.py"
    script.write_text(DEMO.read_text(encoding="utf-8"), encoding="utf-8")
    args = ["check", "--static", str(script), "--format", fmt]
    rules = _rule_modules(
        f"import io, contextlib, ddpdoctor.cli as c\nwith contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert c.main({args!r}) == 1", tmp_path)
    assert [r.package for r in RULES] == [f"ddpdoctor.rules.{n}" for n in NAMES]
    static_halves = {f"{r.package}.static" for r in RULES if r.static}
    assert static_halves and static_halves <= rules, sorted(static_halves - rules)
    assert not {m for m in rules if m.endswith(".probe")}, sorted(m for m in rules if m.endswith(".probe"))
    probe_only = {r.package for r in RULES if not r.static}
    for_settings = _rule_modules("from ddpdoctor.config import CheckConfig", tmp_path)
    assert rules & probe_only <= for_settings, sorted(rules & probe_only - for_settings)
    assert len(rules & probe_only) < len(probe_only)  # the probe's own rules stay out
