"""Pinned reports: `ddpdoctor report DIR` on the demo's recorded run and on every recorded run in fixtures/runs/,
in text and JSON, against the golden files in tests/golden/reports/.

Refactorings must leave what users read unchanged; a change that means to change a report regenerates the golden
files and shows the difference in review:

    DDPDOCTOR_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_report_pins.py

The inputs are recorded runs, so nothing here depends on the clock or the current directory: the times and paths in
a report are the ones recorded in the run directory. The computed numbers do depend on the machine in their last
digits (numpy/scipy reduce in a different order on another CPU), so they are compared to a stated precision
(tests/pinning.py): JSON numbers to 6 significant digits, printed numbers to one unit of their last printed digit;
everything else byte for byte. The JSON golden files store floats rounded to 10 significant digits.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import pytest
from pinning import json_differences, rounded, text_matches

from ddpdoctor.cli import main
from ddpdoctor.dev.evidence import GOLDEN, REPO, recorded_runs
from ddpdoctor.dev.evidence import GOLDEN_FORMATS as FORMATS
from ddpdoctor.dev.evidence import RUNS as RUNS_DIR
from ddpdoctor.dev.evidence import golden as _golden

UPDATE = os.environ.get("DDPDOCTOR_UPDATE_GOLDEN") == "1"

RUNS = recorded_runs()  # every recorded run and its golden reports: the index of the rules' evidence


def _pinned_form(text: str, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rounded(json.loads(text)), indent=2) + "\n"
    return text


def _differences(want: str, got: str, fmt: str) -> list[str]:
    if fmt == "json":
        return json_differences(json.loads(want), json.loads(got))
    w_lines, g_lines = want.splitlines(), got.splitlines()
    if len(w_lines) == len(g_lines) and all(text_matches(w, g) for w, g in zip(w_lines, g_lines)):
        return []
    return list(difflib.unified_diff(w_lines, g_lines, "pinned", "now", n=2, lineterm=""))


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
        golden.write_text(_pinned_form(got, fmt), encoding="utf-8")
        return
    assert golden.is_file(), f"no golden file {golden.relative_to(REPO)}: run with DDPDOCTOR_UPDATE_GOLDEN=1"
    differences = _differences(golden.read_text(encoding="utf-8"), got, fmt)
    if differences:
        pytest.fail(f"the {fmt} report of {run.name} changed:\n" + "\n".join(differences)[:6000])


def test_the_demo_run_is_pinned():
    # `make demo` is what a newcomer sees first: its recorded run is one of the pinned ones
    assert (RUNS_DIR / "demo" / "meta.json").is_file()


def test_every_golden_file_has_its_run():
    expected = {_golden(run, fmt).name for run in RUNS for fmt in FORMATS}
    stale = sorted(p.name for p in GOLDEN.iterdir() if p.name not in expected) if GOLDEN.is_dir() else []
    assert not stale, f"golden files without a recorded run (delete them): {stale}"


def test_the_comparison_tolerates_round_off_and_nothing_else():
    # float64 noise from another CPU passes; a changed value, a changed count or changed words do not
    assert not json_differences({"f": 176.87270835084377, "n": 3}, {"f": 176.87270835084382, "n": 3})
    assert json_differences({"f": 176.8727}, {"f": 176.9})
    assert json_differences({"n": 3}, {"n": 4})
    assert json_differences({"s": "p = 0.5"}, {"s": "q = 0.5"})
    assert text_matches("p = 8.85e-05, 1.10 std", "p = 8.86e-05, 1.11 std")  # a rounding boundary, either way
    assert not text_matches("p = 8.85e-05", "p = 8.95e-05")
    assert not text_matches("step 3 of 4", "step 4 of 4")
