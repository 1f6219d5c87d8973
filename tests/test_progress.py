"""The live progress display while probing: per rank state from the event logs, on a terminal (captured under a
pseudo-terminal) and as a few plain lines elsewhere; nothing with --quiet."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpdoctor.probe.progress import EventTail, ProgressDisplay, RunProgress

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "fixtures" / "runs" / "bn_iid_default"  # 2 ranks, 2 epochs x 4 steps, both finished


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _events(run: Path) -> dict[str, list[str]]:
    return {log.name: log.read_text().splitlines(keepends=True) for log in sorted((run / "events").glob("*.jsonl"))}


def _grow(run: Path, logs: dict[str, list[str]], upto_kind: str | None, clock: Clock) -> None:
    """Append to `run`'s logs the recorded lines up to (and including) the first event of `upto_kind` in each log
    (all of them for None), as the ranks would; the clock follows the events' times."""
    (run / "events").mkdir(parents=True, exist_ok=True)
    for name, lines in logs.items():
        path = run / "events" / name
        have = len(path.read_text().splitlines()) if path.exists() else 0
        take = len(lines)
        if upto_kind is not None:
            take = next((i + 1 for i, ln in enumerate(lines) if json.loads(ln)["kind"] == upto_kind), have)
        with path.open("a") as fh:
            fh.writelines(lines[have:max(have, take)])
        if take:
            clock.t = max(clock.t, json.loads(lines[max(have, take) - 1])["t"])


def test_tail_reads_only_complete_lines(tmp_path: Path) -> None:
    (tmp_path / "events").mkdir()
    log = tmp_path / "events" / "h-p1.jsonl"
    log.write_text('{"kind": "process_start", "pid": 1, "t": 1.0, "rank": 0}\n{"kind": "torch_re')
    tail = EventTail(tmp_path)
    assert [e["kind"] for _, e in tail.read()] == ["process_start"]
    with log.open("a") as fh:
        fh.write('ady", "pid": 1, "t": 2.0, "rank": 0}\n')
    assert [e["kind"] for _, e in tail.read()] == ["torch_ready"]
    assert tail.read() == []


def test_rank_states_follow_a_recorded_run(tmp_path: Path) -> None:
    logs = _events(RECORDED)
    clock = Clock(0.0)
    progress = RunProgress(tmp_path)
    _grow(tmp_path, logs, "process_start", clock)
    progress.poll()
    assert [p.phase for p in progress.ranks] == ["torch", "torch"] and [p.rank for p in progress.ranks] == [0, 1]
    _grow(tmp_path, logs, "pg_init_begin", clock)
    progress.poll()
    assert {p.phase for p in progress.ranks} == {"rendezvous"}
    _grow(tmp_path, logs, "optimizer_step", clock)
    progress.poll()
    assert [(p.phase, p.steps, p.epoch) for p in progress.ranks] == [("training", 1, 0), ("training", 1, 0)]
    _grow(tmp_path, logs, None, clock)
    changes = progress.poll()
    assert [p.phase for p in progress.ranks] == ["finished", "finished"]
    assert [p.steps for p in progress.ranks] == [8, 8] and [p.steps_in_epoch for p in progress.ranks] == [
        {0: 4, 1: 4}, {0: 4, 1: 4}]
    assert {after for _, _, after in changes} == {"finished"}


def test_plain_lines_say_a_few_things(tmp_path: Path) -> None:
    logs = _events(RECORDED)
    clock = Clock(min(json.loads(v[0])["t"] for v in logs.values()) - 1.0)
    out = io.StringIO()
    display = ProgressDisplay(tmp_path, script="train_bn.py", nproc=2, epochs=2, steps=4, timeout=120, stream=out,
                              terminal=False, clock=clock)
    for kind in ("process_start", "torch_ready", "pg_init", "optimizer_step", "loader_iter_end", None):
        _grow(tmp_path, logs, kind, clock)
        display.update()
    display.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "ddpdoctor: probing train_bn.py on 2 ranks (2 epochs × 4 steps, timeout 120 s)"
    assert lines[1].startswith("ddpdoctor: 2 ranks joined the process group (")
    assert lines[2].startswith("ddpdoctor: epoch 1/2 done on every rank")
    assert lines[3].startswith("ddpdoctor: epoch 2/2 done on every rank")
    assert lines[4].startswith("ddpdoctor: probe finished in ") and lines[4].endswith(
        "2 ranks, 8 optimizer steps each; analysing")
    assert len(lines) == 5 and "\x1b" not in out.getvalue()


def test_plain_lines_name_a_failing_rank_and_a_timeout(tmp_path: Path) -> None:
    (tmp_path / "events").mkdir()
    clock = Clock(100.0)
    out = io.StringIO()
    display = ProgressDisplay(tmp_path, script="t.py", nproc=2, epochs=2, steps=4, stream=out, terminal=False,
                              clock=clock)
    (tmp_path / "events" / "h-p7.jsonl").write_text(
        '{"kind":"process_start","t":100.5,"pid":7,"seq":1,"rank":1,"role":"rank","env":{"RANK":"1"}}\n'
        '{"kind":"exception","t":101.0,"pid":7,"seq":2,"rank":1,"type":"RuntimeError","message":"CUDA out of '
        'memory\\nmore"}\n')
    (tmp_path / "events" / "h-p6.jsonl").write_text(
        '{"kind":"process_start","t":100.5,"pid":6,"seq":1,"rank":0,"role":"rank","env":{"RANK":"0"}}\n'
        '{"kind":"pg_init_begin","t":101.0,"pid":6,"seq":2,"rank":0}\n')
    clock.t = 102.0
    display.update()
    clock.t = 102.0 + 31
    display.update()  # nothing new for over 30 s: a "still running" line
    display.close(timed_out=True)
    lines = out.getvalue().splitlines()
    assert lines[1] == "ddpdoctor: rank 1 failed: RuntimeError: CUDA out of memory (2.0 s)"
    assert lines[2].startswith("ddpdoctor: still running after 33.0 s: rank 0: rendezvous; rank 1: failed: ")
    assert lines[3] == "ddpdoctor: probe stopped at the timeout after 33.0 s (rank 0: rendezvous, rank 1: failed: " \
        "RuntimeError: CUDA out of memory)"


def test_terminal_table_is_live_and_transient(tmp_path: Path) -> None:
    logs = _events(RECORDED)
    clock = Clock(min(json.loads(v[0])["t"] for v in logs.values()) - 1.0)
    out = io.StringIO()
    display = ProgressDisplay(tmp_path, script="train_bn.py", nproc=2, epochs=2, steps=4, stream=out, terminal=True,
                              width=80, clock=clock)
    _grow(tmp_path, logs, "optimizer_step", clock)
    display.update()
    drawn = out.getvalue()
    assert "ddpdoctor: probing train_bn.py — 2 ranks, 2 epochs × 4 steps" in drawn
    assert "training" in drawn and "1/2" in drawn and "1/4" in drawn  # epoch 1 of 2, step 1 of 4
    _grow(tmp_path, logs, None, clock)
    display.close()
    text = out.getvalue()
    assert "\x1b[" in text  # cursor movement: the table is redrawn in place, then erased
    last = text.rstrip().splitlines()[-1]
    assert last.endswith("2 ranks, 8 optimizer steps each; analysing") and "ddpdoctor: probe finished in " in last


# ----------------------------------------------------------------------------- the real command


def _check_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "ddpdoctor", "check", "fixtures/probe/missing_set_epoch.py", "--format", "json",
            *extra]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}
    env.update(COLUMNS="100", LINES="40", TERM="xterm-256color")
    return env


@pytest.mark.slow
def test_check_without_a_terminal_prints_plain_progress_lines_on_stderr() -> None:
    done = subprocess.run(_check_cmd(), check=False, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode in (0, 1), done.stderr
    json.loads(done.stdout)  # stdout is the report alone
    lines = done.stderr.splitlines()
    assert lines[0].startswith("ddpdoctor: probing fixtures/probe/missing_set_epoch.py on 2 ranks")
    assert any(ln.startswith("ddpdoctor: 2 ranks joined the process group") for ln in lines)
    assert lines[-1].startswith("ddpdoctor: probe finished in ")
    assert len(lines) <= 8 and "\x1b" not in done.stderr


# `check --quiet` prints nothing on stderr: test_probe_e2e.py::test_missing_set_epoch_repeats_the_order runs this
# fixture so (one launch for its findings and the quiet stderr)


@pytest.mark.slow
def test_check_under_a_pseudo_terminal_draws_the_live_table() -> None:
    """stderr on a pty (the user's terminal), stdout to a pipe: the table is drawn while the ranks run."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(_check_cmd(), cwd=REPO, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=slave)
    os.close(slave)
    seen: list[tuple[float, bytes]] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    break
                if not data:
                    break
                seen.append((time.monotonic(), data))
            elif proc.poll() is not None:
                break
        report, _ = proc.communicate(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, 1)
    json.loads(report)
    text = b"".join(d for _, d in seen).decode("utf-8", errors="replace")
    assert "ddpdoctor: probing fixtures/probe/missing_set_epoch.py — 2 ranks, 2 epochs × 4 steps" in text
    assert "rank" in text and "state" in text and "elapsed" in text  # the table's columns
    # which phases a poll catches depends on the machine's speed (on a quiet CI machine 8 steps take < 1 s and the
    # table may go from "in process group" to "finished" between two polls): any rank state will do
    assert any(state in text for state in ("starting", "rendezvous", "in process group", "training", "finished"))
    assert "\x1b[" in text  # redrawn in place
    assert "ddpdoctor: probe finished in " in text.rstrip().splitlines()[-1]
    assert len(seen) >= 3  # drawn several times while it ran, not once at the end


if not hasattr(os, "openpty"):  # pragma: no cover - Windows
    test_check_under_a_pseudo_terminal_draws_the_live_table = pytest.mark.skip("no pty")(
        test_check_under_a_pseudo_terminal_draws_the_live_table)


@pytest.mark.parametrize("terminal", [False, True])
@pytest.mark.parametrize("logs", ["none", "no-rank"])
def test_a_run_where_no_rank_recorded_a_step_ends_with_a_line_not_an_error(tmp_path: Path, terminal: bool,
                                                                           logs: str) -> None:
    """A script that shadows a module the probe needs (random.py, torch.py) dies before any rank records a step:
    the end line indexed the empty list of step counts ("internal error: IndexError" instead of DD902)."""
    (tmp_path / "events").mkdir()
    if logs == "no-rank":  # only the launcher's main process said anything
        (tmp_path / "events" / "h-p5.jsonl").write_text(
            '{"kind":"process_start","t":100.5,"pid":5,"seq":1,"role":"main","env":{}}\n'
            '{"kind":"exception","t":100.6,"pid":5,"seq":2,"type":"AttributeError","message":"partially initialized '
            'module \'torch\'"}\n')
    out = io.StringIO()
    display = ProgressDisplay(tmp_path, script="random.py", nproc=2, epochs=2, steps=4, stream=out,
                              terminal=terminal, width=100, clock=Clock(100.0))
    display.update()
    display.close()
    assert out.getvalue().rstrip().splitlines()[-1].endswith("no rank recorded anything; analysing")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["random.py", "torch.py"])
def test_a_script_that_shadows_a_module_gets_its_report_with_the_progress_display(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("import torch\nimport torch.distributed as dist\n\ndist.init_process_group('gloo')\n"
                                 "print('trained')\n")
    # the installed command, as a user runs it (`python -m` would put the folder on ddpdoctor's own sys.path)
    done = subprocess.run([str(Path(sys.executable).parent / "ddpdoctor"), "check", name, "--format", "json"],
                          check=False, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "internal error" not in done.stderr, done.stderr
    # torchrun's ranks would import the shadowing module from the script's folder; the probe's ranks imported
    # torch before it: either the crash (DD902) or the run that trained nothing (DD904), a report either way
    assert {"DD902", "DD904"} & {f["rule"] for f in json.loads(done.stdout)["findings"]}
    assert done.stderr.splitlines()[-1].startswith("ddpdoctor: probe finished in ")


def test_a_stall_is_said_as_a_suspected_hang_before_the_timeout(tmp_path: Path) -> None:
    """No event from any rank for a quarter of the timeout while ranks train: one line saying where each rank is
    (issue 22), well before the timeout; said again only after events resume and stop again."""
    logs = _events(RECORDED)
    clock = Clock(min(json.loads(v[0])["t"] for v in logs.values()) - 1.0)
    out = io.StringIO()
    display = ProgressDisplay(tmp_path, script="train_bn.py", nproc=2, epochs=2, steps=4, timeout=40, stream=out,
                              terminal=False, clock=clock)
    assert display.stall_s == 10.0
    _grow(tmp_path, logs, "optimizer_step", clock)
    display.update()
    clock.t += 9.0
    display.update()
    assert "suspected hang" not in out.getvalue()
    clock.t += 2.0
    display.update()
    clock.t += 5.0
    display.update()
    stalls = [ln for ln in out.getvalue().splitlines() if "suspected hang" in ln]
    assert len(stalls) == 1, out.getvalue()
    assert "rank 0: epoch 1/2, step 1/4" in stalls[0] and "no event from any rank for 11.0 s" in stalls[0]
    display.close(timed_out=True)


def test_no_stall_while_ranks_import_torch_and_the_live_table_says_a_stall(tmp_path: Path) -> None:
    logs = _events(RECORDED)
    clock = Clock(min(json.loads(v[0])["t"] for v in logs.values()) - 1.0)
    out = io.StringIO()
    display = ProgressDisplay(tmp_path, script="t.py", nproc=2, epochs=2, steps=4, timeout=40, stream=out,
                              terminal=False, clock=clock)
    _grow(tmp_path, logs, "process_start", clock)  # importing torch: slow on a loaded machine, not a hang
    display.update()
    clock.t += 25.0
    display.update()
    assert "suspected hang" not in out.getvalue()
    display.discard()
    live = io.StringIO()
    display = ProgressDisplay(tmp_path / "b", script="t.py", nproc=2, epochs=2, steps=4, timeout=40, stream=live,
                              terminal=True, width=100, clock=clock)
    _grow(tmp_path / "b", logs, "optimizer_step", clock)
    display.update()
    clock.t += 12.0
    display.update()
    assert "no event from any rank for 12.0 s: a suspected hang" in live.getvalue()
    display.close()
