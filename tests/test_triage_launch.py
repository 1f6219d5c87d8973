"""Triage's arms in one launch (issue 23): each rank imports the interpreter's, torch's and the probe's modules once
and forks one child per arm (ddpdoctor.probe.zygote). The arms must be the runs separate launches make: the same
verdicts, the same measured numbers (to the precision goldens use), the same run-directory layout; a script that
cannot share a launch is launched once per arm and the report says so; nothing is left behind. Real 2-rank gloo
runs (slow)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from pinning import json_differences

from ddpdoctor.config import CheckConfig
from ddpdoctor.probe import armlaunch
from ddpdoctor.triage.run import TriageConfig, run_triage

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures" / "triage"
pytestmark = [pytest.mark.slow, pytest.mark.own_launch]  # its subject is the shared launch itself


def _triage(tmp_path: Path, name: str, keep: Path) -> dict:
    check = CheckConfig(script=FIXTURES / f"{name}.py", nproc=2, timeout=300.0, epochs=2, steps=5, quiet=True,
                        keep_run=keep)
    report = run_triage(TriageConfig(check=check, arms=("A", "P"), seed=0))
    return {"triage": report.triage, "rules": sorted({f.rule for f in report.findings}), "notes": list(report.notes),
            "layout": json.loads((keep / "triage.json").read_text(encoding="utf-8"))["layout"]}


def _left_when_stopped(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The zygotes' `left-rank<r>.json` present in a shared launch's control folder when its supervisor is
    stopped, one list per shared launch stopped."""
    from ddpdoctor.probe import shared

    seen: list[list[str]] = []
    stop = shared.Supervisor.stop

    def recording(self: shared.Supervisor, *args: object, **kwargs: object) -> dict:
        for scratch in self.scratch:
            if (Path(scratch) / "ctrl").is_dir():
                seen.append(sorted(p.name for p in (Path(scratch) / "ctrl").glob("left-*")))
        return stop(self, *args, **kwargs)

    monkeypatch.setattr(shared.Supervisor, "stop", recording)
    return seen


def test_a_zygote_told_to_stop_says_so_and_exits_0(tmp_path: Path) -> None:
    """A stop order: the zygote writes left-rank<r>.json and exits 0 — the children's way (threads, atexit,
    os._exit), not through the interpreter's teardown of torch, which the launch's end waited for (seconds)."""
    import subprocess
    import sys

    from ddpdoctor.probe.settings import RUN_DIR_ENV
    from ddpdoctor.probe.zygote import SHARED_ENV, left_file, order_file, write_atomic

    ctrl = tmp_path / "ctrl"
    ctrl.mkdir()
    write_atomic(order_file(ctrl, 0), {"stop": True})
    env = {**os.environ, SHARED_ENV: "1", RUN_DIR_ENV: str(ctrl), "RANK": "1"}
    done = subprocess.run([sys.executable, "-c", "import atexit, sys; atexit.register(print, 'atexit ran'); "
                           "from ddpdoctor.probe.zygote import main; sys.exit(main(['x.py']))"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "atexit ran"
    assert json.loads(left_file(ctrl, 1).read_text(encoding="utf-8"))["pid"] > 0
    assert not left_file(ctrl, 0).exists()


@pytest.mark.parametrize("name", ["fused_act_torch", "class_sorted"])
def test_arms_in_one_launch_are_the_runs_separate_launches_make(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """fused_act_torch: a CONFIRMED cause from the deterministic checks at identical weights; class_sorted: a
    LIKELY one from statistics the steps accumulate. One launch and two launches give the same report."""
    monkeypatch.chdir(REPO)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    left_at_stop = _left_when_stopped(monkeypatch)
    one = _triage(tmp_path, name, tmp_path / "one")
    assert one["layout"]["launch"] == {"shared": True, "separate": [], "why": None}
    # the zygotes left when told to (the launch is stopped once they have, not after the agent's teardown)
    assert left_at_stop == [["left-rank0.json", "left-rank1.json"]], left_at_stop
    for arm in ("arm-A", "arm-P"):
        launcher = json.loads((tmp_path / "one" / arm / "launcher.json").read_text(encoding="utf-8"))
        assert launcher["shared_launch"]["run"] == (1 if arm == "arm-A" else 2), launcher
        assert launcher["agent"]["ok"] is True and launcher["returncode"] == 0
        assert sorted(p.name for p in (tmp_path / "one" / arm / "logs").iterdir()) == [
            "rank0.stderr", "rank0.stdout", "rank1.stderr", "rank1.stdout"]
    assert not any(scratch.iterdir()), list(scratch.iterdir())  # the launch's control and scratch folders are gone

    monkeypatch.setattr(armlaunch, "shared_launch_refusal", lambda check: "a script that cannot share one (test)")
    two = _triage(tmp_path, name, tmp_path / "two")
    assert two["layout"]["launch"] == {"shared": False, "separate": ["A", "P"],
                                       "why": "a script that cannot share one (test)"}
    note = [n for n in two["notes"] if n.startswith("triage: arms A, P launched separately")]
    assert note and note[0].endswith("a script that cannot share one (test)"), two["notes"]
    assert not [n for n in one["notes"] if "launched separately" in n]

    assert one["rules"] == two["rules"]
    assert json_differences(two["triage"], one["triage"]) == []
    confirmed = [c["rule"] for c in one["triage"]["causes"] if c["verdict"] == "confirmed"]
    assert confirmed == (["DD208"] if name == "fused_act_torch" else []), one["triage"]["causes"]


def test_a_failing_rank_ends_its_arm_as_torchrun_would_and_the_next_arm_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of the as-written arm exits with code 3 at its second step while rank 0 waits in a collective: the
    arm ends (the peer stopped, as torchrun's agent stops it) with rank 1's failure recorded, and the next arm of
    the same launch runs."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "fails.py"
    script.write_text(
        (FIXTURES / "clean.py").read_text(encoding="utf-8")
        .replace("from common import", "import os, sys\nsys.path.insert(0, %r)\nfrom common import" % str(FIXTURES))
        .replace("        opt.step()\n",
                 "        opt.step()\n"
                 "        if os.environ.get('DDPDOCTOR_ARM') == 'A' and os.environ['RANK'] == '1' and "
                 "warmup.last_epoch == 2:\n"
                 "            sys.exit(3)\n"),
        encoding="utf-8",
    )
    check = CheckConfig(script=script, nproc=2, timeout=300.0, epochs=2, steps=4, quiet=True)
    a, p = armlaunch.run_arms(check, [(tmp_path / "arm-A", {"arm": "A", "seed": 0}),
                                       (tmp_path / "arm-P", {"arm": "P", "seed": 0, "bn_mode": "plain"})])
    la = json.loads((a / "launcher.json").read_text(encoding="utf-8"))
    lp = json.loads((p / "launcher.json").read_text(encoding="utf-8"))
    assert la["returncode"] == 1 and not la["timed_out"], la
    failures = [(f["rank"], f["exitcode"]) for f in la["agent"]["failures"]]
    assert (1, 3) in failures and all(rank == 0 for rank, _ in failures if (rank, _) != (1, 3)), la["agent"]
    assert lp["returncode"] == 0 and lp["shared_launch"]["run"] == 2, lp
    assert os.environ.get("DDPDOCTOR_ARM") is None


def test_an_arm_that_times_out_ends_the_shared_launch_and_the_next_arms_run_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The as-written arm hangs after its first step: it times out as a run of its own would (its own timeout,
    recorded as a timeout), the shared launch is stopped with it, and the next arm is launched alone — the report
    says so — leaving no temporary folder behind."""
    monkeypatch.chdir(tmp_path)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    script = tmp_path / "hangs.py"
    script.write_text(
        (FIXTURES / "clean.py").read_text(encoding="utf-8")
        .replace("from common import", "import os, sys, time\nsys.path.insert(0, %r)\nfrom common import"
                 % str(FIXTURES))
        .replace("        opt.step()\n",
                 "        opt.step()\n"
                 "        while os.environ.get('DDPDOCTOR_ARM') == 'A' and warmup.last_epoch == 1:\n"
                 "            time.sleep(0.1)\n"),
        encoding="utf-8",
    )
    keep = tmp_path / "keep"
    check = CheckConfig(script=script, nproc=2, timeout=60.0, epochs=1, steps=3, quiet=True, keep_run=keep)
    report = run_triage(TriageConfig(check=check, arms=("A", "P"), seed=0))
    layout = json.loads((keep / "triage.json").read_text(encoding="utf-8"))["layout"]
    why = "the shared launch ended early: a run timed out"
    assert layout["launch"] == {"shared": True, "separate": ["P"], "why": why}
    la = json.loads((keep / "arm-A" / "launcher.json").read_text(encoding="utf-8"))
    lp = json.loads((keep / "arm-P" / "launcher.json").read_text(encoding="utf-8"))
    assert la["timed_out"] is True and la["shared_launch"]["run"] == 1, la
    assert "shared_launch" not in lp, lp
    assert any(n.startswith("triage: arm P launched separately") for n in report.notes), report.notes
    assert not any(scratch.iterdir()), list(scratch.iterdir())


def test_a_run_of_a_shared_launch_is_started_with_what_a_launch_of_its_own_would_give_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An order carries the run's whole environment and working directory as they are when the run starts, not
    as they were when the launch started (tests/launchpool.py runs a test's checks in one launch kept for the
    session); torchrun's own rank variables stay, the TMPDIR is the run's."""
    import ast

    from ddpdoctor.probe.launcher import run_probe
    from ddpdoctor.probe.shared import SharedLaunch

    monkeypatch.chdir(REPO)
    script = (REPO / "fixtures" / "probe" / "launch" / "started_with.py").resolve()
    cfg = CheckConfig(script=script, nproc=2, timeout=300.0, quiet=True)
    launch = SharedLaunch(cfg, 2).start()
    try:
        seen = []
        for run, value in enumerate(("first", "second"), start=1):
            folder = tmp_path / value
            folder.mkdir()
            monkeypatch.chdir(folder)  # after the launch started, as the variable below
            monkeypatch.setenv("STARTED_WITH_NAME", "STARTED_WITH_VALUE")
            monkeypatch.setenv("STARTED_WITH_VALUE", value)
            run_dir = tmp_path / f"run-{value}"
            run_probe(cfg, run_dir, shared=launch)
            assert json.loads((run_dir / "launcher.json").read_text(encoding="utf-8"))["shared_launch"]["run"] \
                == run
            for rank in (0, 1):
                line = next(x for x in (run_dir / "logs" / f"rank{rank}.stdout").read_text().splitlines()
                            if x.startswith("started_with "))
                got = ast.literal_eval(line.split(" ", 1)[1])
                assert got["value"] == value and got["cwd"] == str(folder)
                assert (got["rank"], got["local_rank"], got["world_size"]) == (str(rank), str(rank), "2")
                assert Path(got["tmpdir"]).parent == Path(launch.scratch)  # the run's own, in the launch's
                seen.append(got)
    finally:
        launch.close()
    assert not Path(launch.scratch).exists()
