"""The user's files are safe: real `ddpdoctor check` runs, in a folder holding the user's checkpoint, of scripts
that save, resume, rotate checkpoints, write in background threads, or write behind the probe's back."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures" / "probe" / "files"
pytestmark = pytest.mark.slow


def tree(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (
            "dir" if p.is_dir() else f"{hashlib.sha256(p.read_bytes()).hexdigest()} {oct(st.st_mode)} {st.st_mtime_ns}"
        )
    return out


def check(folder: Path, script: str, *args: str, env: dict | None = None, alone: bool = False) -> tuple[int, dict]:
    """`ddpdoctor check SCRIPT --format json` from `folder`: in this process (a real 2-rank run, what the user's files
    go through is the run's, not the command's), or as its own `python -m ddpdoctor` process where the test is
    about that process (its environment, or what its working directory puts on its sys.path: `alone`)."""
    command = ["check", script, "--format", "json", "--timeout", "600", *args]
    if env is None and not alone:
        done = run_cli(*command, cwd=folder)
    else:
        done = subprocess.run([sys.executable, "-m", "ddpdoctor", *command], cwd=folder, capture_output=True,
                              text=True, timeout=900, check=False, env=env)
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def steps(report: dict) -> list[int]:
    table = report["tables"]["ranks"]
    return [row[table["columns"].index("steps")] for row in table["rows"]]


def _user_checkpoint(folder: Path, epoch: int) -> None:
    """A checkpoint of the fixture's model, as an earlier run of it left it."""
    import torch
    from torch import nn

    model = nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (folder / "ckpt").mkdir()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
               folder / "ckpt" / "last.pt")
    torch.save({"epoch": epoch - 1}, folder / "ckpt" / f"epoch{epoch - 1}.pt")
    (folder / "train.log").write_text("epoch 0 done\nepoch 1 done\n")


def test_two_checks_in_a_row_leave_the_folder_byte_identical_and_observe_the_same_steps(tmp_path: Path) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(FIXTURES / "auto_resume.py", folder / "train.py")
    _user_checkpoint(folder, epoch=2)
    before = tree(folder)
    _, first = check(folder, "train.py")
    assert tree(folder) == before
    _, second = check(folder, "train.py")
    assert tree(folder) == before
    assert steps(first) == steps(second) == [8, 8]
    for report in (first, second):
        notes = "\n".join(report["notes"])
        assert "resumed from an earlier run" in notes and "ckpt/last.pt" in notes and "epoch=2" in notes
        files = {row[0]: row for row in report["tables"]["files"]["rows"]}
        assert files["ckpt/last.pt"][2] == "yes" and files["train.log"][2] == "yes"
        assert "ckpt/epoch3.pt" in files and "ckpt/last.pt.tmp" in files


def test_a_checkpoint_saved_in_a_background_thread_is_complete_and_the_users_is_untouched(tmp_path: Path) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(FIXTURES / "background_save.py", folder / "train.py")
    (folder / "last.pt").write_bytes(b"the user's 400 MB checkpoint" * 1000)
    before = tree(folder)
    run = tmp_path / "run"
    check(folder, "train.py", "--keep-run", str(run), "--", "48")
    assert tree(folder) == before
    kept = run / "writes" / str(folder).lstrip("/")
    import torch

    saved = torch.load(kept / "last.pt")
    assert saved["weights"].numel() == 48 * (1 << 20) // 4
    assert (kept / "chunks.bin").stat().st_size == 16 << 20
    done = [json.loads(line) for p in (run / "events").glob("*.jsonl") for line in p.read_text().splitlines()
            if '"kind":"done"' in line]
    assert done and all(not d["writes_cut"] for d in done)
    assert any(d["writes_waited"] > 0 for d in done)


def test_a_write_behind_the_probes_back_is_reported(tmp_path: Path) -> None:
    """A program the script runs (not Python) writes into the user's folder directly: the redirection cannot
    see it, the before/after fingerprint does, and the report says so first."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.py").write_text(
        "import subprocess\n"
        "subprocess.run(['sh', '-c', 'echo more >> notes.txt; rm gone.txt; echo new > made.txt'], check=True)\n"
    )
    (folder / "notes.txt").write_text("mine\n")
    (folder / "gone.txt").write_text("mine too\n")
    _, report = check(folder, "train.py")
    warning = report["notes"][0]
    assert warning.startswith("WARNING") and "modified notes.txt" in warning and "deleted gone.txt" in warning
    assert "created made.txt" in warning


def test_no_temporary_files_are_left_behind(tmp_path: Path) -> None:
    """DataLoader workers create multiprocessing's pymp-* folders; torchrun its own; all go with the run. The
    TMPDIR here is long (pytest's): the run's scratch folder inside it must not push multiprocessing's socket paths
    past AF_UNIX's 107 bytes (it did, and the workers hung until the timeout)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    _, report = check(REPO, "fixtures/probe/loader_workers.py", env=env)
    assert steps(report) == [8, 8]
    assert sorted(p.name for p in tmp.iterdir()) == []


def test_every_python_writer_leaves_the_users_files_and_works_as_without_the_probe(tmp_path: Path) -> None:
    """A chdir into a folder the script made (it exists only in the run's copy), then relative paths, os.open
    with O_TRUNC and no O_CREAT (also through a dir_fd), io.FileIO and _io.open, TorchScript's C++ writer, and a
    symlink out of the project, symlinks the script makes out of it (absolute or relative), appends through a hard
    link, fchmod, an sqlite database outside the project: each once changed a user's file or failed where the script
    alone succeeds."""
    folder, outside = tmp_path / "project", tmp_path / "outside"
    (folder / "olddir").mkdir(parents=True)
    outside.mkdir()
    shutil.copy(FIXTURES / "every_writer.py", folder / "train.py")
    for name in ("data.txt", "keep.bin", "log.txt", "dirfd.txt", "old.txt", "target.txt", "gone.txt", "src.txt",
                 "fileio.txt", "underscore.txt", "trunc.txt", "ftrunc.txt", "mode.txt", "jit.pt", "pathlib.txt",
                 "arr.npy", "olddir/inner.txt", "mode2.txt"):
        (folder / name).write_text(f"the user's {name}\n")
    (folder / "mm.bin").write_bytes(bytes(16))
    (outside / "outside.txt").write_text("outside\n")
    (outside / "outfile").write_text("outfile\n")
    import torch

    torch.save({"epoch": 1}, outside / "ckpt.pt")
    with sqlite3.connect(outside / "runs.db") as con:
        con.execute("create table t (x)")
    con.close()
    (folder / "outlink").symlink_to(outside)
    (folder / "outfile").symlink_to(outside / "outfile")
    before = tree(folder), tree(outside)
    run = tmp_path / "run"
    code, report = check(folder, "train.py", "--keep-run", str(run))
    assert (tree(folder), tree(outside)) == before
    assert "FAILED []" in (run / "logs" / "rank0.stdout").read_text()
    assert not any(n.startswith("WARNING") for n in report["notes"]), report["notes"]
    assert steps(report) == [8, 8]
    copy = run / "writes" / str(folder).lstrip("/")
    assert (copy / "data.txt").read_text() == "the user's data.txt\nAPPENDEDH"  # H: through the hard link
    assert (copy / "keep.bin").read_bytes() == b"X" and (copy / "dirfd.txt").read_bytes() == b"X"
    assert (copy / "made" / "deeper" / "rel.txt").read_text() == "new"
    assert (copy / "mm.bin").read_bytes()[0] == 99 and (copy / "fileio.txt").read_bytes() == b"Z"
    assert (copy / "outlink" / "outside.txt").read_text() == "CLOBBER"
    assert (copy / "hard.txt").read_text() == (copy / "data.txt").read_text() == "the user's data.txt\nAPPENDEDH"
    assert (copy / "mode2.txt").stat().st_mode & 0o777 == 0
    assert torch.load(run / "writes" / str(outside).lstrip("/") / "ckpt.pt") == {"epoch": 9}
    assert torch_jit_loads(copy / "jit.pt")


def torch_jit_loads(path: Path) -> bool:
    import torch

    return torch.jit.load(str(path)) is not None


def test_log_files_kept_open_for_the_whole_run_are_not_waited_for_and_reach_the_runs_copy(tmp_path: Path) -> None:
    """A logging.FileHandler and a metrics file opened by the main thread and never closed: the ranks leave as soon
    as the probe has its steps (they waited for those files until the timeout: 110 s of a 117 s minGPT probe), and
    the run's copies hold every line written before the last step (os._exit would drop Python's buffer)."""
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(FIXTURES / "open_log.py", folder / "train.py")
    run = tmp_path / "run"
    _, report = check(folder, "train.py", "--keep-run", str(run), "--epochs", "2", "--steps", "3")
    assert steps(report) == [6, 6]
    done = [json.loads(line) for p in (run / "events").glob("*.jsonl") for line in p.read_text().splitlines()
            if '"kind":"done"' in line]
    assert len(done) == 2 and all(d["writes_waited"] < 5 and not d["writes_cut"] for d in done), done
    kept = run / "writes" / str(folder).lstrip("/")
    for rank in (0, 1):
        lines = (kept / f"metrics{rank}.txt").read_text().splitlines()
        assert [line.split()[1] for line in lines] == [str(i) for i in range(1, 7)], lines
        assert "step 6" in (kept / f"train{rank}.log").read_text()
    assert sorted(p.name for p in folder.iterdir()) == ["train.py"]


HOSTILE = "raise SystemExit('a module of the project was imported by ddpdoctor: {name}')\n"
TRAIN = """import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
model = DDP(nn.Linear(8, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
sampler = DistributedSampler(data)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data, batch_size=4, sampler=sampler):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
"""


def test_modules_of_the_users_working_directory_are_never_imported_by_ddpdoctor(tmp_path: Path) -> None:
    """`types.py`, `tokenize.py`, `random.py` in the folder ddpdoctor runs from (`python -m ddpdoctor`, whose
    processes — the CLI, the supervisor, torchrun's agent, the ranks' bootstrap — all start there): torchrun runs
    the script in sub/ from there, so must ddpdoctor. Beside the script, a `types.py` is what torchrun tolerates
    (the interpreter has the standard one before the script's folder is on sys.path): the probe too."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text(TRAIN)
    for name in ("types", "tokenize", "random"):
        (tmp_path / f"{name}.py").write_text(HOSTILE.format(name=name))
    (tmp_path / "sub" / "types.py").write_text(HOSTILE.format(name="types beside the script"))
    helped = subprocess.run([sys.executable, "-m", "ddpdoctor", "--help"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, check=False)
    assert helped.returncode == 0, helped.stderr
    code, report = check(tmp_path, "sub/train.py", alone=True)
    assert steps(report) == [8, 8], report
    assert not any(f["rule"] in ("DD902", "DD904") for f in report["findings"])


def test_two_checks_in_one_folder_do_not_blame_each_others_scripts(tmp_path: Path) -> None:
    """`ddpdoctor check a.py -o a.json > a.txt` and the same for b.py, in one folder, at the same time: each one's
    report, stdout, stderr and --keep-run folder appear or grow while the other one's probe runs, and are not the
    other script's writes. A waits (its script, before training) until B has ended: B's files appear in A's probe."""
    folder, control = tmp_path / "project", tmp_path / "control"
    folder.mkdir()
    control.mkdir()
    release = control / "release"
    waiting = (f"import os, time\nopen('waiting', 'w').close()\n"
               f"while not os.path.exists({str(release)!r}):\n    time.sleep(0.05)\n")
    (folder / "a.py").write_text(waiting + TRAIN)
    (folder / "b.py").write_text(TRAIN)

    def start(name: str, timeout: str) -> subprocess.Popen:
        with open(folder / f"{name}.txt", "wb") as out, open(folder / f"{name}.err", "wb") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "ddpdoctor", "check", f"{name}.py", "--format", "json", "-o", f"{name}.json",
                 "--keep-run", f"run_{name}", "--timeout", timeout], cwd=folder, stdout=out, stderr=err)

    first = start("a", "400")
    try:
        marker = folder / "run_a" / "writes" / str(folder / "waiting").lstrip("/")
        deadline = time.monotonic() + 300
        while not marker.exists():  # A's probe is under way: its script waits
            assert first.poll() is None and time.monotonic() < deadline, (folder / "a.err").read_text()
            time.sleep(0.1)
        second = start("b", "300")
        assert second.wait(timeout=400) == 0 or (folder / "b.json").exists(), (folder / "b.err").read_text()
    finally:
        release.touch()
        first.wait(timeout=400)
    for name in ("a", "b"):
        report = json.loads((folder / f"{name}.json").read_text())
        assert steps(report) == [8, 8]
        assert not any(n.startswith("WARNING") for n in report["notes"]), (name, report["notes"])
