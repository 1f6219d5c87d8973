"""Findings that say what the probe really did: DD104 only claims to have measured past a literal rank when the
ranks then joined; DD901's fix fits the call the ranks waited in; DD902's traceback is the script's, not the
probe's. Hand-built runs and recorded text (fast)."""

from __future__ import annotations

from pathlib import Path

from test_analyses_synthetic import SITE, Run

from ddpdoctor.analyses import analyze_run
from ddpdoctor.analyses.outcome import without_probe_frames
from ddpdoctor.rules.dd901_probe_hang.probe import fix_for


def test_dd104_says_when_the_override_did_not_get_the_ranks_through(tmp_path: Path) -> None:
    run = Run(tmp_path / "run", timed_out=True, returncode=-9, stopped_by_probe=True)
    begin = {"site": SITE, "rank_arg": 0, "world_size_arg": 2, "env_world_size": "2",
             "overridden": {"rank": [0, 1]}, "rendezvous": None}
    run.process(100, 0, events=[("pg_init_begin", {**begin, "env_rank": "0", "overridden": {}})])
    run.process(101, 1, events=[("pg_init_begin", {**begin, "env_rank": "1"})])
    [f] = [f for f in analyze_run(run.root).findings if f.rule == "DD104"]
    assert "still did not join the process group before the timeout" in f.message
    assert "went on measuring" not in f.message and "keep measuring" not in f.message


def test_dd901_fix_follows_the_pending_call() -> None:
    assert fix_for([{"waiting_in": {"kind": "rendezvous"}}, {"waiting_in": {"kind": "collective"}}]) == "rendezvous"
    assert fix_for([{"waiting_in": None, "last_event": {"kind": "pg_init_begin"}}]) == "rendezvous"
    assert fix_for([{"waiting_in": {"kind": "point_to_point"}}]) == "point_to_point"
    assert fix_for([{"waiting_in": {"kind": "backward"}}]) == "backward"
    assert fix_for([{"waiting_in": {"kind": "collective"}}, {"waiting_in": {"kind": "backward"}}]) == "probe"


def test_recorded_tracebacks_lose_the_probes_frames_and_keep_the_scripts() -> None:
    recorded = (
        "Traceback (most recent call last):\n"
        '  File "/elsewhere/checkout/ddpdoctor/probe/bootstrap.py", line 60, in run_script\n'
        "    script_globals = runpy.run_path(script_abs, run_name=\"__main__\")\n"
        "                     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        '  File "<frozen runpy>", line 291, in run_path\n'
        '  File "<frozen runpy>", line 98, in _run_module_code\n'
        '  File "/proj/train.py", line 11, in <module>\n'
        "    y = x.view(5, 5)\n"
        '  File "/elsewhere/checkout/ddpdoctor/probe/emulation.py", line 700, in __torch_function__\n'
        "    return func(*args, **kwargs)\n"
        "RuntimeError: shape '[5, 5]' is invalid for input of size 24\n"
    )
    clean = without_probe_frames(recorded)
    assert clean == (
        "Traceback (most recent call last):\n"
        '  File "/proj/train.py", line 11, in <module>\n'
        "    y = x.view(5, 5)\n"
        "RuntimeError: shape '[5, 5]' is invalid for input of size 24\n"
    )
