"""compare-bn's progress on stderr (issue 22): the ranks' phases, live on a terminal, a few plain lines elsewhere,
a suspected hang said before the timeout, nothing with --quiet."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from ddpdoctor.comparebn.progress import PhaseDisplay

REPO = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_plain_lines_follow_the_stages_not_every_step():
    clock, out = Clock(), io.StringIO()
    d = PhaseDisplay("compare-bn: 2 ranks", nproc=2, timeout=300, stream=out, terminal=False, clock=clock)
    for phases in (["", ""], ["importing torch", ""], ["importing torch", "importing torch"],
                   ["mode local, step 1/20", "mode local, step 1/20"], ["mode local, step 2/20", ""],
                   ["mode sync, step 1/20", "mode sync, step 3/20"], ["done", "done"]):
        clock.t += 1.0
        d.update(phases)
    d.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "ddpdoctor: compare-bn: 2 ranks (timeout 300 s)"
    assert lines[1] == "ddpdoctor: rank 0: importing torch; rank 1: starting (2.0 s)"
    assert lines[3] == "ddpdoctor: rank 0: mode local, step 1/20; rank 1: mode local, step 1/20 (4.0 s)"
    assert not any("step 2/20" in ln for ln in lines)  # a step within the same mode is no new line
    assert lines[-1].startswith("ddpdoctor: ranks finished in 7.0 s")
    assert len(lines) == 7 and "\x1b" not in out.getvalue()


def test_a_stall_is_a_suspected_hang_before_the_timeout():
    clock, out = Clock(), io.StringIO()
    d = PhaseDisplay("compare-bn", nproc=2, timeout=40, stream=out, terminal=False, clock=clock)
    d.update(["mode sync, step 3/20", "mode sync, step 3/20"])
    clock.t += 9.0
    d.update(["mode sync, step 3/20", "mode sync, step 3/20"])
    assert "suspected hang" not in out.getvalue()
    clock.t += 2.0
    d.update(["mode sync, step 3/20", "mode sync, step 3/20"])
    clock.t += 1.0
    d.update(["mode sync, step 3/20", "mode sync, step 3/20"])
    hangs = [ln for ln in out.getvalue().splitlines() if "suspected hang" in ln]
    assert hangs == ["ddpdoctor: still running after 11.0 s: rank 0: mode sync, step 3/20; rank 1: mode sync, "
                     "step 3/20 — no rank has moved on for 11.0 s: a suspected hang"]
    d.close(ok=False)


def test_terminal_display_is_live_and_transient():
    clock, out = Clock(), io.StringIO()
    d = PhaseDisplay("compare-bn: 2 ranks", nproc=2, timeout=300, stream=out, terminal=True, width=80, clock=clock)
    clock.t += 1.0
    d.update(["building the model", "importing torch"])
    assert "rank 0: building the model" in out.getvalue() and "\x1b[" in out.getvalue()
    d.close()
    assert out.getvalue().rstrip().splitlines()[-1].endswith("ddpdoctor: ranks finished in 1.0 s; analysing")


@pytest.mark.slow
@pytest.mark.parametrize("quiet", [False, True])
def test_compare_bn_says_what_the_ranks_do(quiet):
    argv = [sys.executable, "-m", "ddpdoctor", "compare-bn", "--steps", "2", "--format", "json"]
    done = subprocess.run(argv + (["--quiet"] if quiet else []), cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    if quiet:
        assert done.stderr == ""
        return
    lines = done.stderr.splitlines()
    assert lines[0].startswith("ddpdoctor: compare-bn: 2 ranks × batch 16, 2 steps per BN mode, iid shards")
    # what the ranks do, sampled every refresh: which phases a line catches depends on the machine's speed
    assert any("rank 0: " in ln and "rank 1: " in ln for ln in lines[1:-1]), lines
    assert lines[-1].startswith("ddpdoctor: ranks finished in ")
