"""The README's terminal pictures (docs/*.svg, `make docs`) are what the tool prints (issue 22: they had drifted):
each picture is exactly the SVG of the output captured beside it (docs/*.ansi), and — slow, it runs the commands —
that output is what the command prints today, measured numbers and durations aside."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_capture", REPO / "docs" / "capture.py")
capture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capture)

STALE = "docs/{name}.svg is stale: run `make docs` (docs/capture.py) and commit the pictures"


@pytest.mark.parametrize("name", sorted(capture.PICTURES))
def test_picture_is_the_captured_output(name):
    title, _, _ = capture.PICTURES[name]
    ansi = (REPO / "docs" / f"{name}.ansi").read_text(encoding="utf-8")
    svg = (REPO / "docs" / f"{name}.svg").read_text(encoding="utf-8")
    assert svg == capture.svg_text(name, title, ansi), STALE.format(name=name)
    assert f"docs/{name}.svg" in (REPO / "README.md").read_text(encoding="utf-8")


def test_comparable_ignores_numbers_widths_and_colour_but_not_words():
    a = "\x1b[1mDD204\x1b[0m  noise 0.083 std\n──────\nbn1   6.4e-09   0.79\n"
    b = "DD204 noise 0.094 std\n────\nbn1 9.8e-09 0.88\n"
    assert capture.comparable(a) == capture.comparable(b)
    assert capture.comparable(a) != capture.comparable(a.replace("noise", "jitter"))
    # torch's build is the machine's, not the tool's output (a CUDA build runs the same demo on a CPU machine)
    assert capture.comparable("torch 2.13.0+cpu, python") == capture.comparable("torch 2.11.0+cu130, python")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(capture.PICTURES))
def test_captured_output_is_what_the_command_prints_today(name):
    _, args, stream = capture.PICTURES[name]
    stored = capture.comparable((REPO / "docs" / f"{name}.ansi").read_text(encoding="utf-8"))
    today = capture.comparable(capture.run_in_terminal(args, stream))
    diff = list(difflib.unified_diff(stored, today, "picture", "today", lineterm="", n=5))
    assert not diff, STALE.format(name=name) + "\n" + "\n".join(diff[:60])
