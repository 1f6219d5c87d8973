"""Launch mode and how a launch ended as types (ddpdoctor.records.LaunchMode / LaunchEnd), and the one poll loop
that watches a launch (ddpdoctor.probe.watch.watch), used by a launch of its own and by a shared launch's runs.

The on-disk strings stay what recorded runs hold: every recorded run's meta.json and launcher.json read into the
types and write back unchanged. The loop is driven here with stand-in callbacks (no process): what ends it, in
which order it looks, and the signals held during its clean-up."""

from __future__ import annotations

import ast
import json
import os
import signal
import time
from pathlib import Path

import pytest

from ddpdoctor.probe.settings import ProbeSettings
from ddpdoctor.probe.watch import watch
from ddpdoctor.records import LaunchEnd, LaunchMode, LaunchRecord, RunMeta

pytestmark = pytest.mark.own_launch  # its subject is the launch itself: never the pool of tests/launchpool.py

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "fixtures" / "runs"


def test_a_launch_mode_is_its_on_disk_string():
    assert [m.value for m in LaunchMode] == ["torchrun", "spawn", "single", "attach"]
    for mode in LaunchMode:
        assert mode == mode.value and f"{mode}" == str(mode) == mode.value
        assert json.dumps({"mode": mode}) == json.dumps({"mode": mode.value})
        assert json.dumps({"mode": mode}, indent=1) == json.dumps({"mode": mode.value}, indent=1)
    assert {m for m in LaunchMode if m.starts_once} == {LaunchMode.SPAWN, LaunchMode.SINGLE}
    assert LaunchMode.of("srun") is None and LaunchMode.of(None) is None


def test_probe_settings_carry_the_mode_through_the_environment():
    settings = ProbeSettings(run_dir="/tmp/x", mode="spawn")  # given as its string: the member
    assert settings.mode is LaunchMode.SPAWN
    env = {k: v for k, v in settings.to_env().items()}
    assert env["DDPDOCTOR_MODE"] == "spawn"
    assert ProbeSettings.from_env(env).mode is LaunchMode.SPAWN
    with pytest.raises(ValueError):
        ProbeSettings(run_dir="/tmp/x", mode="nonsense")


def _recorded(name: str) -> list[Path]:
    return sorted(p for p in RUNS.rglob(name) if p.is_file())


def test_every_recorded_meta_reads_its_mode_and_writes_back_unchanged():
    metas = _recorded("meta.json")
    assert metas
    for path in metas:
        data = json.loads(path.read_text(encoding="utf-8"))
        meta = RunMeta.from_json(data)
        assert isinstance(meta.mode, LaunchMode), path
        assert json.dumps(meta.to_json(), sort_keys=True) == json.dumps(data, sort_keys=True), path


def test_an_unknown_mode_is_kept_as_written():
    meta = RunMeta.from_json({"mode": "from-the-future"})
    assert meta.mode == "from-the-future" and meta.to_json() == {"mode": "from-the-future"}


def test_every_recorded_launch_reads_one_end_and_writes_back_unchanged():
    launches = _recorded("launcher.json")
    assert launches
    seen = set()
    for path in launches:
        data = json.loads(path.read_text(encoding="utf-8"))
        record = LaunchRecord.from_json(data)
        end = record.end
        seen.add(end)
        assert end.flags(timed_out=bool(data.get("timed_out"))) == {
            "timed_out": bool(data.get("timed_out")), "interrupted": bool(data.get("interrupted"))}, path
        assert (end is LaunchEnd.RANKS_EXITED) == bool(data.get("agent_stopped_after_ranks_exited")), path
        assert json.dumps(record.to_json(), sort_keys=True) == json.dumps(data, sort_keys=True), path
    assert {LaunchEnd.EXITED, LaunchEnd.RANKS_EXITED, LaunchEnd.TIMED_OUT} <= seen


@pytest.mark.parametrize("end", list(LaunchEnd))
def test_an_end_written_as_flags_reads_back(end):
    record = LaunchRecord(**end.flags(), agent_stopped_after_ranks_exited=end is LaunchEnd.RANKS_EXITED)
    assert LaunchRecord.from_json(json.loads(json.dumps(record.to_json()))).end is end
    # a signal during the clean-up after the timeout: both flags, as before; the end is INTERRUPTED
    both = LaunchEnd.INTERRUPTED.flags(timed_out=True)
    assert both == {"timed_out": True, "interrupted": True}
    assert LaunchRecord(**both).end is LaunchEnd.INTERRUPTED


# ---------------------------------------------------------------------------------------------- the poll loop


class Calls:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.cleaned: list[LaunchEnd | None] = []

    def clean_up(self, end: LaunchEnd | None) -> str:
        self.cleaned.append(end)
        return "stopped"


def _watch(tmp_path: Path, calls: Calls, *, deadline: float, ended, tick=None, clean_up=None):
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    (tmp_path / "events").mkdir(exist_ok=True)
    watched = watch(run_dir=tmp_path, deadline=deadline, scratch=str(scratch), ended=ended, tick=tick,
                    clean_up=clean_up or calls.clean_up, start=lambda: calls.log.append("start"))
    assert not scratch.exists()  # removed whatever ended the run
    return watched


def test_the_loop_ends_when_the_run_ends(tmp_path):
    calls = Calls()
    answers = iter([None, None, LaunchEnd.EXITED])
    watched = _watch(tmp_path, calls, deadline=time.monotonic() + 600, ended=lambda: next(answers))
    assert (watched.end, watched.timed_out, watched.dumped, watched.stopped) == (LaunchEnd.EXITED, False, [],
                                                                                 "stopped")
    assert calls.log == ["start"] and calls.cleaned == [LaunchEnd.EXITED]


def test_a_tick_may_end_the_run_and_sees_the_poll_count(tmp_path):
    calls = Calls()
    seen: list[int] = []

    def tick(polls: int) -> LaunchEnd | None:
        seen.append(polls)
        return LaunchEnd.RANKS_EXITED if polls == 4 else None

    watched = _watch(tmp_path, calls, deadline=time.monotonic() + 600, ended=lambda: None, tick=tick)
    assert watched.end is LaunchEnd.RANKS_EXITED and seen == [1, 2, 3, 4]


def test_the_deadline_comes_before_the_tick_and_after_the_end(tmp_path):
    calls = Calls()
    ticks: list[int] = []
    watched = _watch(tmp_path, calls, deadline=time.monotonic() - 1, ended=lambda: None,
                     tick=lambda polls: ticks.append(polls))
    assert (watched.end, watched.timed_out, ticks) == (LaunchEnd.TIMED_OUT, True, [])
    assert calls.cleaned == [LaunchEnd.TIMED_OUT]
    # a run that ended by itself is not timed out, past the deadline or not
    watched = _watch(tmp_path, Calls(), deadline=time.monotonic() - 1, ended=lambda: LaunchEnd.EXITED)
    assert watched.end is LaunchEnd.EXITED and not watched.timed_out


def test_ctrl_c_ends_the_run_interrupted_and_it_is_still_cleaned_up(tmp_path):
    calls = Calls()

    def tick(polls: int) -> None:
        raise KeyboardInterrupt

    watched = _watch(tmp_path, calls, deadline=time.monotonic() + 600, ended=lambda: None, tick=tick)
    assert watched.end is LaunchEnd.INTERRUPTED and calls.cleaned == [LaunchEnd.INTERRUPTED]


def test_sigterm_during_the_run_ends_it_interrupted(tmp_path):
    calls = Calls()

    def tick(polls: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # trapped while the loop runs: Stopped

    before = signal.getsignal(signal.SIGTERM)
    watched = _watch(tmp_path, calls, deadline=time.monotonic() + 600, ended=lambda: None, tick=tick)
    assert watched.end is LaunchEnd.INTERRUPTED and calls.cleaned == [LaunchEnd.INTERRUPTED]
    assert signal.getsignal(signal.SIGTERM) == before  # the caller's handler is back


def test_a_signal_during_the_clean_up_is_held_and_makes_the_end_interrupted(tmp_path):
    calls = Calls()

    def clean_up(end: LaunchEnd | None) -> str:
        calls.cleaned.append(end)
        os.kill(os.getpid(), signal.SIGINT)  # held: the clean-up goes on to its end
        calls.log.append("clean-up finished")
        return "stopped"

    watched = _watch(tmp_path, calls, deadline=time.monotonic() - 1, ended=lambda: None, clean_up=clean_up)
    assert calls.log == ["start", "clean-up finished"] and calls.cleaned == [LaunchEnd.TIMED_OUT]
    # it had timed out: both flags are written, as they always were
    assert watched.end is LaunchEnd.INTERRUPTED and watched.timed_out
    assert watched.end.flags(timed_out=watched.timed_out) == {"timed_out": True, "interrupted": True}


def test_one_poll_loop():
    """The launcher and the shared launch watch their runs with ddpdoctor.probe.watch.watch; neither has a loop of
    its own (the signal handling of a loop lives in watch alone)."""
    for name in ("launcher", "shared"):
        source = (ROOT / "ddpdoctor" / "probe" / f"{name}.py").read_text(encoding="utf-8")
        tree = ast.parse(source)
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "watch" in called, name
        assert not called & {"trap_stop_signals", "hold_signals"}, name
        assert "time.sleep(" not in source.split("def close(")[0], name  # shared's close waits for its zygotes


@pytest.fixture
def short_tmpdir(monkeypatch: pytest.MonkeyPatch):
    """A short temporary directory of the test's own as the user's TMPDIR (scratch_dir keeps it: its socket paths
    fit), removed after the test."""
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="ddt-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", base)
    yield Path(base)
    shutil.rmtree(base, ignore_errors=True)


def _broken(*_args, **_kwargs):
    raise RuntimeError("could not start")


def test_a_launch_that_fails_before_its_supervisor_runs_leaves_no_scratch_folder(short_tmpdir, tmp_path,
                                                                                 monkeypatch):
    """The run's scratch folder (its TMPDIR) is removed by the poll loop however the run ends; a failure before the
    loop (building the command, the environment, the supervisor) left it behind (an empty ddpd-* in /tmp)."""
    from ddpdoctor.config import CheckConfig
    from ddpdoctor.probe import launcher

    monkeypatch.setattr(launcher, "Supervisor", _broken)
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    cfg = CheckConfig(script=Path("train.py"), nproc=2, timeout=60)
    settings = ProbeSettings(run_dir=str(run_dir), mode=LaunchMode.TORCHRUN)
    with pytest.raises(RuntimeError):
        launcher._launch_once(cfg, run_dir, settings, time.monotonic() + 60)
    assert list(short_tmpdir.iterdir()) == []


def test_a_shared_launch_that_fails_to_start_leaves_no_scratch_folder(short_tmpdir, monkeypatch):
    from ddpdoctor.config import CheckConfig
    from ddpdoctor.probe import shared

    monkeypatch.setattr(shared, "Supervisor", _broken)
    launch = shared.SharedLaunch(CheckConfig(script=Path("train.py"), nproc=2, timeout=60), runs=2)
    with pytest.raises(RuntimeError):
        launch.start()
    assert list(short_tmpdir.iterdir()) == []
