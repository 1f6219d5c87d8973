"""Analyses on small hand-built runs: the cases a real 2-rank run on this machine cannot produce on demand
(a rank dying in interpreter teardown after finishing, a self-spawning script with a hard-coded rank, orders
beyond the recording cap, a custom sampler that ignores the epoch)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ddpdoctor.analyses import analyze_run
from ddpdoctor.analyses.orders import consistent
from ddpdoctor.events import SCHEMA
from ddpdoctor.levels import Severity

SCRIPT = "/proj/train.py"


class Run:
    """Writes a run directory the way the probe does (meta.json, launcher.json, events/<host>-p<pid>.jsonl/.bin)."""

    def __init__(self, root: Path, **launcher: Any) -> None:
        self.root = root
        (root / "events").mkdir(parents=True)
        (root / "logs").mkdir()
        (root / "meta.json").write_text(json.dumps({"schema": SCHEMA, "mode": "torchrun", "script": "train.py",
                                                    "script_abs": SCRIPT, "args": [], "cwd": "/proj", "nproc": 2,
                                                    "epochs": 2, "steps": 4}))
        (root / "launcher.json").write_text(json.dumps({"timed_out": False, "started": 0.0, "ended": 100.0,
                                                        "timeout": 60, **launcher}))
        self.t = 1.0

    def process(self, pid: int, rank: int | None, role: str = "rank", events: list[tuple[str, dict]] = ()) -> None:
        lines = [
            {"kind": "process_start", "role": role, "main_thread": "0x1", "python": "3.11.7"},
            *[{"kind": k, **f} for k, f in events],
        ]
        with (self.root / "events" / f"h-p{pid}.jsonl").open("w") as fh:
            for seq, e in enumerate(lines, 1):
                self.t += 0.1
                fh.write(json.dumps({"t": e.pop("t", self.t), "pid": pid, "seq": seq, "rank": rank, **e}) + "\n")

    def blob(self, pid: int, values: np.ndarray) -> dict:
        path = self.root / "events" / f"h-p{pid}.bin"
        data = zlib.compress(values.astype(np.int64).tobytes())
        offset = path.stat().st_size if path.exists() else 0
        with path.open("ab") as fh:
            fh.write(data)
        return {"file": path.name, "offset": offset, "nbytes": len(data), "codec": "zlib", "dtype": "int64",
                "count": int(len(values))}


SITE = {"file": SCRIPT, "line": 12, "function": "<module>"}


def _rules(root: Path) -> dict:
    result = analyze_run(root)
    assert not [n for n in result.notes if "failed:" in n], result.notes
    return {f.rule: f for f in result.findings}


def test_a_rank_that_finished_and_died_in_teardown_is_not_a_failure(tmp_path: Path) -> None:
    run = Run(tmp_path, agent={"ok": False, "failures": [
        {"rank": 1, "exitcode": -6, "signal": "SIGABRT", "timestamp": 50, "pid": 11}]})
    ok = [("pg_init", {"ok": True, "world_size": 2, "backend": "gloo"}), ("ddp_init", {"ok": True, "ddp": 1}),
          ("done", {"reason": "epochs observed", "steps": 8, "epochs": 2})]
    run.process(10, 0, events=ok + [("exit", {"code": 0})])
    run.process(11, 1, events=ok)  # done, then gloo's "terminate called" at interpreter exit
    (tmp_path / "logs" / "rank1.stderr").write_text("terminate called without an active exception\n")
    assert "DD902" not in _rules(tmp_path)


def test_the_first_failure_that_is_not_a_peer_consequence_is_the_root_cause(tmp_path: Path) -> None:
    run = Run(tmp_path, agent={"ok": False, "failures": [
        {"rank": 0, "exitcode": 1, "timestamp": 40, "pid": 10},
        {"rank": 1, "exitcode": -15, "signal": "SIGTERM", "timestamp": 41, "pid": 11}]})
    init = [("pg_init", {"ok": True, "world_size": 2})]
    run.process(10, 0, events=init + [("exception", {"t": 30.0, "type": "RuntimeError",
                                                      "message": "[pair.cc:537] Read error: Connection reset by peer",
                                                      "user_frame": SITE})])
    run.process(11, 1, events=init + [("exception", {"t": 31.0, "type": "KeyError", "message": "'label'",
                                                      "user_frame": {**SITE, "line": 20}})])
    f = _rules(tmp_path)["DD902"]
    assert f.ranks == (1,) and f.line == 20 and "KeyError" in f.message  # later, but rank 0's is a consequence
    assert [x["peer_caused"] for x in f.evidence["failures"]] == [True, False]


def test_every_rank_raising_the_same_error_names_them_all(tmp_path: Path) -> None:
    run = Run(tmp_path)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=[("exception", {"type": "FileNotFoundError", "message": "data/train missing",
                                                      "user_frame": SITE})])
    f = _rules(tmp_path)["DD902"]
    assert f.ranks == (0, 1) and f.message.startswith("ranks 0, 1 raised FileNotFoundError")


def test_a_device_beyond_the_emulated_ones_is_not_called_a_bug_of_the_script(tmp_path: Path) -> None:
    """A DataParallel script written for 4 GPUs (device_ids=[0, 1, 2, 3]) on a CPU probe of 2 emulated devices: it
    said "fix the error raised by the script", critical; the script is right on its machine."""
    run = Run(tmp_path)
    from ddpdoctor.errors import EMULATED_ORDINAL

    message = EMULATED_ORDINAL.format(index=2, devices=2)  # as probe/emulation.py raises it
    run.process(10, 0, events=[("exception", {"type": "RuntimeError", "message": message, "user_frame": SITE})])
    f = _rules(tmp_path)["DD902"]
    assert f.severity.label == "high" and f.evidence["emulated_devices"] == 2
    assert "expects at least 3 GPUs" in f.message and "--nproc N, N at least 3" in f.fix
    assert "Fix the error raised by the script" not in f.fix


def test_processes_claiming_the_same_rank_without_a_launcher(tmp_path: Path) -> None:
    """A self-spawning script with rank=0 hard-coded: no launcher contract to fall back on, the rendezvous hangs."""
    run = Run(tmp_path, timed_out=True)
    claim = ("pg_init_begin", {"site": SITE, "rank_arg": 0, "world_size_arg": 2, "overridden": {}})
    run.process(9, None, role="main")
    run.process(10, None, role="spawned", events=[claim])
    run.process(11, None, role="spawned", events=[claim])
    found = _rules(tmp_path)
    assert "2 processes all passed rank=0" in found["DD104"].message
    assert "rendezvous never completed" in found["DD104"].message


def test_set_epoch_with_a_constant_value(tmp_path: Path) -> None:
    run = Run(tmp_path)
    order = np.array([3, 1, 2, 0])
    for pid, rank in ((10, 0), (11, 1)):
        events = [("sampler_created", {"sampler": 5, "sampler_kind": "distributed", "site": SITE})]
        for it in range(2):
            events += [
                ("set_epoch", {"sampler": 5, "epoch": 0, "site": SITE}),
                ("loader_iter", {"loader": 7, "it": 20 + it, "sampler": 5, "site": SITE}),
                ("sampler_iter", {"sampler": 5, "iteration": it, "epoch": 0, "shuffle": True, "digest": f"d{rank}",
                                  "order": run.blob(pid, order + rank), "sample_mod": None}),
                ("loader_iter_end", {"loader": 7, "it": 20 + it, "training": True, "steps": 4, "sizes": [[2, 2]]}),
            ]
        run.process(pid, rank, events=events)
    f = _rules(tmp_path)["DD301"]
    assert "set_epoch was always called with 0" in f.message and f.magnitude == 1.0


def test_consistent_sample_keeps_the_same_indices_everywhere() -> None:
    """The probe's 1/K rule (ddpdoctor.probe.recorders.data) and the analyses' copy agree, and estimate overlap
    without bias."""
    import pytest

    torch = pytest.importorskip("torch")
    from ddpdoctor.probe.recorders.data import ORDER_CAP, consistent_sample

    n = 3 * ORDER_CAP
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    kept, k = consistent_sample(perm, n)
    assert k == 3
    assert np.array_equal(kept.numpy(), consistent(np.array(perm), k))
    assert abs(len(kept) / n - 1 / k) < 0.01
    half = np.array(perm[: n // 2])
    estimate = np.isin(consistent(half, k), consistent(np.arange(n // 4), k)).mean()
    assert abs(estimate - np.isin(half, np.arange(n // 4)).mean()) < 0.01


def _distributed_epoch(run: Run, pid: int, order: np.ndarray, *, count: int, replicas: int, n: int) -> list:
    return [
        ("sampler_created", {"sampler": 5, "sampler_kind": "distributed", "site": SITE}),
        ("loader_iter", {"loader": 7, "it": 20, "sampler": 5, "sampler_kind": "distributed", "dataset_len": n,
                         "site": SITE, "created_site": SITE}),
        ("sampler_iter", {"sampler": 5, "iteration": 0, "epoch": 0, "shuffle": True, "digest": "x", "count": count,
                          "dataset_len": n, "num_replicas": replicas, "sampler_rank": 0,
                          "order": run.blob(pid, order), "sample_mod": None}),
        ("loader_iter_end", {"loader": 7, "it": 20, "training": True, "steps": 4, "sizes": [[1, 3]]}),
    ]


def test_distributed_sampler_padding_is_not_an_overlap(tmp_path: Path) -> None:
    """5 samples on 2 ranks: the sampler pads rank 1's shard with sample 0 (a third of its shard), by design."""
    run = Run(tmp_path)
    run.process(10, 0, events=_distributed_epoch(run, 10, np.array([0, 2, 4]), count=3, replicas=2, n=5))
    run.process(11, 1, events=_distributed_epoch(run, 11, np.array([1, 3, 0]), count=3, replicas=2, n=5))
    assert "DD302" not in _rules(tmp_path)


def test_every_rank_given_the_same_shard_overlaps(tmp_path: Path) -> None:
    """DistributedSampler(num_replicas=1, rank=0) on every rank: each rank iterates the whole dataset."""
    run = Run(tmp_path)
    order = np.array([4, 1, 3, 0, 2, 5])
    run.process(10, 0, events=_distributed_epoch(run, 10, order, count=6, replicas=1, n=6))
    run.process(11, 1, events=_distributed_epoch(run, 11, order, count=6, replicas=1, n=6))
    f = _rules(tmp_path)["DD302"]
    assert f.evidence["overlap_fraction"] == 1.0 and "overlapping shards" in f.message


def test_dd302_severity_follows_the_overlap_measured(tmp_path: Path) -> None:
    """Severity from the overlap actually measured (issue 20): a third of each shard shared is medium, not high."""
    run = Run(tmp_path)
    run.process(10, 0, events=_distributed_epoch(run, 10, np.array([0, 1, 2]), count=3, replicas=2, n=6))
    run.process(11, 1, events=_distributed_epoch(run, 11, np.array([2, 3, 4]), count=3, replicas=2, n=6))
    f = _rules(tmp_path)["DD302"]
    assert abs(f.evidence["overlap_fraction"] - 1 / 3) < 1e-9 and f.severity.label == "medium"


def test_sharded_models_are_not_replicas(tmp_path: Path) -> None:
    """Without DDP (FSDP, ZeRO) ranks hold different parameter shards: no DD103."""
    run = Run(tmp_path)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=[("pg_init", {"ok": True, "world_size": 2}),
                                       ("params", {"step": 1, "digest": f"shard{rank}", "source": "optimizer",
                                                   "values": [rank]}),
                                       ("done", {"reason": "script returned", "steps": 1, "epochs": 0})])
    assert "DD103" not in _rules(tmp_path)
    run2 = Run(tmp_path / "ddp")
    for pid, rank in ((10, 0), (11, 1)):
        run2.process(pid, rank, events=[("pg_init", {"ok": True, "world_size": 2}),
                                        ("params", {"step": 1, "digest": f"d{rank}", "source": "ddp",
                                                    "values": [0.5 * rank]}),
                                        ("done", {"reason": "script returned", "steps": 1, "epochs": 0})])
    f = _rules(tmp_path / "ddp")["DD103"]
    assert f.evidence["first_step"] == 1 and f.magnitude == 0.5


def test_ranks_that_spawn_their_own_ranks_under_torchrun_are_called_a_double_launch(tmp_path: Path) -> None:
    """What the imagenet example did when the probe mistook it for a launcher script: each torchrun rank started
    two more processes that joined process groups. The report must say where the hang and the clashes come from."""
    run = Run(tmp_path, timed_out=True)
    begin = ("pg_init_begin", {"site": SITE, "rank_arg": 0, "world_size_arg": 2, "overridden": {},
                               "rendezvous": {"given": "tcp://127.0.0.1:29555", "used": "tcp://127.0.0.1:41234"}})
    run.process(10, 0)
    run.process(11, 1)
    for pid in (20, 21, 22, 23):
        run.process(pid, None, role="spawned", events=[begin])
    notes = analyze_run(tmp_path).notes
    assert any("spawned 4 more processes that joined a process group" in n and "double launch" in n for n in notes)
    assert ("the script's own rendezvous tcp://127.0.0.1:29555 was moved to tcp://127.0.0.1:41234 for the probe: a "
            "fixed address could collide with another job on this machine, or be out of reach of a one-machine run"
            ) in notes


# ---------------------------------------------------------------------------------------------- timeouts

TORCH = "/venv/lib/python3.11/site-packages/torch"


def _stack(run: Run, pid: int, *frames: tuple[str, int, str]) -> None:
    """A faulthandler dump of the main thread, innermost frame first, as the launcher collects it at the timeout."""
    lines = ["Current thread 0x1 (most recent call first):"]
    lines += [f'  File "{file}", line {line} in {fn}' for file, line, fn in frames]
    (run.root / "events" / f"h-p{pid}.stack").write_text("\n".join(lines) + "\n")


def _training(steps: list[float]) -> list[tuple[str, dict]]:
    """A DDP rank that took optimizer steps at these times (seconds since the epoch)."""
    events: list[tuple[str, dict]] = [("torch_ready", {"t": 1.0}), ("pg_init", {"t": 1.5, "ok": True, "world_size": 2}),
                                      ("ddp_init", {"t": 2.0, "ok": True, "ddp": 1})]
    return events + [("optimizer_step", {"t": t, "step": i + 1, "opt": 1}) for i, t in enumerate(steps)]


def test_a_rank_silent_while_its_peer_keeps_stepping_is_a_hang(tmp_path: Path) -> None:
    """Rank 0 steps every 2 s up to the timeout (t=60); rank 1 stopped at t=20 inside a barrier: rank 1 is stuck,
    rank 0 is not, and the finding says both."""
    run = Run(tmp_path, timed_out=True, started=0.0, ended=61.5, timeout=60)
    run.process(10, 0, events=_training([10.0 + 2 * i for i in range(25)]))  # last step at t=58
    run.process(11, 1, events=_training([10.0, 12.0, 14.0, 16.0, 18.0, 20.0]))
    _stack(run, 10, (f"{TORCH}/nn/modules/conv.py", 548, "_conv_forward"), (SCRIPT, 30, "<module>"))
    _stack(run, 11, (f"{TORCH}/distributed/distributed_c10d.py", 4811, "barrier"), (SCRIPT, 41, "<module>"))
    found = _rules(tmp_path)
    f = found["DD901"]
    assert f.ranks == (1,) and f.line == 41 and f.confidence.label == "certain"
    assert f.message.startswith("rank 1 made no progress for 40 s until the 60 s timeout: rank 1 blocked in barrier")
    assert "while rank 0 kept making progress (last event 2 s before the timeout, 25 optimizer steps)" in f.message
    assert f.evidence["seconds_per_step"] == 2.0 and f.evidence["stuck"][0]["state"] == "waiting"
    assert f.evidence["stuck"][0]["allowance_seconds"] == 6.0  # 3 steps of 2 s
    assert [r["rank"] for r in f.evidence["still_running"]] == [0]
    rows = {row[0]: row[2] for row in analyze_run(tmp_path).tables["ranks"]["rows"]}
    assert rows == {0: "running at timeout", 1: "stuck"}


def test_ranks_busy_in_a_slow_first_step_ran_out_of_time(tmp_path: Path) -> None:
    """No step within the timeout, both ranks computing (not in a collective) since t=5: a big model on a CPU,
    not a hang — a note, no DD901, and the other analyses still run."""
    run = Run(tmp_path, timed_out=True, started=0.0, ended=30.5, timeout=30)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=_training([]) + [("loader_iter", {"t": 5.0, "loader": 7, "it": 1})])
        _stack(run, pid, (f"{TORCH}/nn/modules/conv.py", 548, "_conv_forward"), (SCRIPT, 30, "<module>"))
    result = analyze_run(tmp_path)
    assert "DD901" not in {f.rule for f in result.findings}
    note = next(n for n in result.notes if "timeout ended the run" in n)
    assert note.startswith("the probe's 30 s timeout ended the run while ranks 0, 1 were still working — not a hang: "
                           "0 optimizer steps per rank observed")
    assert "rank 0 had been busy for 25 s at train.py:30 (in _conv_forward (conv.py:548))" in note
    assert "rerun with a longer --timeout" in note
    assert [row[2] for row in result.tables["ranks"]["rows"]] == ["busy at timeout", "busy at timeout"]


def test_ranks_waiting_for_a_busy_rank_is_a_likely_hang(tmp_path: Path) -> None:
    """Rank 1 has waited in a barrier since t=20 while rank 0 computes outside any collective: rank 0 may loop
    forever or need more time than the timeout — reported, with less than certain confidence."""
    run = Run(tmp_path, timed_out=True, started=0.0, ended=61.0, timeout=60)
    run.process(10, 0, events=_training([10.0, 12.0, 14.0, 16.0, 18.0, 20.0]))
    run.process(11, 1, events=_training([10.0, 12.0, 14.0, 16.0, 18.0, 20.0]))
    _stack(run, 10, ("/proj/metrics.py", 12, "slow_metric"), (SCRIPT, 50, "<module>"))
    _stack(run, 11, (f"{TORCH}/distributed/distributed_c10d.py", 4811, "barrier"), (SCRIPT, 52, "<module>"))
    f = _rules(tmp_path)["DD901"]
    assert f.ranks == (1,) and f.line == 52 and f.confidence.label == "likely"
    assert ("waiting for rank 0, busy outside any collective for 40 s (rank 0 at metrics.py:12 in slow_metric "
            "(metrics.py:12)): either that work never ends, or it needs more than the timeout") in f.message


def test_a_timeout_before_any_rank_started_is_the_run_running_out_of_time(tmp_path: Path) -> None:
    """No rank recorded anything within the timeout: on a loaded machine starting the interpreters and importing
    torch can take that long. That is the run cut short, said in a note — it was a critical DD901 "the script did not
    reach its training loop", a finding about the script that only the machine's load produced."""
    Run(tmp_path, timed_out=True, started=0.0, ended=10.5, timeout=10)
    result = analyze_run(tmp_path)
    assert "DD901" not in {f.rule for f in result.findings}
    note = next(n for n in result.notes if "timeout ended the run" in n)
    assert note.startswith("the probe's 10 s timeout ended the run before any rank had started the script")
    assert "not a hang: 0 optimizer steps observed" in note and "rerun with a longer --timeout" in note


def _rendezvous_wait(run: Run, pid: int) -> None:
    _stack(run, pid, (f"{TORCH}/distributed/rendezvous.py", 200, "_create_c10d_store"),
           (f"{TORCH}/distributed/distributed_c10d.py", 1500, "init_process_group"), (SCRIPT, 11, "<module>"))


def test_a_rank_waiting_in_the_rendezvous_for_a_peer_still_starting_ran_out_of_time(tmp_path: Path) -> None:
    """Rank 0 reached the rendezvous at t=8 and waited; rank 1 was still importing torch at the timeout, or had not
    recorded anything at all: the run was slow to start, not hung — no DD901 (it said "the ranks never all joined
    the process group: give init_process_group the launcher's rank"), a note."""
    begin = [("torch_ready", {"t": 6.0}), ("pg_init_begin", {"t": 8.0, "site": SITE})]
    for name, second in (("importing", True), ("absent", False)):
        root = tmp_path / name
        run = Run(root, timed_out=True, started=0.0, ended=30.5, timeout=30)
        run.process(10, 0, events=begin)
        _rendezvous_wait(run, 10)
        if second:
            run.process(11, 1, events=[])  # process_start only: still importing torch
            _stack(run, 11, ("<frozen importlib._bootstrap>", 1000, "_find_and_load"), (SCRIPT, 1, "<module>"))
        result = analyze_run(root)
        assert "DD901" not in {f.rule for f in result.findings}, name
        assert any("timeout ended the run" in n and "not a hang" in n for n in result.notes), (name, result.notes)


def test_every_rank_waiting_in_the_rendezvous_is_still_a_hang(tmp_path: Path) -> None:
    """Both ranks in the rendezvous for 22 s (a literal rank, a world size that never fills): a hang, as before."""
    run = Run(tmp_path, timed_out=True, started=0.0, ended=30.5, timeout=30)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=[("torch_ready", {"t": 6.0}), ("pg_init_begin", {"t": 8.0, "site": SITE})])
        _rendezvous_wait(run, pid)
    f = _rules(tmp_path)["DD901"]
    assert f.ranks == (0, 1) and "never all joined the process group" in f.fix


def test_a_stall_in_a_ddp_backward_is_a_hang(tmp_path: Path) -> None:
    """Both ranks silent for 40 s at 2 s per step, one in DDP's backward (its all-reduce), one in a collective."""
    run = Run(tmp_path, timed_out=True, started=0.0, ended=60.0, timeout=60)
    run.process(10, 0, events=_training([10.0, 12.0, 14.0, 16.0, 18.0, 20.0]))
    run.process(11, 1, events=_training([10.0, 12.0, 14.0, 16.0, 18.0, 20.0]))
    _stack(run, 10, (f"{TORCH}/autograd/graph.py", 829, "_engine_run_backward"),
           (f"{TORCH}/_tensor.py", 625, "backward"), (SCRIPT, 33, "<module>"))
    _stack(run, 11, (f"{TORCH}/distributed/distributed_c10d.py", 2799, "recv"), (SCRIPT, 35, "<module>"))
    f = _rules(tmp_path)["DD901"]
    assert f.ranks == (0, 1) and f.confidence.label == "certain"
    kinds = {s["rank"]: s["waiting_in"]["kind"] for s in f.evidence["stuck"]}
    assert kinds == {0: "backward", 1: "point_to_point"}  # a recv waits for one peer's send


def test_a_long_first_backward_is_not_a_hang(tmp_path: Path) -> None:
    """No step yet and both ranks in DDP's backward for 20 s: a big model's first backward on a CPU looks the same
    as one waiting in the all-reduce, and nothing tells the pace yet — not called a hang."""
    run = Run(tmp_path, timed_out=True, started=0.0, ended=30.0, timeout=30)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=_training([]) + [("rng_forward", {"t": 10.0, "n": 1})])
        _stack(run, pid, (f"{TORCH}/autograd/graph.py", 829, "_engine_run_backward"),
               (f"{TORCH}/_tensor.py", 625, "backward"), (SCRIPT, 33, "<module>"))
    result = analyze_run(tmp_path)
    assert "DD901" not in {f.rule for f in result.findings}
    assert any("were still working — not a hang: 0 optimizer steps per rank observed" in n for n in result.notes)


def test_a_run_the_timeout_ended_before_its_first_step_measured_nothing(tmp_path: Path) -> None:
    """Slow, not hung, and not one optimizer step: no rank started within the timeout, or both were busy in their
    first step. Not DD901 (the note gives the pace), but not "No findings" either: DD904 says nothing that needs
    training was measured, above the default gate, so that CI never passes on a run that checked nothing. A slow
    run that did take steps measured them: no DD904 there."""
    Run(tmp_path / "unstarted", timed_out=True, started=0.0, ended=10.5, timeout=10)
    busy = Run(tmp_path / "busy", timed_out=True, started=0.0, ended=30.5, timeout=30)
    for pid, rank in ((10, 0), (11, 1)):
        busy.process(pid, rank, events=_training([]) + [("loader_iter", {"t": 5.0, "loader": 7, "it": 1})])
        _stack(busy, pid, (f"{TORCH}/nn/modules/conv.py", 548, "_conv_forward"), (SCRIPT, 30, "<module>"))
    for name, where in (("unstarted", "before any rank had started the script (interpreter start-up and imports)"),
                        ("busy", "while ranks 0, 1 still worked towards the first step")):
        result = analyze_run(tmp_path / name)
        found = {f.rule: f for f in result.findings}
        assert "DD901" not in found, name
        f = found["DD904"]
        assert f.severity >= Severity.MEDIUM and f.evidence["optimizer_steps"] == 0, name
        assert f"timeout ended the run {where}: no optimizer step was observed" in f.message, (name, f.message)
        assert "--timeout" in f.fix, name
    stepped = Run(tmp_path / "stepped", timed_out=True, started=0.0, ended=30.0, timeout=30)
    for pid, rank in ((10, 0), (11, 1)):
        stepped.process(pid, rank, events=_training([10.0, 14.0, 18.0, 22.0, 26.0]))
        _stack(stepped, pid, (f"{TORCH}/nn/modules/conv.py", 548, "_conv_forward"), (SCRIPT, 30, "<module>"))
    assert "DD904" not in {f.rule for f in analyze_run(tmp_path / "stepped").findings}


def test_a_bare_state_dict_the_user_had_is_not_called_a_resume(tmp_path: Path) -> None:
    """A backbone constructor loading ImageNet weights the user downloaded (a bare state dict, no epoch or step)
    is not "a resume from an earlier run": the note says what the file may be, and DD904 (a run without a step)
    does not say "it resumed where an earlier run ended". A file with training counters is still a resume."""
    for name, counters, resumed in (("weights", None, False), ("resume", {"epoch": 2}, True)):
        run = Run(tmp_path / name, timed_out=False, started=0.0, ended=10.0)
        load = {"t": 3.0, "site": {"file": SCRIPT, "line": 12, "function": "<module>"}, "path": "init.pth",
                "abspath": "/proj/init.pth", "users_file": True, "object": "OrderedDict", "counters": counters}
        for pid, rank in ((10, 0), (11, 1)):
            run.process(pid, rank, events=[("checkpoint_load", load)])
        result = analyze_run(tmp_path / name)
        note = next(n for n in result.notes if "init.pth" in n)
        assert ("it resumed from an earlier run" in note) is resumed, (name, note)
        assert ("pretrained weights or an earlier run's state" in note) is not resumed, (name, note)
        dd904 = next(f for f in result.findings if f.rule == "DD904")
        assert ("resumed where an earlier run ended" in dd904.message) is resumed, (name, dd904.message)


def _lr_run(root: Path, train_batches: list[int], backwards: list[int]) -> dict:
    """Two ranks, SGD at lr 0.1, per-rank batch 8: each step drew `train_batches[i]` batches from grad-enabled
    loaders and ran `backwards[i]` backward passes."""
    run = Run(root)
    meta = json.loads((root / "meta.json").read_text())
    (root / "meta.json").write_text(json.dumps({**meta, "base_lr": 0.1, "base_batch": 16}))
    events: list[tuple[str, dict]] = [
        ("pg_init", {"ok": True, "world_size": 2, "backend": "gloo"}),
        ("ddp_init", {"ok": True, "ddp": 1}),
        ("optimizer_init", {"opt": 3, "cls": "SGD", "site": SITE, "groups": [{"lr": 0.1, "numel": 10}]}),
        ("loader_iter_end", {"training": True, "sizes": [[8, sum(train_batches)]], "reason": "cut"}),
    ]
    for i, (batches, bw) in enumerate(zip(train_batches, backwards), 1):
        events.append(("train_step", {"step": i, "opt": 3, "backwards": bw, "syncing_backwards": bw}))
        events.append(("optimizer_step", {"step": i, "opt": 3, "opt_step": i, "train_batches": batches,
                                          "lrs": [0.1]}))
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=events)
    return _rules(root)


def test_batches_fetched_for_evaluation_with_grad_on_are_not_accumulation(tmp_path: Path) -> None:
    """minGPT's trainer evaluates with grad disabled only inside its step function, and multinode.py peeks at
    `next(iter(loader))`: those batches count as grad-enabled fetches but were never trained on. The global batch
    is 16 (8 × 2 ranks), the reference recipe's, so the lr 0.1 needs no scaling."""
    found = _lr_run(tmp_path / "eval", train_batches=[1, 1, 1, 6, 1, 1, 1, 6], backwards=[1] * 8)
    assert "DD401" not in found


def test_real_accumulation_scales_the_global_batch(tmp_path: Path) -> None:
    found = _lr_run(tmp_path / "acc", train_batches=[4] * 8, backwards=[4] * 8)
    f = found["DD401"]
    assert f.evidence["accumulation"] == 4 and f.evidence["global_batch"] == 64
    assert f.evidence["expected_lr"] == 0.4


# ------------------------------------------------------------------------------------------------ differing splits
# pytorch/examples distributed/minGPT-ddp: `random_split(dataset, [n_train, n_test])` without a seeded generator,
# so every rank holds its own train/test split, and a DistributedSampler shards positions of different Subsets.

SPLIT_SITE = {"file": SCRIPT, "line": 30, "function": "<module>"}


def _split_loader(run: Run, pid: int, *, subset: np.ndarray, order_positions: np.ndarray, base_len: int,
                  training: bool, ids: int, num_samples: int, kept: int | None = None, replicas: int = 2) -> list:
    """A DataLoader with a DistributedSampler (rank `pid - 10` of `replicas`, shuffle=False) over a Subset of a
    `base_len`-sample dataset, iterated once: the probe's events, orders mapped to the dataset under the Subset.
    `kept`: record only a consistent sample of the Subset's index list (as for large subsets)."""
    n, it = len(subset), ids + 2
    indices = subset if kept is None else subset[:kept]
    return [
        ("sampler_created", {"sampler": ids, "sampler_kind": "distributed", "site": SPLIT_SITE, "len": n,
                             "num_replicas": replicas, "num_samples": num_samples, "drop_last": False,
                             "sampler_rank": (pid - 10) % replicas}),
        ("loader_created", {"loader": ids + 1, "site": SPLIT_SITE, "sampler": ids, "sampler_kind": "distributed",
                            "dataset_cls": "Subset", "dataset_len": n,
                            "subset": {"depth": 1, "base_len": base_len, "len": n,
                                       "indices": run.blob(pid, indices), "sample_mod": None if kept is None else 7}}),
        ("loader_iter", {"loader": ids + 1, "it": it, "sampler": ids, "sampler_kind": "distributed",
                         "sampler_cls": "DistributedSampler", "dataset_cls": "Subset", "dataset_len": n,
                         "grad_enabled": training, "site": SPLIT_SITE, "created_site": SPLIT_SITE}),
        ("sampler_iter", {"sampler": ids, "iteration": 0, "epoch": 0, "shuffle": False, "digest": f"o{pid}",
                          "count": len(order_positions), "dataset_len": n, "num_replicas": replicas,
                          "sampler_rank": (pid - 10) % replicas, "order": run.blob(pid, subset[order_positions]),
                          "sample_mod": None, "subset_depth": 1, "base_len": base_len}),
        ("loader_iter_end", {"loader": ids + 1, "it": it, "training": training, "steps": 4 if training else 0,
                             "sizes": [[4, 4]]}),
    ]


def _eval_positions(rank: int) -> np.ndarray:
    """DistributedSampler(shuffle=False) over 69 samples on 2 ranks: 0..68 padded with position 0, interleaved."""
    return np.concatenate([np.arange(69), [0]])[rank::2]


def test_eval_padding_over_differing_splits_is_counted_within_each_subset(tmp_path: Path) -> None:
    """69 evaluation samples on 2 ranks, each rank's test Subset its own (rank 0: 100..168, rank 1: 101..169):
    padding is 1, although 34 dataset indices are evaluated by both ranks by chance of the two splits."""
    run = Run(tmp_path)
    for pid, rank in ((10, 0), (11, 1)):
        subset = np.arange(100 + rank, 169 + rank)
        run.process(pid, rank, events=_split_loader(run, pid, subset=subset, order_positions=_eval_positions(rank),
                                                    base_len=1000, training=False, ids=40, num_samples=35))
    f = _rules(tmp_path)["DD303"]
    assert f.evidence["duplicated"] == 1 and f.evidence["duplicated_indices"] == []
    assert f.evidence["measured_from_orders"] is True and f.evidence["subsets_differ_across_ranks"] is True
    assert f.evidence["per_rank_order_length"] == {"0": 35, "1": 35}
    assert "1 sample is evaluated twice to pad 69 samples to 35 per rank" in f.message
    assert "counts 70 results for 69 samples" in f.message and "(index" not in f.message
    assert "positions each rank's order takes in its own Subset" in f.message
    assert "the ranks evaluate different subsets" in f.message and "DD305" in f.message
    assert f.magnitude == 1 / 69


def test_eval_padding_over_differing_splits_without_whole_index_lists(tmp_path: Path) -> None:
    """Where only a sample of the Subsets' index lists was kept, the count is the sampler's arithmetic."""
    run = Run(tmp_path)
    for pid, rank in ((10, 0), (11, 1)):
        subset = np.arange(100 + rank, 169 + rank)
        run.process(pid, rank, events=_split_loader(run, pid, subset=subset, order_positions=_eval_positions(rank),
                                                    base_len=1000, training=False, ids=40, num_samples=35, kept=10))
    f = _rules(tmp_path)["DD303"]
    assert f.evidence["duplicated"] == 1 and f.evidence["measured_from_orders"] is False
    assert "from the sampler's num_samples × num_replicas" in f.message
    assert f.evidence["subsets_differ_across_ranks"] is True


def test_eval_padding_over_the_same_split_still_names_the_index(tmp_path: Path) -> None:
    run = Run(tmp_path)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=_split_loader(run, pid, subset=np.arange(100, 169), base_len=1000,
                                                    order_positions=_eval_positions(rank), training=False, ids=40,
                                                    num_samples=35))
    f = _rules(tmp_path)["DD303"]
    assert f.evidence["duplicated"] == 1 and f.evidence["duplicated_indices"] == [100]
    assert f.evidence["subsets_differ_across_ranks"] is False and "different subsets" not in f.message


def test_distributed_sampler_over_differing_splits_asks_for_a_seeded_split(tmp_path: Path) -> None:
    """60 training samples per rank's split (rank 0: dataset 0..59, rank 1: 39..98), sharded by position: rank 0
    trains 0, 2, …, 58, rank 1 40, 42, …, 98, so 10 of each rank's 30 samples are also the other's."""
    run = Run(tmp_path)
    for pid, rank in ((10, 0), (11, 1)):
        subset = np.arange(0, 60) if rank == 0 else np.arange(39, 99)
        run.process(pid, rank, events=_split_loader(run, pid, subset=subset, order_positions=np.arange(rank, 60, 2),
                                                    base_len=100, training=True, ids=50, num_samples=30))
    f = _rules(tmp_path)["DD302"]
    assert f.evidence["overlap_fraction"] == 1 / 3 and f.evidence["distinct_samples"] == {"0": 30, "1": 30}
    assert f.evidence["splits_differ_across_ranks"] is True
    assert "has a DistributedSampler, but ranks 0, 1 hold different splits" in f.message
    assert "33% of the samples a rank sees are also seen by another rank" in f.message
    assert "generator=torch.Generator().manual_seed(s)" in f.fix and "sampler=DistributedSampler" not in f.fix
    assert f.line == 30


def test_distributed_sampler_over_the_same_subset_keeps_the_generic_fix(tmp_path: Path) -> None:
    """DistributedSampler(num_replicas=1) on both ranks over one split: the overlap is the sampler's."""
    run = Run(tmp_path)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=_split_loader(run, pid, subset=np.arange(0, 60), base_len=100,
                                                    order_positions=np.arange(60), training=True, ids=50,
                                                    num_samples=60, replicas=1))
    f = _rules(tmp_path)["DD302"]
    assert f.evidence["overlap_fraction"] == 1.0 and f.evidence["splits_differ_across_ranks"] is False
    assert "sampler=DistributedSampler" in f.fix and "overlapping shards" in f.message


def test_dataset_differing_by_split_names_the_subset_and_a_seeded_split(tmp_path: Path) -> None:
    run = Run(tmp_path)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=[("dataset_items", {
            "loader": 51, "dataset": 9, "dataset_cls": "Subset", "base_cls": "CharDataset", "site": SPLIT_SITE,
            "len": 60, "sampler_cls": "DistributedSampler", "sharded": True, "deterministic": True,
            "subsets": [{"len": 60, "digest": f"split{rank}", "head": [rank * 39, rank * 39 + 1]}],
            "items": [{"index": i, "digest": f"d{rank}-{i}", "parts": None} for i in (0, 1, 30, 59)]})])
    f = _rules(tmp_path)["DD305"]
    assert "it is a Subset of CharDataset whose index list differs across ranks" in f.message
    assert "(first indices rank 0: [0, 1]; rank 1: [39, 40])" in f.message
    assert "generator=torch.Generator().manual_seed(s)" in f.fix and f.evidence["split_differs"] is True
    assert f.evidence["differing_fraction"] == 1.0 and "not recorded" in f.evidence["location"]


def _static_dd207(run: Run) -> None:
    from ddpdoctor.findings import Confidence, Finding
    from ddpdoctor.levels import Severity

    finding = Finding(rule="DD207", severity=Severity.MEDIUM, message="evaluation without model.eval()",
                      fix="call model.eval()", file=SCRIPT, line=30, confidence=Confidence.LIKELY)
    (run.root / "static.json").write_text(json.dumps({"findings": [finding.to_json()], "notes": []}))


def _steps(n: int, *extra: tuple[str, dict]) -> list[tuple[str, dict]]:
    return [*extra, *[("optimizer_step", {"step": i, "site": SITE}) for i in range(n)]]


def test_a_static_dd207_on_a_model_without_batchnorm_is_cleared_by_the_run(tmp_path: Path) -> None:
    """A BN-free model (an EMA encoder of LayerNorm blocks, a network built where the source does not show it):
    the ranks stepped and no BatchNorm layer ran, so the pattern DD207 saw cannot normalise anything wrongly."""
    run = Run(tmp_path)
    _static_dd207(run)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=_steps(3))
    result = analyze_run(tmp_path)
    cleared = [c for c in result.clearances if c.rule == "DD207"]
    assert cleared and "no BatchNorm layer ran in the 3 training steps" in cleared[0].reason, result.clearances
    assert "DD207" not in {f.rule for f in result.findings}


def test_a_static_dd207_stays_when_batchnorm_ran_or_nothing_stepped(tmp_path: Path) -> None:
    layer = ("bn_layer", {"layer": 0, "name": "bn", "cls": "BatchNorm2d", "bn_kind": "plain", "num_features": 4,
                          "momentum": 0.1, "eps": 1e-5, "affine": True, "track_running_stats": True, "site": SITE})
    failed = ("internal_error", {"where": "batchnorm forward", "error": "RuntimeError: boom", "traceback": ""})
    for name, events in (("bn", _steps(3, layer)), ("nostep", _steps(0)), ("recorder_failed", _steps(3, failed))):
        root = tmp_path / name
        run = Run(root)
        _static_dd207(run)
        for pid, rank in ((10, 0), (11, 1)):
            run.process(pid, rank, events=events)
        result = analyze_run(root)
        assert not [c for c in result.clearances if c.rule == "DD207" and "no BatchNorm" in c.reason], name
