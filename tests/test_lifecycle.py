"""Nothing keeps running after ddpdoctor exits, however it exits: real `ddpdoctor check` processes, real signals,
scripts that escape the process tree, ignore signals, kill their launcher or own the signals a probe could use.

Each test marks everything it starts: an environment variable every process of the run inherits, and a token in
the command line of processes that start with a fresh environment. After each test no process carrying either is
alive, and the temporary directory the run used is empty.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = "fixtures/probe/lifecycle"
MARK = "DDPD_TEST_MARK"
# Waits on a state (the run's processes gone, its temporary folder empty, the launcher started) return as soon as it
# is reached: a quiet machine reaches it in well under a second. The bound is only the safety net that turns a leak
# into a failure, sized for a loaded 2-core machine (a load of 50 was seen beside the suite; a tree of processes
# being killed and its folder removed need CPU time to go, a few seconds of bound are not a promise the tool makes).
GONE_S = 120.0
STARTED_S = 600.0
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find leftover processes"),
]


def _carrying(mark: str, token: str) -> list[int]:
    """Live processes with the mark in their environment or the token in their command line (zombies are dead)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            if stat[stat.rfind(")") + 2 :].split()[0] == "Z":
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in environ or token.encode() in cmdline:
            found.append(int(entry.name))
    return found


def _wait_gone(mark: str, token: str, seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    while True:
        left = _carrying(mark, token)
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.1)


@pytest.fixture
def marked(tmp_path: Path):
    """(env for ddpdoctor, token, temp dir) — and, after the test, nothing of it left."""
    mark, token = uuid.uuid4().hex, f"ddpd-token-{uuid.uuid4().hex}"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, MARK: mark, "TMPDIR": str(tmp)}
    yield env, token, tmp
    left = _wait_gone(mark, token, GONE_S)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert left == [], "processes of the run outlived the test"


def _check(env: dict, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpdoctor", "check", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_processes_that_escape_the_tree_and_the_environment_end_with_the_run(marked, tmp_path: Path) -> None:
    env, token, tmp = marked
    run = tmp_path / "run"
    done = _check(env, f"{FIXTURES}/escape.py", "--keep-run", str(run), "--timeout", "600", "--", token)
    assert "Traceback" not in done.stderr, done.stderr
    assert _wait_gone(env[MARK], token, GONE_S) == []
    assert "started the escapees" in (run / "logs" / "rank0.stdout").read_text()
    launch = json.loads((run / "launcher.json").read_text())
    assert len(launch["killed"]) >= 2  # both sleepers, found although they left the session and the environment
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("kill_after", [0.0, 1.0, 2.5, 4.5])
def test_sigkill_of_ddpdoctor_during_start_up_takes_the_run_with_it(marked, tmp_path: Path, kill_after: float) -> None:
    """A project sitecustomize that takes 3 s makes every start-up slow (the launcher's, then the ranks'): SIGKILL
    of ddpdoctor `kill_after` seconds after the launcher appeared leaves nothing."""
    env, token, tmp = marked
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import time\ntime.sleep(3)\n")
    env = {**env, "PYTHONPATH": str(site)}
    proc = subprocess.Popen([sys.executable, "-m", "ddpdoctor", "check", f"{FIXTURES}/runs_forever.py",
                             "--timeout", "300", "--", token], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + STARTED_S
        while time.monotonic() < end and not any(
            b"ddpdoctor.probe.agent" in Path(f"/proc/{p}/cmdline").read_bytes() for p in _carrying(env[MARK], token)
        ):
            time.sleep(0.05)
        time.sleep(kill_after)
    finally:
        proc.kill()
        proc.wait()
    assert _wait_gone(env[MARK], token, GONE_S) == []
    assert _wait_until_empty(tmp, GONE_S) == []


def _wait_until_empty(folder: Path, seconds: float) -> list[str]:
    end = time.monotonic() + seconds
    while True:
        left = sorted(p.name for p in folder.iterdir())
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.1)


def test_sigkill_of_ddpdoctor_stops_spawned_workers_that_ignore_sigint_and_sigterm(marked) -> None:
    env, token, tmp = marked
    proc = subprocess.Popen([sys.executable, "-m", "ddpdoctor", "check", f"{FIXTURES}/spawn_ignores_signals.py",
                             "--timeout", "300", "--", token], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + STARTED_S
        spinning = []
        while time.monotonic() < end and len(spinning) < 2:
            spinning = [p for p in _carrying(env[MARK], token)
                        if b"multiprocessing" in Path(f"/proc/{p}/cmdline").read_bytes()]
            time.sleep(0.2)
        assert len(spinning) >= 2, "the workers never started"
    finally:
        proc.kill()
        proc.wait()
    assert _wait_gone(env[MARK], token, GONE_S) == []
    assert _wait_until_empty(tmp, GONE_S) == []


def test_a_killed_launcher_is_a_failure_not_a_clean_run(marked, tmp_path: Path) -> None:
    env, token, _ = marked
    run = tmp_path / "run"
    done = _check(env, f"{FIXTURES}/kills_launcher.py", "--keep-run", str(run), "--timeout", "600",
                  "--format", "json", "--", token)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    dd902 = [f for f in report["findings"] if f["rule"] == "DD902"]
    assert dd902 and "died with SIGKILL" in dd902[0]["message"], report["findings"]
    assert dd902[0]["evidence"]["root_cause"]["kind"] == "launcher"
    assert json.loads((run / "launcher.json").read_text())["returncode"] == -signal.SIGKILL


def test_the_hang_diagnosis_does_not_fire_the_scripts_own_signal_handler(marked, tmp_path: Path) -> None:
    env, token, _ = marked
    for timeout in (15, 45, 135):  # until rank 1 has waited in its collective for a while: what a hang needs
        run = tmp_path / f"run{timeout}"
        done = _check(env, f"{FIXTURES}/requeue_handler.py", "--keep-run", str(run), "--timeout", str(timeout),
                      "--format", "json", "--", token)
        if _waited(run, 1, "pg_init", 10.0):
            break
    report = json.loads(done.stdout)
    dd901 = [f for f in report["findings"] if f["rule"] == "DD901"]
    assert dd901, report["findings"]
    stuck = {s["rank"]: s for s in dd901[0]["evidence"]["stuck"]}
    assert stuck[1]["blocked_in"] is not None and "all_reduce" in json.dumps(stuck[1]["stack"])
    logs = "".join(p.read_text() for p in (run / "logs").glob("rank*.std*"))
    assert "REQUEUE HANDLER RAN" not in logs


def test_a_failure_under_cuda_emulation_points_at_the_script_without_the_probes_frames(marked, tmp_path: Path) -> None:
    env, _, _ = marked
    run = tmp_path / "run"
    done = _check(env, "fixtures/probe/cuda_op_raises.py", "--keep-run", str(run), "--timeout", "600",
                  "--format", "json")
    report = json.loads(done.stdout)
    [f] = [f for f in report["findings"] if f["rule"] == "DD902"]
    root = f["evidence"]["root_cause"]
    assert root["user_frame"]["line"] == 11 and f["line"] == 11
    text = "\n".join(root["traceback"]) + "\n".join(f["evidence"]["stderr_tail"])
    assert "cuda_op_raises.py" in text and "view" in text
    assert "ddpdoctor" not in text and "runpy" not in text, text


def test_a_literal_rank_and_the_scripts_own_master_port_are_measured_past(marked, tmp_path: Path) -> None:
    """DD104: rank 0 hard-coded and MASTER_PORT set by the script. Overriding the rank alone left both ranks in
    the rendezvous until the timeout while the finding claimed the probe kept measuring."""
    env, _, _ = marked
    done = _check(env, "fixtures/probe/hardcoded_rank_own_master.py", "--timeout", "600", "--format", "json")
    report = json.loads(done.stdout)
    rules = {f["rule"]: f for f in report["findings"]}
    assert "DD901" not in rules and "went on measuring" in rules["DD104"]["message"]
    steps = report["tables"]["ranks"]["rows"]
    assert [row[3] for row in steps] == [8, 8]


def test_scratch_outlives_the_processes_until_the_caller_lets_the_supervisor_go(tmp_path: Path) -> None:
    """compare-bn reads its ranks' results from the supervisor's scratch directory after they exit: the supervisor
    must not remove it the moment the last process is gone (it did, and rank 1's results vanished under load)."""
    from ddpdoctor.probe.supervisor import Command, Supervisor

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = scratch / "result.json"
    log = str(tmp_path / "out.log")
    code = f"open({str(result)!r}, 'w').write('{{}}')"
    sup = Supervisor([Command(argv=[sys.executable, "-c", code], stdout=log, stderr=log)], env=dict(os.environ),
                     cwd=str(tmp_path), tag=uuid.uuid4().hex, deadline=time.time() + 60, scratch=[str(scratch)])
    sup.start()
    try:
        end = time.monotonic() + STARTED_S
        while sup.poll()[0] is None and time.monotonic() < end:
            time.sleep(0.02)
        assert sup.poll() == [0]
        time.sleep(0.5)  # the supervisor has long seen its only process exit
        assert result.read_text() == "{}"
    finally:
        final = sup.stop()
    assert final["reason"] == "exited" and not scratch.exists()


@pytest.mark.parametrize("command", ["check", "triage"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_kill_at_any_moment_leaves_no_temporary_run_directory(marked, command: str, sig: int) -> None:
    """`triage` made its temporary directory with no guard (a SIGTERM 2.5 s in left ddpdoctor-triage-* in /tmp);
    `check` had a window between making it and starting the guard. The guard now runs before the directory
    exists. Killed at several moments of start-up and of the run, nothing is left in TMPDIR."""
    env, token, tmp = marked
    for delay in (0.3, 1.5, 3.0, 6.0):
        proc = subprocess.Popen([sys.executable, "-m", "ddpdoctor", command, "fixtures/demo/train.py", "--timeout",
                                 "120"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(sig)
        proc.wait(timeout=300)
        assert _wait_gone(env[MARK], token, GONE_S) == []
        assert _wait_until_empty(tmp, GONE_S) == [], f"{command} killed by {signal.Signals(sig).name} after {delay} s"


def _recorded(run_dir: Path, kind: str) -> set[int]:
    """Ranks whose event log holds a complete event of this kind."""
    ranks: set[int] = set()
    for log in (run_dir / "events").glob("*.jsonl"):
        try:
            lines = log.read_text(encoding="utf-8").splitlines(keepends=True)
        except OSError:
            continue
        for line in lines:
            if line.endswith("\n") and f'"kind":"{kind}"' in line:
                event = json.loads(line)
                if event.get("rank") is not None:
                    ranks.add(int(event["rank"]))
    return ranks


def _waited(run_dir: Path, rank: int, kind: str, seconds: float) -> bool:
    """The rank recorded `kind` at least `seconds` before the run's timeout hit."""
    launch = json.loads((run_dir / "launcher.json").read_text())
    at = float(launch["started"]) + float(launch["timeout"])
    for log in (run_dir / "events").glob("*.jsonl"):
        for line in log.read_text(encoding="utf-8").splitlines():
            event = json.loads(line)
            if event.get("rank") == rank and event.get("kind") == kind:
                return at - float(event["t"]) >= seconds
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_run_is_cleaned_up_ends_the_command_as_interrupted(
    marked, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, sig: int
) -> None:
    """Ctrl-C or SIGTERM arriving while the run is stopped and its temporary files removed was ignored (SIG_IGN
    for the clean-up): ddpdoctor went on to a full report and exit 0. Delivered exactly then (when the launcher
    stops its supervisor), it must end the command as interrupted (exit 2, no report) — after the clean-up, which
    it must not cut short: no process and no temporary folder left."""
    import tempfile

    from ddpdoctor import cli
    from ddpdoctor.probe.supervisor import Supervisor

    env, token, tmp = marked
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(REPO)
    stop = Supervisor.stop
    sent: list[int] = []

    def stop_with_a_signal(self: Supervisor, *args, **kwargs):  # noqa: ANN001, ANN202 - wraps Supervisor.stop
        if self.commands and not sent:  # the run's supervisor (not the guard of the run directory)
            sent.append(sig)
            os.kill(os.getpid(), sig)
        return stop(self, *args, **kwargs)

    monkeypatch.setattr(Supervisor, "stop", stop_with_a_signal)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = cli.main(["check", "fixtures/probe/not_distributed.py", "--quiet", "--timeout", "600"])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    out, err = capsys.readouterr()
    assert sent == [sig]
    assert code == 2 and "interrupted" in err and out == "", (code, err[-2000:])
    assert _wait_gone(env[MARK], token, GONE_S) == []
    assert _wait_until_empty(tmp, GONE_S) == []


def test_a_ddpdoctor_suspended_past_the_timeout_still_reports_the_hang(marked, tmp_path: Path) -> None:
    """Ctrl-Z (SIGSTOP) of ddpdoctor while the ranks hang, resumed after the supervisor's own deadline stopped the
    run: the ranks hung (and ran on, in their own session) for the whole timeout, so the report is the hang —
    DD901, exit 1 — not a clean report with exit 0. Stopped once both ranks have stepped (rank 0 is about to wait
    forever), resumed once every process of the run is gone; a machine too loaded to reach a step within the
    timeout gets a longer one."""
    env, token, _ = marked
    for timeout in (15, 45, 135):
        run = tmp_path / f"run{timeout}"
        proc = subprocess.Popen([sys.executable, "-m", "ddpdoctor", "check", "fixtures/probe/stuck_collective.py",
                                 "--timeout", str(timeout), "--keep-run", str(run), "--format", "json", "--quiet"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while proc.poll() is None and _recorded(run, "optimizer_step") != {0, 1}:
                time.sleep(0.1)
            if proc.poll() is not None:
                proc.communicate()
                continue  # timed out before both ranks stepped: a longer timeout
            proc.send_signal(signal.SIGSTOP)
            # the supervisor's deadline (the timeout + its grace) ends the run while ddpdoctor is stopped
            while [p for p in _carrying(env[MARK], token) if p != proc.pid]:
                time.sleep(0.2)
            proc.send_signal(signal.SIGCONT)
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        rows = (json.loads(out) if out.strip() else {}).get("tables", {}).get("ranks", {}).get("rows", [])
        if timeout != 135 and "stuck" not in {row[2] for row in rows}:
            continue  # the steps came so near the timeout that no rank had waited long enough to be told stuck
        break
    assert proc.returncode == 1, err[-3000:]
    report = json.loads(out)
    assert "DD901" in {f["rule"] for f in report["findings"]}, report["findings"]
    launch = json.loads((run / "launcher.json").read_text())
    assert launch["timed_out"] and launch["supervisor"]["reason"] == "deadline"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_compare_bn_interrupted_while_its_ranks_are_stopped_exits_2(
    marked, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, sig: int
) -> None:
    """compare-bn's clean-up ignored Ctrl-C and SIGTERM the same way (and made its work folder before any guard ran):
    a signal delivered while its ranks are stopped ends the command as interrupted, with nothing left."""
    import tempfile

    from ddpdoctor import cli
    from ddpdoctor.comparebn import compare

    env, token, tmp = marked
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    stop = compare._Ranks.stop
    sent: list[int] = []

    def stop_with_a_signal(self):  # noqa: ANN001, ANN202 - wraps _Ranks.stop
        if not sent:
            sent.append(sig)
            os.kill(os.getpid(), sig)
        return stop(self)

    monkeypatch.setattr(compare._Ranks, "stop", stop_with_a_signal)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = cli.main(["compare-bn", "--steps", "2", "--timeout", "600"])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    out, err = capsys.readouterr()
    assert sent == [sig]
    assert code == 2 and "interrupted" in err and out == "", (code, err[-2000:])
    assert _wait_gone(env[MARK], token, GONE_S) == []
    assert _wait_until_empty(tmp, GONE_S) == []
