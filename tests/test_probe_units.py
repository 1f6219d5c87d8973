"""Fast tests of the probe's pieces that need no ranks: launch planning, patching, the import hook, settings,
the event writer and reader, stack-dump parsing, process discovery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from ddpdoctor.analyses.context import fmt_num, fmt_ranks, pct
from ddpdoctor.events import EVENT_KINDS, BASE_FIELDS, parse_stack_dump, read_run, rle_expand
from ddpdoctor.probe.patching import Patcher, wrap_everywhere
from ddpdoctor.probe.plan import plan_launch
from ddpdoctor.probe.procs import kill_run, run_processes
from ddpdoctor.probe.settings import RUN_TAG_ENV, ProbeSettings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "probe"


# ------------------------------------------------------------------------------------------------ plan


def test_plan_detects_self_spawning_script() -> None:
    plan = plan_launch((FIXTURES / "self_spawn.py").read_text())
    assert plan.spawns_own_ranks and plan.mode == "spawn"
    assert plan.spawn_line == 36
    assert plan.local_rank_option is None


@pytest.mark.parametrize(
    "source",
    [
        "import torch.multiprocessing as mp\nimport torch.distributed as dist\ndist.init_process_group('gloo')\nmp.spawn(f, nprocs=2)\n",
        "from torch.multiprocessing import spawn\nfrom torch.distributed import init_process_group\nspawn(f)\ninit_process_group('gloo', rank=0, world_size=1)\n",
        "import multiprocessing as mp\nimport torch.distributed as dist\nctx = mp.get_context('spawn')\nctx.Process(target=f).start()\ndist.init_process_group('gloo')\n",
        "import torch\ntorch.multiprocessing.spawn(f)\ntorch.distributed.init_process_group('nccl')\n",
    ],
)
def test_plan_spawn_spellings(source: str) -> None:
    assert plan_launch(source).spawns_own_ranks


def test_plan_hybrid_script_that_reads_launcher_env_runs_under_torchrun() -> None:
    source = textwrap.dedent(
        """
        import os, torch.multiprocessing as mp, torch.distributed as dist
        def main(rank, world): dist.init_process_group('gloo', rank=rank, world_size=world)
        if 'RANK' in os.environ:
            main(int(os.environ['RANK']), int(os.environ['WORLD_SIZE']))
        else:
            mp.spawn(main, args=(2,), nprocs=2)
        """
    )
    plan = plan_launch(source)
    assert plan.reads_launcher_env and not plan.spawns_own_ranks and plan.mode == "torchrun"


def test_plan_pool_without_process_group_is_not_self_spawning() -> None:
    assert not plan_launch("import multiprocessing as mp\nmp.Process(target=print).start()\n").spawns_own_ranks


def test_plan_legacy_local_rank_spelling() -> None:
    plan = plan_launch((FIXTURES / "legacy_local_rank.py").read_text())
    assert plan.local_rank_option == "--local_rank" and plan.local_rank_line == 14
    dashed = plan_launch("import argparse\np = argparse.ArgumentParser()\np.add_argument('--local-rank', type=int)\n")
    assert dashed.local_rank_option == "--local-rank"
    assert plan_launch("def broken(:\n").mode == "torchrun"


# ------------------------------------------------------------------------------------------------ patching


class _Target:
    def method(self, x: int) -> int:
        return x + 1

    @classmethod
    def make(cls, x: int) -> int:
        return x * 2


class _Sub(_Target):
    pass


def test_patcher_wraps_class_attributes_and_undoes_in_reverse() -> None:
    p = Patcher()
    calls = []

    def make(orig):
        def method(self, x):
            calls.append(x)
            return orig(self, x)

        return method

    p.wrap(_Target, "method", make)
    p.wrap(_Target, "make", lambda orig: (lambda cls, x: orig(cls, x) + 100))
    assert _Sub().method(1) == 2 and calls == [1]  # subclasses see the class attribute
    assert _Sub.make(3) == 106
    assert _Target.method.__name__ == "method"  # functools.wraps keeps the look of the original
    undone = []
    p.add_undo(lambda: undone.append(True))
    p.undo()
    assert undone == [True]
    assert _Target.method(_Target(), 1) == 2 and calls == [1]
    assert _Target.make(3) == 6 and "method" not in _Sub.__dict__


def test_wrap_everywhere_one_wrapper_per_distinct_function() -> None:
    import types

    def f():
        return "f"

    a, b = types.SimpleNamespace(f=f), types.SimpleNamespace(f=f)
    p = Patcher()
    wrap_everywhere(p, (a, b), "f", lambda orig: (lambda: orig() + "!"))
    assert a.f is b.f and a.f() == "f!"
    p.undo()
    assert a.f is f and b.f is f


# ------------------------------------------------------------------------------------------------ import hook


def test_import_hook_runs_after_the_module_finished_importing(tmp_path: Path) -> None:
    mod = tmp_path / "late_module_xyz.py"
    mod.write_text("VALUE = 41\n")
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from ddpdoctor.probe.importhook import when_imported
        seen = []
        when_imported("late_module_xyz", lambda: seen.append(sys.modules["late_module_xyz"].VALUE + 1))
        assert seen == []
        import late_module_xyz
        assert seen == [42], seen
        when_imported("late_module_xyz", lambda: seen.append(0))  # already imported: runs now
        assert seen == [42, 0]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ------------------------------------------------------------------------------------------------ settings & events


def test_settings_round_trip_through_the_environment() -> None:
    s = ProbeSettings(run_dir="/tmp/x", run_tag="t", mode="spawn", epochs=3, steps=5, device="cpu", nproc=4,
                      timeout=12.5, script="a.py", local_rank_arg="--local_rank", stall_timeout=0.0)
    assert ProbeSettings.from_env(s.to_env()) == s
    assert ProbeSettings.from_env({}) is None


def test_event_kinds_never_shadow_the_base_fields() -> None:
    for kind in EVENT_KINDS.values():
        assert not set(kind.fields) & set(BASE_FIELDS), kind.kind


def test_writer_and_reader_round_trip(tmp_path: Path) -> None:
    """Events written by the in-rank writer (a real subprocess, with a blob) read back with the reader."""
    code = textwrap.dedent(
        f"""
        from ddpdoctor.probe.settings import ProbeSettings
        from ddpdoctor.probe import session
        p = session.start(ProbeSettings(run_dir={str(tmp_path)!r}), "rank")
        import array
        ref = p.blob(array.array("q", [5, 3, 9]).tobytes(), dtype="int64", count=3)
        p.emit("sampler_iter", sampler=1, iteration=0, order=ref, count=3)
        p.emit("done", reason="script returned", steps=0, epochs=0)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, "RANK": "3"})
    assert out.returncode == 0, out.stderr
    (tmp_path / "meta.json").write_text(json.dumps({"schema": "ddpdoctor.events/1", "script": "a.py"}))
    run = read_run(tmp_path)
    assert len(run.processes) == 1
    p = run.processes[0]
    assert [e["kind"] for e in p.events] == ["process_start", "sampler_iter", "done"]
    assert [e["seq"] for e in p.events] == [1, 2, 3]
    assert p.rank == 3 and p.role == "rank" and p.done["reason"] == "script returned"
    assert run.load_array(p.events[1]["order"]).tolist() == [5, 3, 9]
    assert run.rank_processes == {3: p}


def test_reader_rejects_non_run_directories(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a ddpdoctor run directory"):
        read_run(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        read_run(tmp_path / "missing")
    (tmp_path / "meta.json").write_text(json.dumps({"schema": "ddpdoctor.events/0"}))
    with pytest.raises(ValueError, match="schema"):
        read_run(tmp_path)


def test_parse_stack_dump_of_faulthandler_output() -> None:
    text = textwrap.dedent(
        """\
        Thread 0x00007f0000000002 (most recent call first):
          File "/usr/lib/python3.11/threading.py", line 327 in wait
          File "/usr/lib/python3.11/threading.py", line 629 in wait

        Current thread 0x00007f0000000001 (most recent call first):
          File "/x/torch/distributed/distributed_c10d.py", line 2799 in recv
          File "/work/train.py", line 29 in <module>
        """
    )
    dumps = parse_stack_dump(text)
    assert len(dumps) == 1 and len(dumps[0]) == 2
    main = dumps[0][1]
    assert main["current"] and main["thread"] == "0x00007f0000000001"
    assert main["frames"][0] == {"file": "/x/torch/distributed/distributed_c10d.py", "line": 2799, "function": "recv"}
    assert parse_stack_dump(text + text)[1][1]["frames"][1]["line"] == 29  # a second dump starts a new list


def test_formatting_helpers() -> None:
    assert fmt_ranks([1, 0]) == "ranks 0, 1"
    assert fmt_ranks([0, 1, 2, 5]) == "ranks 0–2, 5"
    assert fmt_ranks([3]) == "rank 3"
    assert fmt_num(0.1) == "0.1" and fmt_num(64.0) == "64" and fmt_num(1.5e-7) == "1.50e-07"
    assert pct(1.0) == "100%" and pct(0.004) == "0.4%"
    assert rle_expand([[8, 3], [5, 1]]) == [8, 8, 8, 5]


# ------------------------------------------------------------------------------------------------ processes


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="process discovery by tag needs /proc")
def test_kill_run_finds_tagged_processes_outside_the_tree() -> None:
    """A detached grandchild (own session, re-parented away from us) is still found through the run tag."""
    tag = uuid.uuid4().hex
    env = {**os.environ, RUN_TAG_ENV: tag}
    code = "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)'], start_new_session=True); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(run_processes(tag, [])) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = run_processes(tag, [])
        assert parent.pid in found and len(found) == 2
        killed = kill_run(tag, [parent.pid])
        assert set(killed) == found
        assert run_processes(tag, []) == set()
    finally:
        parent.kill()
        parent.wait()


def test_sitecustomize_chains_to_the_next_one_and_stays_inert_outside_a_run(tmp_path: Path) -> None:
    from ddpdoctor.probe.site import site_dir

    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED_SITECUSTOMIZE'] = 'yes'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}
    env["PYTHONPATH"] = os.pathsep.join([site_dir(), str(other)])
    code = "import os, sys; print(os.environ.get('CHAINED_SITECUSTOMIZE'), 'torch' in sys.modules, 'ddpdoctor.probe.session' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["yes", "False", "False"]
