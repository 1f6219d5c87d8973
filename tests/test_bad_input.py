"""Bad input is one line and exit 2, and never costs the user a file: the adversarial cases of issue 9 that need no
probe run (options, output paths, run directories, source files, attach mode), as real `ddpdoctor` processes on
real files in a temporary directory."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "fixtures" / "demo" / "train.py"
RUN = REPO / "fixtures" / "runs" / "bn_iid_default"


_STREAMS = {"-", "/dev/stdout", "/dev/stderr"}


def ddpdoctor(*args: str, cwd: Path | None = None, timeout: float = 120, env: dict | None = None):
    """`ddpdoctor ARGS`: in this process (conftest's run_cli) unless the case needs a process of its own: another
    environment, or a report written to the process's own standard streams."""
    if env is None and not _STREAMS & set(args):
        return run_cli(*args, cwd=cwd)
    return subprocess.run([sys.executable, "-m", "ddpdoctor", *args], cwd=cwd or REPO, capture_output=True, text=True,
                          timeout=timeout, check=False, env=env)


def one_line_error(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert needle in lines[0], lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(folder.rglob("*"))}


# ------------------------------------------------------------------ --keep-run (issue 9 item 2) and locking (item 8)


def test_keep_run_never_clears_a_folder_that_is_not_a_run_directory(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "logs").mkdir(parents=True)
    (project / "logs" / "train.log").write_text("a week of training\n")
    (project / "events").mkdir()
    (project / "meta.json").write_text('{"schema": "ddpdoctor.events/1", "experiment": "mine"}')
    before = snapshot(project)
    one_line_error(ddpdoctor("check", str(DEMO), "--keep-run", str(project)), "not a ddpdoctor run directory")
    assert snapshot(project) == before


def test_a_run_directory_in_use_is_refused_not_cleared(tmp_path: Path) -> None:
    from ddpdoctor.probe.rundir import claim_for_check

    run = tmp_path / "run"
    with claim_for_check(run):  # another check is writing into it
        (run / "events" / "theirs.jsonl").write_text("{}\n")
        done = ddpdoctor("check", str(DEMO), "--keep-run", str(run))
        one_line_error(done, "in use by another ddpdoctor run")
        assert (run / "events" / "theirs.jsonl").exists()


def test_two_attach_jobs_cannot_share_an_out_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = tmp_path / "job.py"
    script.write_text("print('hello')\n")
    first = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
             "TORCHELASTIC_RUN_ID": "job-a"}
    done = subprocess.run([sys.executable, "-m", "ddpdoctor.probe", "--out", str(out), str(script)], env=first,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    second = {**first, "TORCHELASTIC_RUN_ID": "job-b"}
    done = subprocess.run([sys.executable, "-m", "ddpdoctor.probe", "--out", str(out), str(script)], env=second,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "holds the run of another job" in done.stderr and "hello" not in done.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--out", "{file}"], "exists and is not a directory"),
        (["--out", "{dir}", "--epochs", "-1"], "--epochs"),
        (["--out", "{dir}", "--timeout", "nan"], "--timeout"),
    ],
)
def test_attach_bad_options_are_refused_before_the_script_runs(tmp_path: Path, args: list[str], needle: str) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    (tmp_path / "a_file").write_text("mine")
    argv = [a.format(file=tmp_path / "a_file", dir=tmp_path / "out") for a in args]
    done = subprocess.run([sys.executable, "-m", "ddpdoctor.probe", *argv, str(script)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2 and needle in done.stderr and "Traceback" not in done.stderr
    assert "ran" not in done.stdout and (tmp_path / "a_file").read_text() == "mine"


# ------------------------------------------------------------------ --output (item 3)


def test_output_never_overwrites_the_script_or_a_run_file(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    shutil.copy(DEMO, script)
    link = tmp_path / "report.txt"
    link.symlink_to(script)
    original = script.read_bytes()
    for target in (str(script), str(tmp_path / ".." / tmp_path.name / "t.py"), str(link)):
        one_line_error(ddpdoctor("check", str(script), "--static", "--output", target), "the script being analysed")
    assert script.read_bytes() == original
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    meta = (run / "meta.json").read_bytes()
    one_line_error(ddpdoctor("report", str(run), "--output", str(run / "meta.json")), "inside the run directory")
    assert (run / "meta.json").read_bytes() == meta


def test_output_is_written_whole_and_keeps_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real.txt"
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "report.txt"
    link.symlink_to(real)
    done = ddpdoctor("check", str(DEMO), "--static", "--output", str(link))
    assert done.returncode in (0, 1) and done.stdout == ""
    assert link.is_symlink() and real.read_text().startswith("ddpdoctor") and stat.S_IMODE(real.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# ------------------------------------------------------------------ numbers (item 10)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--base-lr", "0.1", "--base-batch", "-8"], "--base-batch -8"),
        (["--base-lr", "0.1", "--base-batch", "0"], "--base-batch 0"),
        (["--base-lr", "nan", "--base-batch", "32"], "--base-lr nan"),
        (["--base-lr", "inf", "--base-batch", "32"], "--base-lr inf"),
        (["--base-lr", "-0.1", "--base-batch", "32"], "--base-lr -0.1"),
        (["--nproc", "1000"], "--nproc 1000"),
        (["--nproc", "0"], "--nproc 0"),
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "inf"], "--timeout"),
    ],
)
def test_bad_numbers_are_refused(args: list[str], needle: str) -> None:
    one_line_error(ddpdoctor("check", str(DEMO), *args), needle)


@pytest.mark.parametrize(
    ("line", "needle"),
    [("nproc = 1e9", "nproc must be an integer"), ("nproc = 2.5", "nproc must be an integer"),
     ("nproc = 100000", "--nproc 100000"), ("base_batch = true", "base_batch must be an integer"),
     ("base_lr = 'fast'", "base_lr must be a number")],
)
def test_bad_numbers_in_pyproject_are_refused(tmp_path: Path, line: str, needle: str) -> None:
    shutil.copy(DEMO, tmp_path / "train.py")
    (tmp_path / "pyproject.toml").write_text(f"[tool.ddpdoctor]\n{line}\n")
    one_line_error(ddpdoctor("check", "train.py", cwd=tmp_path), needle)


def test_report_refuses_a_negative_recipe() -> None:
    one_line_error(ddpdoctor("report", str(RUN), "--base-lr", "0.1", "--base-batch", "-8"), "--base-batch -8")


# ------------------------------------------------------------------ damaged run directories (item 12)


def test_a_run_without_one_readable_event_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    for log in (run / "events").glob("*.jsonl"):
        log.write_bytes(b"\x00garbage\n{not json\n")
    one_line_error(ddpdoctor("report", str(run)), "not one readable event")


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_side_file_is_refused_not_silently_dropped(tmp_path: Path, damage: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    blob = min((run / "events").glob("*.bin"))
    if damage == "missing":
        blob.unlink()
    else:
        blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    one_line_error(ddpdoctor("report", str(run)), damage)


def test_a_run_directory_with_no_events_is_not_a_clean_report(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "meta.json").write_text((RUN / "meta.json").read_text())
    (run / "events").mkdir()
    done = ddpdoctor("report", str(run), "--format", "json")
    assert done.returncode == 1, done.stderr
    assert [f["rule"] for f in json.loads(done.stdout)["findings"]] == ["DD904"]


# ------------------------------------------------------------------ source files (items 13-15)


def test_a_latin1_script_is_read_as_python_reads_it(tmp_path: Path) -> None:
    script = tmp_path / "legacy.py"
    script.write_bytes(b"# -*- coding: latin-1 -*-\n" + DEMO.read_bytes().replace(b"import", b"import", 1)
                       + b"\nAUTHOR = '\xe9l\xe8ve'\n")
    done = ddpdoctor("check", str(script), "--static", "--format", "json")
    assert done.returncode in (0, 1) and json.loads(done.stdout)["findings"], done.stderr


def test_a_notebook_is_refused(tmp_path: Path) -> None:
    nb = tmp_path / "train.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "source": ["import torch\n"]}], "metadata": {},
                              "nbformat": 4, "nbformat_minor": 5}))
    one_line_error(ddpdoctor("check", str(nb), "--static"), "Jupyter notebook")
    one_line_error(ddpdoctor("check", str(nb)), "Jupyter notebook")
    renamed = tmp_path / "train.py"
    renamed.write_text(nb.read_text())
    one_line_error(ddpdoctor("check", str(renamed), "--static"), "Jupyter notebook")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX")
def test_files_whose_read_would_block_are_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "train.py"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    one_line_error(ddpdoctor("check", str(fifo), "--static", timeout=30), "not a regular file")
    if Path("/proc/kmsg").exists():
        one_line_error(ddpdoctor("check", "/proc/kmsg", "--static", timeout=30), "pseudo-file")
    one_line_error(ddpdoctor("check", "/dev/zero", "--static", timeout=30), "not a regular file")
    assert time.monotonic() - t0 < 60


def test_a_huge_script_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    big = tmp_path / "generated.py"
    big.write_bytes(DEMO.read_bytes() * (10_000_000 // len(DEMO.read_bytes())))
    t0 = time.monotonic()
    one_line_error(ddpdoctor("check", str(big), "--static"), "larger than")
    assert time.monotonic() - t0 < 30


def test_report_refuses_a_run_directory_a_live_run_still_writes_into(tmp_path: Path) -> None:
    """`report` on a `--keep-run` directory mid-run analysed a run cut at an arbitrary moment as if it were whole
    (exit 0/1 with the steps seen so far). The writer's lock says it is not finished; a killed one holds none."""
    from ddpdoctor.probe.rundir import claim_folder

    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    (run / ".ddpdoctor-run").write_text("{}")
    writer = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from ddpdoctor.probe.rundir import claim_for_check;"
                               " c = claim_for_check(__import__('pathlib').Path(sys.argv[1]));"
                               " print('locked', flush=True); time.sleep(120)", str(tmp_path / "live")],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "locked"
        shutil.copytree(RUN / "events", tmp_path / "live" / "events", dirs_exist_ok=True)
        shutil.copy(RUN / "meta.json", tmp_path / "live" / "meta.json")
        one_line_error(ddpdoctor("report", str(tmp_path / "live")), "still writing into it")
    finally:
        writer.kill()
        writer.wait()
    assert ddpdoctor("report", str(tmp_path / "live")).returncode in (0, 1)  # the writer is gone: no lock
    with claim_folder(run, "--keep-run", "a triage writing into it"):
        one_line_error(ddpdoctor("report", str(run)), "still writing into it")
    assert ddpdoctor("report", str(run)).returncode in (0, 1)


def test_a_triage_directory_in_use_is_refused_not_cleared(tmp_path: Path) -> None:
    """A second `triage --keep-run D` removed the first's arm-* folders mid-run."""
    from ddpdoctor.probe.rundir import claim_folder

    base = tmp_path / "triage"
    with claim_folder(base, "--keep-run", "a triage writing into it"):
        (base / "arm-A").mkdir()
        (base / "arm-A" / "theirs.jsonl").write_text("{}\n")
        one_line_error(ddpdoctor("triage", str(DEMO), "--keep-run", str(base)), "in use by another ddpdoctor run")
        assert (base / "arm-A" / "theirs.jsonl").exists()


# ------------------------------------------------------------------ issue 19: where the report goes


def _is_char_device(path: str) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)


def test_output_to_a_character_device_is_written_in_place(tmp_path: Path) -> None:
    """As root (every container) the atomic replace turned /dev/null into a regular file. Tried first on a device
    node of our own (a /dev/null twin), and on the real /dev/null only once the twin survived: a regression fails
    here without harming the machine."""
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError:
        node = None  # not root, or no CAP_MKNOD: then the replace cannot happen in /dev either
    if node is not None:
        done = ddpdoctor("check", str(DEMO), "--static", "--output", str(node))
        assert done.returncode == 1, done.stderr
        assert _is_char_device(str(node)) and os.stat(node).st_rdev == os.makedev(1, 3)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]  # no temporary file left beside it
    assert _is_char_device("/dev/null"), "/dev/null was no device before this test: something else replaced it"
    done = ddpdoctor("check", str(DEMO), "--static", "--output", "/dev/null")
    assert done.returncode == 1 and done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    assert _is_char_device("/dev/null")


def test_output_to_a_fifo_feeds_its_reader_and_stays_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb')"
                               ".read())", str(fifo)], stdout=subprocess.PIPE)
    try:
        done = ddpdoctor("check", str(DEMO), "--static", "--output", str(fifo))
        received, _ = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert received.decode().startswith("ddpdoctor ") and "DD104" in received.decode()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_output_to_a_unix_socket_is_sent_to_its_listener(tmp_path: Path) -> None:
    import socket
    import threading

    path = tmp_path / "report.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    got: list[bytes] = []

    def accept() -> None:
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(65536):
                got.append(chunk)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        done = ddpdoctor("check", str(DEMO), "--static", "--output", str(path))
        thread.join(timeout=60)
    finally:
        server.close()
    assert done.returncode == 1, done.stderr
    assert b"".join(got).decode().startswith("ddpdoctor ") and stat.S_ISSOCK(os.lstat(path).st_mode)


@pytest.mark.parametrize("target", ["/dev/stdout", "-"])
def test_output_to_stdout_by_name_reaches_a_pipe(tmp_path: Path, target: str) -> None:
    """`-o /dev/stdout | cat` exited 2 (a temporary file in /proc/PID/fd); `-o -` wrote a file named "-"."""
    done = ddpdoctor("check", str(DEMO), "--static", "-o", target, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("ddpdoctor ") and "DD104" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_output_to_dev_stderr_and_stdout_appended_to_a_file(tmp_path: Path) -> None:
    done = ddpdoctor("check", str(DEMO), "--static", "-o", "/dev/stderr")
    assert done.returncode == 1 and done.stdout == "" and done.stderr.startswith("ddpdoctor "), done.stderr
    log = tmp_path / "log.txt"
    log.write_text("earlier line\n")
    with log.open("a") as fh:  # `>> log.txt`: the report goes after what was there, the file stays the same one
        inode = os.fstat(fh.fileno()).st_ino
        done = subprocess.run([sys.executable, "-m", "ddpdoctor", "check", str(DEMO), "--static", "-o",
                               "/dev/stdout"], cwd=REPO, stdout=fh, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert log.read_text().startswith("earlier line\nddpdoctor ") and log.stat().st_ino == inode


# ------------------------------------------------------------------ issue 19: every command's --output guards


def test_triage_output_never_overwrites_the_script_or_its_keep_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    shutil.copy(DEMO, script)
    original = script.read_bytes()
    one_line_error(ddpdoctor("triage", str(script), "--output", str(script), timeout=600), "the script being analysed")
    assert script.read_bytes() == original
    keep = tmp_path / "keep"
    one_line_error(ddpdoctor("triage", str(script), "--keep-run", str(keep), "--output", str(keep / "r.txt"),
                             timeout=600), "inside the run directory")
    assert not (keep / "arm-A").exists()  # refused before any arm ran


@pytest.mark.parametrize("form", ["path", "module"])
def test_compare_bn_output_never_overwrites_the_model_file(tmp_path: Path, form: str) -> None:
    model = tmp_path / "mymodel.py"
    model.write_text("import torch\n\ndef make():\n    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), "
                     "torch.nn.BatchNorm2d(4))\n")
    original = model.read_bytes()
    spec = f"{model}:make" if form == "path" else "mymodel:make"
    done = ddpdoctor("compare-bn", "--model", spec, "--output", "mymodel.py", cwd=tmp_path, timeout=600)
    one_line_error(done, "the --model module")
    assert model.read_bytes() == original


# ------------------------------------------------------------------ issue 19: numbers refused everywhere, first


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["compare-bn", "--nproc", "65"], "--nproc 65"),
        (["compare-bn", "--timeout", "nan"], "--timeout nan"),
        (["compare-bn", "--timeout", "1e300"], "--timeout"),
        (["compare-bn", "--seed", "-1"], "--seed -1"),
        (["compare-bn", "--seed", str(2**64)], "--seed"),
        (["triage", str(DEMO), "--timeout", "nan"], "--timeout nan"),
        (["triage", str(DEMO), "--timeout", "inf"], "--timeout inf"),
        (["triage", str(DEMO), "--timeout", "1e300"], "--timeout"),
        (["triage", str(DEMO), "--nproc", "65"], "--nproc 65"),
        (["check", str(DEMO), "--ignore", "XX1"], "unknown rule"),
    ],
)
def test_numbers_check_refuses_are_refused_by_every_command_before_it_runs(args: list[str], needle: str) -> None:
    """compare-bn took 65 ranks, triage a timeout of nan/inf/1e300 (every arm without a limit) and checked
    --select only after all its arms had run."""
    one_line_error(ddpdoctor(*args, timeout=600), needle)


def test_triage_refuses_an_unknown_rule_before_any_arm_runs(tmp_path: Path) -> None:
    keep = tmp_path / "keep"
    one_line_error(ddpdoctor("triage", str(DEMO), "--select", "DD9999", "--keep-run", str(keep), timeout=600),
                   "unknown rule")
    assert not keep.exists() or not list(keep.glob("arm-*"))  # it used to run every arm first


@pytest.mark.parametrize("command", ["report", "triage"])
def test_small_bn_batch_zero_in_pyproject_is_refused(tmp_path: Path, command: str) -> None:
    shutil.copy(DEMO, tmp_path / "train.py")
    (tmp_path / "pyproject.toml").write_text("[tool.ddpdoctor]\nsmall_bn_batch = 0\n")
    target = "train.py"
    if command == "report":  # a recorded run of that script: report reads the table beside it
        shutil.copytree(RUN, tmp_path / "run")
        meta = json.loads((tmp_path / "run" / "meta.json").read_text())
        meta["script_abs"] = str(tmp_path / "train.py")
        (tmp_path / "run" / "meta.json").write_text(json.dumps(meta))
        target = "run"
    one_line_error(ddpdoctor(command, target, cwd=tmp_path, timeout=600), "small_bn_batch 0")


# ------------------------------------------------------------------ issue 19: closed stdout / stderr


def _closed(redirect: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", f'exec "$0" -m ddpdoctor "$@" {redirect}', sys.executable, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_closed_stdout_or_stderr_is_no_traceback() -> None:
    done = _closed(">&-", "check", "missing.py")
    one_line_error(done, "missing.py: no such file")
    done = _closed("2>&-", "check", "missing.py")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    done = _closed(">&-", "check", str(DEMO), "--static")
    assert done.returncode == 1 and done.stderr == "", done.stderr  # the report had nowhere to go; no crash


# ------------------------------------------------------------------ issue 19: report reads only regular files


def test_report_of_a_parent_refuses_an_attach_run_still_being_written(tmp_path: Path) -> None:
    """`report RUN` refused a live run, `report PARENT` (per-node directories) analysed it cut short."""
    parent = tmp_path / "run"
    node = parent / "node0"
    writer = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from pathlib import Path; from ddpdoctor.probe.rundir import "
                               "claim_for_attach; c = claim_for_attach(Path(sys.argv[1]), 'host');"
                               " print('locked', flush=True); time.sleep(120)", str(node)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "locked"
        shutil.copytree(RUN, node, dirs_exist_ok=True)  # what the job has written so far
        one_line_error(ddpdoctor("report", str(parent)), "still writing into it")
    finally:
        writer.kill()
        writer.wait()
    assert ddpdoctor("report", str(parent)).returncode in (0, 1)


@pytest.mark.parametrize("kind", ["fifo", "zero", "blob-fifo", "log-zero", "events-link"])
def test_report_refuses_event_logs_and_side_files_that_are_not_files(tmp_path: Path, kind: str) -> None:
    """An event log that is a FIFO hung `report`; one linked to /dev/zero grew its memory without end."""
    import resource

    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    needle = "not a file a run writes"
    log = min((run / "events").glob("*.jsonl"))
    if kind == "fifo":
        os.mkfifo(run / "events" / "other-p1.jsonl")
    elif kind == "zero":
        log.unlink()
        log.symlink_to("/dev/zero")
    elif kind == "blob-fifo":
        blob = min((run / "events").glob("*.bin"))
        blob.unlink()
        os.mkfifo(blob)
    elif kind == "events-link":
        shutil.rmtree(run / "events")
        (run / "events").symlink_to("/dev")
        needle = "not a folder a run writes"
    else:
        (run / "logs" / "rank0.stderr").unlink()
        (run / "logs" / "rank0.stderr").symlink_to("/dev/zero")

    def limit_memory() -> None:  # a regression must fail this test, not exhaust the machine
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run([sys.executable, "-m", "ddpdoctor", "report", str(run)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False, preexec_fn=limit_memory)
    one_line_error(done, needle)


def test_keep_run_never_replaces_a_fifo_under_a_name_the_run_writes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / ".ddpdoctor-run").write_text("{}")
    os.mkfifo(run / "meta.json")
    one_line_error(ddpdoctor("check", str(DEMO), "--keep-run", str(run)), "never replaces one")
    assert stat.S_ISFIFO(os.lstat(run / "meta.json").st_mode)


def test_triage_keep_run_never_removes_a_fifo_under_a_name_it_writes(tmp_path: Path) -> None:
    base = tmp_path / "triage"
    base.mkdir()
    (base / ".ddpdoctor-run").write_text("{}")
    os.mkfifo(base / "triage.json")
    one_line_error(ddpdoctor("triage", str(DEMO), "--keep-run", str(base), timeout=600), "never replaces one")
    assert stat.S_ISFIFO(os.lstat(base / "triage.json").st_mode) and not list(base.glob("arm-*"))
