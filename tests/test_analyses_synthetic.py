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
        lines = [{"kind": "process_start", "role": role, "main_thread": "0x1", "python": "3.11.7"}, *[{"kind": k, **f} for k, f in events]]
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
        {"rank": 0, "exitcode": 1, "timestamp": 40, "pid": 10}, {"rank": 1, "exitcode": -15, "signal": "SIGTERM", "timestamp": 41, "pid": 11}]})
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


def test_sharded_models_are_not_replicas(tmp_path: Path) -> None:
    """Without DDP (FSDP, ZeRO) ranks hold different parameter shards: no DD103."""
    run = Run(tmp_path)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=[("pg_init", {"ok": True, "world_size": 2}),
                                       ("params", {"step": 1, "digest": f"shard{rank}", "source": "optimizer", "values": [rank]}),
                                       ("done", {"reason": "script returned", "steps": 1, "epochs": 0})])
    assert "DD103" not in _rules(tmp_path)
    run2 = Run(tmp_path / "ddp")
    for pid, rank in ((10, 0), (11, 1)):
        run2.process(pid, rank, events=[("pg_init", {"ok": True, "world_size": 2}),
                                        ("params", {"step": 1, "digest": f"d{rank}", "source": "ddp", "values": [0.5 * rank]}),
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
