"""Scripts built on Lightning, Accelerate and the Hugging Face Trainer (issue 21).

Static analysis reads them through the models of apis/frameworks.py (the fixtures in fixtures/static/frameworks/
and fixtures/static/DD904/ carry their `# expect:` markers and run in tests/test_static_fixtures.py); here: the
command line never gives such a script, or one whose engine is not modelled, a false "No findings", and the
static path never imports a framework.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STATIC = REPO / "fixtures" / "static"
FRAMEWORK_MODULES = ("lightning", "pytorch_lightning", "accelerate", "transformers", "deepspeed")


def _check_static(path: Path) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "check", "--static", str(path), "--format", "json"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize(
    "name, codes",
    [
        ("frameworks/bad_lightning.py", {"DD504", "DD209", "DD401"}),
        ("frameworks/bad_accelerate.py", {"DD501", "DD502", "DD401"}),
        ("DD904/bad_deepspeed.py", {"DD904"}),
        ("DD904/bad_unknown_trainer.py", {"DD904"}),
    ],
)
def test_buggy_framework_scripts_are_never_a_clean_bill(name: str, codes: set[str]) -> None:
    rc, report = _check_static(STATIC / name)
    assert {f["rule"] for f in report["findings"]} == codes
    assert rc == 1  # a high or medium finding among them fails the default gate


@pytest.mark.parametrize("name", ["frameworks/good_lightning.py", "frameworks/good_accelerate.py",
                                  "frameworks/good_hf_trainer.py"])
def test_correct_framework_scripts_pass(name: str) -> None:
    rc, report = _check_static(STATIC / name)
    assert rc == 0
    assert report["findings"] == []


def test_not_analysed_names_the_engine() -> None:
    rc, report = _check_static(STATIC / "DD904" / "bad_deepspeed.py")
    (finding,) = report["findings"]
    assert finding["message"].startswith("not analysed: DeepSpeed (deepspeed.initialize)")
    assert finding["severity"] == "high" and rc == 1


def test_static_path_never_imports_a_framework() -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ddpdoctor.static import analyze_file\n"
        f"for p in sorted(Path({str(STATIC / 'frameworks')!r}).glob('*.py')):\n"
        "    analyze_file(p)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORK_MODULES!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
