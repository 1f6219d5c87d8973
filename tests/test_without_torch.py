"""torch is not a dependency: what needs no torch works without it, what needs it says so in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# An interpreter where `import torch` fails, as in a pre-commit hook environment.
PRELUDE = "import sys; sys.modules['torch'] = None\nfrom ddpdoctor.cli import main\n"


def _run(args: list[str]) -> subprocess.CompletedProcess:
    code = PRELUDE + (f"rc = main({args!r})\n"
                      "assert 'torch' not in sys.modules or sys.modules['torch'] is None\nsys.exit(rc)\n")
    return subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_static_check_report_formats_and_rules_need_no_torch() -> None:
    for fmt in ("text", "json", "sarif", "github"):
        done = _run(["check", "--static", "--format", fmt, "fixtures/demo/train.py"])
        assert done.returncode == 1, done.stderr  # the demo's findings, at or above medium
    assert _run(["rules"]).returncode == 0
    assert _run(["report", "fixtures/runs/ckpt_save_rank0"]).returncode in (0, 1)


def test_probe_and_compare_bn_say_torch_is_missing() -> None:
    for args in (["check", "fixtures/demo/train.py"], ["compare-bn"]):
        done = _run(args)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "which has no torch" in lines[0] and "Traceback" not in done.stderr, done.stderr
