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
from ddpdoctor.events import BASE_FIELDS, EVENT_KINDS
from ddpdoctor.probe.patching import Patcher, wrap_everywhere
from ddpdoctor.probe.plan import plan_launch
from ddpdoctor.probe.procs import kill_run, run_processes
from ddpdoctor.probe.settings import RUN_TAG_ENV, ProbeSettings
from ddpdoctor.rundata import parse_stack_dump, read_run, rle_expand

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
        "import torch.multiprocessing as mp\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nmp.spawn(f, nprocs=2)\n",
        "from torch.multiprocessing import spawn\nfrom torch.distributed import init_process_group\n"
        "spawn(f)\ninit_process_group('gloo', rank=0, world_size=1)\n",
        "import multiprocessing as mp\nimport torch.distributed as dist\nctx = mp.get_context('spawn')\n"
        "ctx.Process(target=f).start()\ndist.init_process_group('gloo')\n",
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
    # torchrun does not pass an optional --local_rank: neither does the probe (DD108 measures the default)
    assert plan.local_rank_option is None and plan.local_rank_declared == "--local_rank" and plan.local_rank_line == 14
    dashed = plan_launch(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--local-rank', type=int, required=True)\n"
    )
    assert dashed.local_rank_option == "--local-rank"
    assert plan_launch("def broken(:\n").mode == "torchrun"


def test_plan_spawn_behind_a_flag_follows_the_given_arguments() -> None:
    """pytorch/examples imagenet: mp.spawn only with --multiprocessing-distributed; RANK/WORLD_SIZE from the
    launcher in the other branch. Launched under torchrun with the flag, every rank spawned its own ranks."""
    source = (FIXTURES / "spawn_behind_flag.py").read_text()
    flag = plan_launch(source, ["--multiprocessing-distributed", "--world-size", "1", "--rank", "0",
                                "--dist-url", "tcp://127.0.0.1:29555"])
    assert flag.mode == "spawn" and not flag.decided_at_runtime and flag.spawn_line == 41
    assert "`args.multiprocessing_distributed` is true: --multiprocessing-distributed given" in flag.reason
    no_flag = plan_launch(source, ["--dist-url", "env://"])
    assert no_flag.mode == "torchrun" and no_flag.reads_launcher_env
    assert "--multiprocessing-distributed not given" in no_flag.reason
    assert plan_launch(source, []).mode == "torchrun"


@pytest.mark.parametrize(
    "guard, args, mode",
    [
        # a derived flag assigned once, unconditionally (three-valued `or`: the unknown world size does not matter)
        ("args.distributed", ["--spawn"], "spawn"),
        ("args.distributed", ["--world-size", "4"], "spawn"),
        ("args.distributed", [], "torchrun"),
        ("not args.no_spawn", [], "spawn"),
        ("not args.no_spawn", ["--no-spawn"], "torchrun"),
        ("args.launcher == 'spawn'", ["--launcher", "spawn"], "spawn"),
        ("args.launcher == 'spawn'", ["--launcher=torchrun"], "torchrun"),
        ("args.gpus > 1", ["--gpus", "2"], "spawn"),
        ("torch.cuda.device_count() > 1 and args.gpus is None", [], "spawn"),
        ("args.gpus is not None", [], "torchrun"),
    ],
)
def test_plan_evaluates_the_spawn_guard_from_the_script_options(guard: str, args: list[str], mode: str) -> None:
    source = textwrap.dedent(
        f"""
        import argparse, os, torch, torch.multiprocessing as mp, torch.distributed as dist
        parser = argparse.ArgumentParser()
        parser.add_argument("--spawn", action="store_true")
        parser.add_argument("--no-spawn", action="store_true")
        parser.add_argument("--world-size", type=int, default=1)
        parser.add_argument("--launcher", choices=sorted(["spawn", "torchrun"]), default="torchrun")
        parser.add_argument("--gpus", type=int)
        parser.add_argument("data", help="dataset root")

        def worker(rank, args):
            dist.init_process_group("gloo", rank=rank, world_size=2)

        def main():
            args = parser.parse_args()
            args.distributed = args.spawn or args.world_size > 1
            if {guard}:
                mp.spawn(worker, args=(args,), nprocs=2)
            else:
                worker(int(os.environ["RANK"]), args)

        if __name__ == "__main__":
            main()
        """
    )
    plan = plan_launch(source, args)
    assert plan.mode == mode, plan.reason
    assert not plan.decided_at_runtime


@pytest.mark.parametrize(
    "source",
    [
        # a config file decides
        "import json, torch.multiprocessing as mp, torch.distributed as dist\n"
        "cfg = json.load(open('c.json'))\n"
        "if cfg['spawn']:\n    mp.spawn(f, nprocs=2)\nelse:\n    dist.init_process_group('gloo')\n",
        # a custom type= applied to a given value
        "import argparse, torch.multiprocessing as mp, torch.distributed as dist\n"
        "def str2bool(v): return v.lower() in ('yes', 'true', '1')\n"
        "p = argparse.ArgumentParser(); p.add_argument('--spawn', type=str2bool, default=False)\n"
        "args = p.parse_args()\n"
        "if args.spawn:\n    mp.spawn(f, nprocs=2)\nelse:\n    dist.init_process_group('gloo')\n",
        # the function holding the spawn call is only used as a callback
        "import fire, torch.multiprocessing as mp, torch.distributed as dist\n"
        "def launch(n=2):\n    mp.spawn(f, nprocs=n)\n"
        "def f(rank, n):\n    dist.init_process_group('gloo', rank=rank, world_size=n)\n"
        "fire.Fire(launch)\n",
    ],
)
def test_plan_guard_the_source_cannot_settle_is_decided_at_run_time(source: str) -> None:
    plan = plan_launch(source, ["--spawn", "false"])
    assert plan.mode == "spawn" and plan.decided_at_runtime
    assert "not known before the run" in plan.reason


def test_script_options_rebuild_the_parser_from_its_literal_parts() -> None:
    import ast

    from ddpdoctor.probe.plan import UNKNOWN, script_options

    tree = ast.parse(
        textwrap.dedent(
            """
            import argparse, os
            p = argparse.ArgumentParser()
            g = p.add_argument_group("dist")
            p.add_argument("data", metavar="DIR")
            p.add_argument("-a", "--arch", choices=MODELS, default="resnet18", help="x" + ", ".join(MODELS))
            g.add_argument("--lr", "--learning-rate", type=float, default=0.1, dest="lr")
            g.add_argument("--no-shuffle", dest="shuffle", action="store_false")
            g.add_argument("--workers", type=int, default=os.cpu_count())
            p.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=False)
            p.add_argument("--version", action="version", version="1")
            p.set_defaults(seed=7)
            """
        )
    )
    opts = script_options(tree, ["/data", "-a", "vgg", "--learning-rate=0.4", "--no-shuffle", "--fp16", "--unknown"])
    assert opts["data"] == "/data" and opts["arch"] == "vgg" and opts["lr"] == 0.4
    assert opts["shuffle"] is False and opts["fp16"] is True and opts["seed"] == 7
    assert opts["workers"] is UNKNOWN  # computed default, not given
    assert script_options(tree, ["--workers", "2"])["workers"] == 2
    assert script_options(tree, [])["data"] is None and script_options(tree, [])["shuffle"] is True


def test_launch_check_decides_only_in_the_main_process_of_a_single_launch(tmp_path: Path) -> None:
    from ddpdoctor.probe import launch_check
    from ddpdoctor.probe.session import Probe

    settings = ProbeSettings(run_dir=str(tmp_path), mode="spawn", launch_check=1)
    main = Probe(settings, "main")
    env_init = launch_check.init_needs_launcher(main, {"backend": "gloo"})
    assert env_init is not None and "RANK and WORLD_SIZE" in env_init
    assert "world_size=2" in launch_check.init_needs_launcher(
        main, {"init_method": "tcp://h:1", "rank": 0, "world_size": 2}
    )
    assert launch_check.init_needs_launcher(main, {"init_method": "tcp://h:1", "rank": 0, "world_size": 1}) is None
    assert launch_check.init_needs_launcher(main, {"rank": 0, "world_size": 2, "store": object()}) is None
    assert "os.environ['LOCAL_RANK']" in launch_check.exception_needs_launcher(main, KeyError("LOCAL_RANK"))
    assert launch_check.exception_needs_launcher(main, KeyError("HOME")) is None
    launch_check.ranks_started(main, "torch.multiprocessing.spawn", None)  # from now on: a self-spawning script
    assert main.launch_decided == "spawn" and launch_check.init_needs_launcher(main, {"backend": "gloo"}) is None
    for role, check in (("spawned", 1), ("rank", 1), ("main", 0)):
        other = Probe(ProbeSettings(run_dir=str(tmp_path), mode="spawn", launch_check=check), role)
        assert launch_check.init_needs_launcher(other, {"backend": "gloo"}) is None


def test_a_single_launch_that_reads_a_launcher_variable_asks_for_torchrun(tmp_path: Path) -> None:
    from ddpdoctor.probe.launch_check import RELAUNCH_EXIT_CODE

    script = tmp_path / "needs_rank.py"
    script.write_text("import os\nprint('before')\nrank = int(os.environ['RANK'])\nprint('never')\n")
    run = tmp_path / "run"
    settings = ProbeSettings(run_dir=str(run), mode="spawn", launch_check=1, nproc=2, timeout=30.0)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_") and k != "RANK"},
           **settings.to_env()}
    done = subprocess.run([sys.executable, "-m", "ddpdoctor.probe.bootstrap", str(script)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == RELAUNCH_EXIT_CODE, done.stderr
    assert "never" not in done.stdout and "Traceback" not in done.stderr
    (run / "meta.json").write_text(json.dumps({"schema": "ddpdoctor.events/1"}))
    (decision,) = [e for _, e in read_run(run).events("launch_decision")]
    assert decision["mode"] == "torchrun" and decision["site"]["line"] == 3
    assert "os.environ['RANK']" in decision["reason"]


def test_a_spawned_child_keeps_its_own_rank_and_the_scripts_rendezvous_moves_to_the_launchers_port(
    tmp_path: Path,
) -> None:
    """A child of mp.spawn inherits RANK/WORLD_SIZE from its parent's environment: they are not its own, so the
    DD104 override must not apply (under a mistaken torchrun launch it turned rank 0 into 1: a false DD104 and a
    hang). The script's fixed tcp:// port moves to the one the launcher chose."""
    code = textwrap.dedent(
        f"""
        import json, os, socket
        from ddpdoctor.probe.settings import ProbeSettings
        from ddpdoctor.probe.instrument import instrument_process
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        settings = ProbeSettings(run_dir={str(tmp_path)!r}, mode="spawn", device="cpu", nproc=1, rendezvous_port=port)
        probe = instrument_process(settings, "spawned")
        import torch.distributed as dist
        os.environ.update(RANK="1", WORLD_SIZE="2")  # the parent's, as a child of a torchrun rank sees them
        dist.init_process_group("gloo", init_method="tcp://10.255.255.1:23456", rank=0, world_size=1)
        print(json.dumps({{"rank": dist.get_rank(), "world": dist.get_world_size(), "port": port}}))
        dist.destroy_process_group()
        probe.patcher.undo()
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["rank"], out["world"]) == (0, 1)
    (tmp_path / "meta.json").write_text(json.dumps({"schema": "ddpdoctor.events/1"}))
    (begin,) = [e for _, e in read_run(tmp_path).events("pg_init_begin")]
    assert begin["overridden"] == {} and begin["env_rank"] == "1"
    assert begin["rendezvous"] == {"given": "tcp://10.255.255.1:23456", "used": f"tcp://127.0.0.1:{out['port']}"}


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


def _emitted_events() -> dict[str, list[tuple[str, int, set[str]]]]:
    """kind → [(file, line, fields)] for every `emit("kind", field=..., **spread)` in ddpdoctor/probe (also through
    `probe.safely(where, probe.emit, "kind", ...)` and the writer's own `_write_locked("kind", {...})`). A `**name`
    spread contributes the keys a dict literal, `.update(k=...)` and `name["k"] = ...` give it in that function."""
    import ast

    def spread_keys(func: ast.AST, name: str) -> set[str]:
        keys: set[str] = set()
        for n in ast.walk(func):
            if isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id == name and isinstance(n.value, ast.Dict):
                        keys |= {k.value for k in n.value.keys if isinstance(k, ast.Constant)}
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name:
                        if isinstance(t.slice, ast.Constant):
                            keys.add(t.slice.value)
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "update"
                    and isinstance(n.func.value, ast.Name) and n.func.value.id == name):
                keys |= {k.arg for k in n.keywords if k.arg}
        return keys

    out: dict[str, list[tuple[str, int, set[str]]]] = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "ddpdoctor" / "probe").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            args = list(n.args)
            if name == "safely" and len(args) >= 3 and isinstance(args[1], ast.Attribute) and args[1].attr == "emit":
                args = args[2:]
            elif name not in ("emit", "_write_locked"):
                continue
            if not args or not isinstance(args[0], ast.Constant) or not isinstance(args[0].value, str):
                continue
            fields = {k.arg for k in n.keywords if k.arg}
            if name == "_write_locked" and len(args) > 1 and isinstance(args[1], ast.Dict):
                fields |= {k.value for k in args[1].keys if isinstance(k, ast.Constant)}
            func: ast.AST = n
            while func in parents and not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                func = parents[func]
            for k in n.keywords:
                if k.arg is None and isinstance(k.value, ast.Name):
                    fields |= spread_keys(func, k.value.id)
            out.setdefault(args[0].value, []).append((path.name, n.lineno, fields))
    return out


def test_every_event_the_probe_emits_is_documented() -> None:
    """events.EVENT_KINDS is the one list of event kinds: every kind a recorder emits, with every field it names,
    is documented there, and every documented kind is emitted somewhere."""
    emitted = _emitted_events()
    undocumented = sorted(
        f"{kind} ({uses[0][0]}:{uses[0][1]})" for kind, uses in emitted.items() if kind not in EVENT_KINDS
    )
    assert undocumented == []
    fields = sorted(
        f"{kind}.{field} ({file}:{line})"
        for kind, uses in emitted.items()
        for file, line, names in uses
        for field in names - set(EVENT_KINDS[kind].fields) - set(BASE_FIELDS)
    )
    assert fields == []
    assert sorted(set(EVENT_KINDS) - set(emitted)) == []
    assert {"loader_created", "launch_decision", "sampler_iter"} <= set(emitted)


def test_every_field_of_the_recorded_runs_is_documented() -> None:
    """The fields recorders build dynamically (`**options`) checked on real events: every recorded run fixture."""
    runs = Path(__file__).resolve().parents[1] / "fixtures" / "runs"
    missing: set[str] = set()
    for log in runs.rglob("events/*.jsonl"):
        for line in log.read_text(encoding="utf-8").splitlines():
            event = json.loads(line)
            kind = EVENT_KINDS.get(event["kind"])
            if kind is None:
                missing.add(event["kind"])
                continue
            missing |= {f"{event['kind']}.{f}" for f in set(event) - set(kind.fields) - set(BASE_FIELDS)}
    assert sorted(missing) == []


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
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, "RANK": "3"}
    )
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
    code = (
        "import subprocess,sys,time; "
        "subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)'], start_new_session=True); "
        "time.sleep(60)"
    )
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
    code = (
        "import os, sys; "
        "print(os.environ.get('CHAINED_SITECUSTOMIZE'), 'torch' in sys.modules, "
        "'ddpdoctor.probe.session' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["yes", "False", "False"]


# ------------------------------------------------------------------------------------------------ source copies


def test_source_copies_keep_the_path_under_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    from ddpdoctor.probe import sources

    proj, run = tmp_path / "proj", tmp_path / "run"
    (proj / "pkg").mkdir(parents=True)
    (proj / "train.py").write_text("import pkg.util\n")
    (proj / "pkg" / "util.py").write_text("def f(): pass\n")
    other = tmp_path / "lib" / "train.py"  # outside the working directory, and the same file name
    other.parent.mkdir()
    other.write_text("# elsewhere\n")
    (proj / "link.py").symlink_to(proj / "train.py")
    (proj / "big.py").write_text("x = 1\n" * 100)
    monkeypatch.setattr(sources, "MAX_FILE_BYTES", 200)
    got = sources.snapshot(run, [str(proj / "train.py"), "pkg/util.py", str(other), str(proj / "link.py"),
                                 str(proj / "big.py"), str(proj / "missing.py")], cwd=str(proj))
    assert got == {
        str(proj / "train.py"): "source/train.py",
        "pkg/util.py": "source/pkg/util.py",  # recorded relative: resolved against the working directory
        str(other): "source/_outside/train.py",
        str(proj / "link.py"): "source/train.py",  # the same file: one copy
    }  # big.py is over the size bound, missing.py does not exist
    assert (run / "source" / "pkg" / "util.py").read_text() == "def f(): pass\n"
    assert (run / "source" / "_outside" / "train.py").read_text() == "# elsewhere\n"
    assert not [p for p in run.rglob("*.tmp")]
    # a second file of the same name outside the tree gets its own copy; earlier copies are kept
    other2 = tmp_path / "lib2" / "train.py"
    other2.parent.mkdir()
    other2.write_text("# another\n")
    more = sources.snapshot(run, [str(other2)], cwd=str(proj), taken=got)
    assert more[str(other2)] == "source/_outside/train-2.py" and more[str(proj / "train.py")] == "source/train.py"


def test_source_copies_are_bounded_in_number(tmp_path: Path, monkeypatch) -> None:
    from ddpdoctor.probe import sources

    for i in range(5):
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n")
    monkeypatch.setattr(sources, "MAX_FILES", 3)
    got = sources.snapshot(tmp_path / "run", [str(tmp_path / f"m{i}.py") for i in range(5)], cwd=str(tmp_path))
    assert sorted(got.values()) == ["source/m0.py", "source/m1.py", "source/m2.py"]


def test_a_run_copies_the_user_files_it_names(tmp_path: Path) -> None:
    """Sites, exception frames, stack dumps and tracebacks in stderr name user files; ddpdoctor's own code, the
    standard library and installed packages are not copied."""
    import ddpdoctor
    from ddpdoctor.probe import sources

    proj, run = tmp_path / "proj", tmp_path / "run"
    proj.mkdir()
    for name in ("train.py", "model.py", "data.py", "hang.py", "crash.py"):
        (proj / name).write_text(f"# {name}\n")
    (run / "events").mkdir(parents=True)
    (run / "logs").mkdir()
    ours = str(Path(ddpdoctor.__file__).parent / "probe" / "bootstrap.py")
    stdlib = os.__file__
    events = [
        {"kind": "script_start", "script": str(proj / "train.py")},
        {"kind": "ddp_init", "site": {"file": str(proj / "model.py"), "line": 3, "function": "build"}},
        {"kind": "sampler_iter", "order": {"file": "h-p1.bin", "offset": 0, "nbytes": 8}},  # a blob, not a source
        {"kind": "exception", "frames": [[ours, 63, "run_script"], [str(proj / "data.py"), 9, "load"]],
         "user_frame": {"file": str(proj / "data.py"), "line": 9}},
    ]
    (run / "events" / "h-p1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "events" / "h-p1.stack").write_text(
        f'Current thread 0x1 (most recent call first):\n  File "{stdlib}", line 1 in f\n'
        f'  File "{proj / "hang.py"}", line 2 in g\n')
    (run / "logs" / "rank0.stderr").write_text(
        f'Traceback (most recent call last):\n  File "{proj / "crash.py"}", line 4, in <module>\nValueError\n')
    got = sources.snapshot_run(run, cwd=str(proj), script=str(proj / "train.py"))
    assert sorted(got) == sorted(str(proj / n) for n in ("train.py", "model.py", "data.py", "hang.py", "crash.py"))
    assert all((run / rel).read_text() == f"# {Path(rel).name}\n" for rel in got.values())
