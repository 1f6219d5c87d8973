"""Pinned reports: `ddpdoctor report DIR` on the demo's recorded run and on every recorded run in fixtures/runs/,
in text and JSON, byte for byte against the golden files in tests/golden/reports/.

Refactorings must leave what users read unchanged; a change that means to change a report regenerates the golden
files and shows the difference in review:

    DDPDOCTOR_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_report_pins.py

The inputs are recorded runs, so nothing here depends on the clock, the machine or the current directory: the
times and paths in a report are the ones recorded in the run directory.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from ddpdoctor.cli import main

REPO = Path(__file__).resolve().parents[1]
RUNS_DIR = REPO / "fixtures" / "runs"
GOLDEN = Path(__file__).resolve().parent / "golden" / "reports"
UPDATE = os.environ.get("DDPDOCTOR_UPDATE_GOLDEN") == "1"
FORMATS = {"text": "txt", "json": "json"}

RUNS = sorted(p for p in RUNS_DIR.iterdir() if (p / "meta.json").is_file())


def _golden(run: Path, fmt: str) -> Path:
    return GOLDEN / f"{run.name}.{FORMATS[fmt]}"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_report_matches_its_golden_file(run: Path, fmt: str, tmp_path: Path):
    out = tmp_path / "report"
    code = main(["report", str(run), "--format", fmt, "--output", str(out)])
    assert code in (0, 1), f"ddpdoctor report {run.name} exited {code}"
    got = out.read_text(encoding="utf-8")
    golden = _golden(run, fmt)
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got, encoding="utf-8")
        return
    assert golden.is_file(), f"no golden file {golden.relative_to(REPO)}: run with DDPDOCTOR_UPDATE_GOLDEN=1"
    want = golden.read_text(encoding="utf-8")
    if got != want:
        diff = "".join(
            difflib.unified_diff(
                want.splitlines(keepends=True), got.splitlines(keepends=True), str(golden.name), "now", n=2
            )
        )
        pytest.fail(f"the {fmt} report of {run.name} changed:\n{diff[:6000]}")


def test_the_demo_run_is_pinned():
    # `make demo` is what a newcomer sees first: its recorded run is one of the pinned ones
    assert (RUNS_DIR / "demo" / "meta.json").is_file()


def test_every_golden_file_has_its_run():
    expected = {_golden(run, fmt).name for run in RUNS for fmt in FORMATS}
    stale = sorted(p.name for p in GOLDEN.iterdir() if p.name not in expected) if GOLDEN.is_dir() else []
    assert not stale, f"golden files without a recorded run (delete them): {stale}"
