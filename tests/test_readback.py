"""Recorders read device values without a host synchronisation per step (ddpdoctor.probe.readback).

Without a GPU the deferred path is exercised with CPU tensors (`defer_cpu`): the unit tests check the delivery
rules, and a real 2-rank attach run recorded both ways checks that deferred recording writes the same events as
immediate recording (the GPU path differs only in where the copies come from: pinned memory behind a CUDA event).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpdoctor.probe.launcher import free_port
from ddpdoctor.probe.readback import DEFER_ENV, Readback

REPO = Path(__file__).resolve().parents[1]


def test_cpu_tensors_are_delivered_at_once() -> None:
    rb = Readback()
    got: list[list[float]] = []
    rb.read([torch.tensor([1.0, 2.0])], lambda host: got.append(host[0].tolist()))
    assert got == [[1.0, 2.0]] and rb.pending == 0 and rb.deferred == 0


def test_deferred_reads_land_in_order_at_the_next_step_and_at_the_end() -> None:
    rb = Readback(defer_cpu=True, max_pending=3)
    got: list[str] = []
    x = torch.tensor([1.0])
    rb.read([x], lambda host: got.append(f"a={host[0].item()}"))
    x.add_(1)  # the script changes the tensor afterwards: the read holds the value at the time of the call
    rb.read([x], lambda host: got.append(f"b={host[0].item()}"))
    assert got == [] and rb.pending == 2
    rb.step()
    assert got == ["a=1.0", "b=2.0"]
    for i in range(5):  # more than max_pending outstanding: the oldest are delivered
        rb.read([torch.tensor([float(i)])], lambda host, i=i: got.append(f"c{i}"))
    assert got[2:] == ["c0", "c1"] and rb.pending == 3
    rb.drain()
    assert got[2:] == ["c0", "c1", "c2", "c3", "c4"] and rb.pending == 0
    rb.read([x], lambda host: got.append("after end"))  # after the drain: delivered at once
    assert got[-1] == "after end" and rb.pending == 0


def test_a_failing_callback_is_an_internal_error_not_the_scripts_problem() -> None:
    errors: list[str] = []
    rb = Readback(defer_cpu=True, on_error=lambda where, exc: errors.append(f"{where}: {exc}"))
    rb.read([torch.zeros(1)], lambda host: 1 / 0, where="bn_step moments")
    rb.read([torch.zeros(1)], lambda host: errors.append("next one still runs"))
    rb.drain()
    assert errors == ["bn_step moments: division by zero", "next one still runs"]


def _attach_run(out: Path, defer: bool) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}
    if defer:
        env[DEFER_ENV] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--max-restarts", "0", "-m", "ddpdoctor.probe", "--out", str(out),
           "--device", "cpu", "fixtures/probe/bn/train_bn.py"]
    done = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def _events(run: Path, kind: str) -> dict[int, list[dict]]:
    """kind's events per rank, without the fields that differ between any two runs (times, pids, blobs)."""
    out: dict[int, list[dict]] = {}
    for log in sorted((run / "events").glob("*.jsonl")):
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        rank = next(e["rank"] for e in events if e.get("rank") is not None)
        # params: the digest and the sampled values are taken differently on the device path (a fingerprint,
        # evenly spaced positions); compared across ranks below
        drop = ("t", "pid", "seq", "moments", "digest", "on_device", "values")
        out[rank] = [{k: v for k, v in e.items() if k not in drop} for e in events if e["kind"] == kind]
    return out


@pytest.mark.slow
def test_deferred_recording_writes_the_same_events(tmp_path: Path) -> None:
    from ddpdoctor.check import report_run
    from ddpdoctor.rundata import read_run

    _attach_run(tmp_path / "now", defer=False)
    _attach_run(tmp_path / "later", defer=True)
    for kind in ("bn_step", "train_step", "params", "optimizer_step", "ddp_input_digest"):
        assert _events(tmp_path / "now", kind) == _events(tmp_path / "later", kind), kind
    # the DDP input digests, gathered on the device and read back later, are the same digests
    digests = {name: [(e["step"], e["digest"], e["rows"]) for r in (0, 1)
                      for e in read_run(tmp_path / name).rank_processes[r].of("ddp_input_digest")]
               for name in ("now", "later")}
    assert digests["now"] == digests["later"] and len(digests["now"]) == 8, digests
    # the BN moments, read back later, are the same numbers
    now, later = read_run(tmp_path / "now"), read_run(tmp_path / "later")
    for r in (0, 1):
        a = [now.load_array(e["moments"]) for e in now.rank_processes[r].of("bn_step") if e["moments"]]
        b = [later.load_array(e["moments"]) for e in later.rank_processes[r].of("bn_step") if e["moments"]]
        assert len(a) == len(b) > 0 and all((x == y).all() for x, y in zip(a, b, strict=True))
        params = later.rank_processes[r].of("params")
        assert params and all(e["on_device"] for e in params)  # the deferred (GPU) digest path was taken
    # replicas agree under the fingerprint digest as under the byte digest
    digests = [[e["digest"] for e in later.rank_processes[r].of("params")] for r in (0, 1)]
    assert digests[0] == digests[1]
    values = [[e["values"] for e in later.rank_processes[r].of("params")] for r in (0, 1)]
    assert values[0] == values[1] and all(len(v) == 256 for v in values[0])
    assert {f.rule for f in report_run(tmp_path / "now").findings} == {
        f.rule for f in report_run(tmp_path / "later").findings}
