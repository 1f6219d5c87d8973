"""The run's view of the file system (ddpdoctor.probe.fsview), in real processes on real files: every write the
script makes lands in RUN/writes, reads see it, and the user's folder is byte-identical afterwards.

Each scenario runs in a fresh interpreter (the view patches builtins and os for the whole process), from a user
folder holding files that must not change.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PRELUDE = """
import glob, json, os, pathlib, shutil, sys
sys.path.insert(0, {repo!r})
from ddpdoctor.probe import fsview
EVENTS = []
fsview.install({run!r}, None, EVENTS.append)
os.chdir({user!r})
OUT = {{}}
"""


def tree(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` with a hash of its bytes and its mode: what must not change."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (
            f"dir {oct(st.st_mode)}" if p.is_dir() else f"{hashlib.sha256(p.read_bytes()).hexdigest()} "
            f"{oct(st.st_mode)} {st.st_mtime_ns}"
        )
    return out


@pytest.fixture
def folder(tmp_path: Path):
    user, run = tmp_path / "user", tmp_path / "run"
    (user / "ckpt").mkdir(parents=True)
    (user / "ckpt" / "last.pt").write_bytes(b"the user's checkpoint")
    (user / "ckpt" / "epoch1.pt").write_bytes(b"epoch 1")
    (user / "train.log").write_text("earlier run\n")
    (user / "data").mkdir()
    (user / "data" / "a.txt").write_text("a")
    run.mkdir()
    before = tree(user)
    yield user, run
    assert tree(user) == before, "the user's folder changed"


def scenario(user: Path, run: Path, body: str) -> dict:
    code = PRELUDE.format(repo=str(REPO), run=str(run), user=str(user)) + textwrap.dedent(body) + (
        "\nOUT['events'] = [[e['op'], e['path'], e['existed']] for e in EVENTS]\nprint(json.dumps(OUT))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_save_then_reload_and_the_resume_checks_a_script_makes(folder) -> None:
    user, run = folder
    out = scenario(user, run, """
        with open("ckpt/last.pt", "wb") as f:
            f.write(b"new")
        OUT["read"] = open("ckpt/last.pt", "rb").read().decode()
        OUT["exists"] = [os.path.exists("ckpt/last.pt"), os.path.isfile("ckpt/last.pt"), os.path.isdir("ckpt")]
        OUT["size"] = os.path.getsize("ckpt/last.pt")
        pathlib.Path("ckpt/epoch2.pt").write_bytes(b"2")
        OUT["glob"] = sorted(glob.glob("ckpt/epoch*.pt"))
        OUT["listdir"] = sorted(os.listdir("ckpt"))
        OUT["iterdir"] = sorted(p.name for p in pathlib.Path("ckpt").iterdir())
        OUT["walk"] = sorted((d, sorted(f)) for d, _, f in os.walk("ckpt"))
    """)
    assert out["read"] == "new" and out["exists"] == [True, True, True] and out["size"] == 3
    assert out["glob"] == ["ckpt/epoch1.pt", "ckpt/epoch2.pt"]
    assert out["listdir"] == out["iterdir"] == ["epoch1.pt", "epoch2.pt", "last.pt"]
    assert out["walk"] == [["ckpt", ["epoch1.pt", "epoch2.pt", "last.pt"]]]
    assert ["write", "ckpt/last.pt", True] in out["events"] and ["write", "ckpt/epoch2.pt", False] in out["events"]
    assert (run / "writes" / str(user / "ckpt/last.pt").lstrip("/")).read_bytes() == b"new"


def test_deleting_and_rotating_the_users_files_only_hides_them(folder) -> None:
    user, run = folder
    out = scenario(user, run, """
        os.remove("ckpt/epoch1.pt")
        OUT["after_remove"] = [os.path.exists("ckpt/epoch1.pt"), sorted(os.listdir("ckpt"))]
        try:
            open("ckpt/epoch1.pt")
        except FileNotFoundError:
            OUT["read_deleted"] = "FileNotFoundError"
        shutil.rmtree("data")
        OUT["rmtree"] = os.path.exists("data/a.txt") or os.path.exists("data")
        os.makedirs("data")
        OUT["recreated"] = os.listdir("data")
        pathlib.Path("data/b.txt").write_text("b")
        OUT["recreated_after_write"] = sorted(os.listdir("data"))
    """)
    assert out["after_remove"] == [False, ["last.pt"]] and out["read_deleted"] == "FileNotFoundError"
    assert out["rmtree"] is False
    assert out["recreated"] == [] and out["recreated_after_write"] == ["b.txt"]
    assert ["delete", "ckpt/epoch1.pt", True] in out["events"]


def test_modifying_the_users_files_copies_them_first(folder) -> None:
    user, run = folder
    out = scenario(user, run, """
        with open("train.log", "a") as f:
            f.write("probe run\\n")
        OUT["log"] = open("train.log").read()
        with open("ckpt/last.pt", "r+b") as f:
            f.write(b"THE")
        OUT["rplus"] = open("ckpt/last.pt", "rb").read().decode()
        os.chmod("train.log", 0o600)
        pathlib.Path("ckpt/epoch1.pt").touch()
        os.truncate("ckpt/epoch1.pt", 2)
        OUT["truncated"] = open("ckpt/epoch1.pt", "rb").read().decode()
        shutil.copy2("ckpt/last.pt", "data/copy.pt")
        OUT["copy"] = open("data/copy.pt", "rb").read().decode()
        with open("ckpt/tmp", "wb") as f:
            f.write(b"atomic")
        os.replace("ckpt/tmp", "ckpt/last.pt")
        OUT["replaced"] = [open("ckpt/last.pt", "rb").read().decode(), os.path.exists("ckpt/tmp")]
        shutil.move("data", "moved")
        OUT["moved"] = [os.path.exists("data"), sorted(os.listdir("moved"))]
    """)
    assert out["log"] == "earlier run\nprobe run\n"
    assert out["rplus"] == "THE user's checkpoint"
    assert out["truncated"] == "ep" and out["copy"] == "THE user's checkpoint"
    assert out["replaced"] == ["atomic", False]
    assert out["moved"] == [False, ["a.txt", "copy.pt"]]


def test_errors_are_the_ones_the_real_calls_raise(folder) -> None:
    user, run = folder
    out = scenario(user, run, """
        for name, call in [
            ("x_on_existing", lambda: open("train.log", "x")),
            ("missing_parent", lambda: open("nope/f.txt", "w")),
            ("mkdir_existing", lambda: os.mkdir("ckpt")),
            ("rmdir_not_empty", lambda: os.rmdir("ckpt")),
            ("remove_missing", lambda: os.remove("missing.txt")),
            ("unlink_dir", lambda: os.unlink("ckpt")),
        ]:
            try:
                call()
                OUT[name] = "no error"
            except OSError as exc:
                OUT[name] = type(exc).__name__
    """)
    assert out == {**out, "x_on_existing": "FileExistsError", "missing_parent": "FileNotFoundError",
                   "mkdir_existing": "FileExistsError", "rmdir_not_empty": "OSError",
                   "remove_missing": "FileNotFoundError", "unlink_dir": "IsADirectoryError"}


def test_a_child_process_started_by_the_script_shares_the_view(folder) -> None:
    """What one process of the run wrote, another reads (the view is files, not process memory)."""
    user, run = folder
    out = scenario(user, run, f"""
        with open("ckpt/last.pt", "wb") as f:
            f.write(b"from the parent")
        import subprocess
        child = {PRELUDE!r}.format(repo={str(REPO)!r}, run={str(run)!r}, user={str(user)!r})
        child += "print(open('ckpt/last.pt', 'rb').read().decode(), os.path.exists('ckpt/epoch1.pt'))"
        os.remove("ckpt/epoch1.pt")
        OUT["child"] = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip()
    """)
    assert out["child"] == "from the parent False"


def test_paths_inside_the_run_directory_are_real(folder) -> None:
    user, run = folder
    scenario(user, run, f"""
        with open({str(run / 'note.txt')!r}, "w") as f:
            f.write("real")
    """)
    assert (run / "note.txt").read_text() == "real"
    assert not (run / "writes").exists()


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="POSIX")
def test_writes_in_flight_are_seen(folder) -> None:
    user, run = folder
    out = scenario(user, run, """
        f = open("big.bin", "wb")
        OUT["open"] = [os.path.basename(p) for p in fsview.in_flight()]
        f.close()
        OUT["closed"] = fsview.in_flight()
    """)
    assert out["open"] == ["big.bin"] and out["closed"] == []


def test_links_the_script_makes_never_lead_a_write_to_the_users_files(folder) -> None:
    """A symlink the script makes to a folder outside the project (absolute or relative), to a file of the
    project, a hard link to the user's file: each works as without the probe (reads see the user's files, writes
    are seen through every name), and no write through them reaches a file the user had, here or outside."""
    user, run = folder
    outside = user.parent / "outside"
    outside.mkdir()
    (outside / "ckpt.pt").write_bytes(b"the user's other checkpoint")
    before = tree(outside)
    out = scenario(user, run, """
        os.symlink(os.path.abspath("../outside"), "abs")
        os.symlink("../outside", "rel")
        os.symlink("ckpt/last.pt", "latest.pt")
        OUT["read"] = [open(n, "rb").read().decode() for n in ("abs/ckpt.pt", "rel/ckpt.pt", "latest.pt")]
        OUT["readlink"] = [os.readlink("rel"), os.path.realpath("rel") == os.path.abspath("../outside"),
                           os.path.islink("rel"), os.path.isdir("rel"), sorted(os.listdir("rel"))]
        OUT["listed"] = sorted(glob.glob("*/")) + sorted(e.name for e in os.scandir(".") if e.is_file())
        with open("abs/ckpt.pt", "wb") as f:
            f.write(b"saved through abs")
        OUT["through_rel"] = open("rel/ckpt.pt", "rb").read().decode()
        with open("rel/new.pt", "wb") as f:
            f.write(b"new")
        with open("latest.pt", "ab") as f:
            f.write(b" appended")
        OUT["latest"] = open("ckpt/last.pt", "rb").read().decode()
        os.link("train.log", "hard.log")
        with open("hard.log", "a") as f:
            f.write("through the hard link\\n")
        OUT["hard"] = [open("train.log").read(), os.stat("train.log").st_ino == os.stat("hard.log").st_ino]
        os.remove("rel")
        OUT["after_remove"] = [os.path.lexists("rel"), os.path.exists("../outside/new.pt")]
    """)
    assert out["read"] == ["the user's other checkpoint", "the user's other checkpoint", "the user's checkpoint"]
    assert out["readlink"] == ["../outside", True, True, True, ["ckpt.pt"]]
    assert out["listed"] == ["abs/", "ckpt/", "data/", "rel/", "latest.pt", "train.log"]
    assert out["through_rel"] == "saved through abs"
    assert out["latest"] == "the user's checkpoint appended"
    assert out["hard"] == ["earlier run\nthrough the hard link\n", True]
    assert out["after_remove"] == [False, True]
    assert tree(outside) == before, "a file outside the project changed"
    stored = run / "writes" / str(outside).lstrip("/")
    assert (stored / "ckpt.pt").read_bytes() == b"saved through abs" and (stored / "new.pt").read_bytes() == b"new"


def test_chmod_through_a_descriptor_and_sqlite_databases_go_to_the_runs_copy(folder) -> None:
    """os.fchmod / os.chmod(fd) on a descriptor opened for reading the user's file, and an sqlite database (opened
    in C, past Python's open) anywhere, new or the user's: the run's copies change, the user's files do not."""
    user, run = folder
    outside = user.parent / "elsewhere"
    outside.mkdir()
    import sqlite3

    db = outside / "runs.db"
    with sqlite3.connect(db) as con:
        con.execute("create table t (x)")
        con.execute("insert into t values (1)")
    con.close()
    before = tree(outside)
    out = scenario(user, run, f"""
        import sqlite3
        fd = os.open("train.log", os.O_RDONLY)
        os.fchmod(fd, 0o000)
        os.close(fd)
        with open("ckpt/last.pt", "rb") as f:
            os.chmod(f.fileno(), 0o400)
        OUT["modes"] = [oct(os.stat("train.log").st_mode & 0o777), oct(os.stat("ckpt/last.pt").st_mode & 0o777)]
        con = sqlite3.connect({str(db)!r})
        con.execute("insert into t values (2)")
        con.commit()
        OUT["rows"] = [r[0] for r in con.execute("select x from t")]
        con.close()
        from sqlite3 import dbapi2
        con = dbapi2.connect("new.db")
        con.execute("create table u (y)")
        con.commit()
        con.close()
        OUT["new"] = os.path.exists("new.db")
        ro = sqlite3.connect("file:" + {str(db)!r} + "?mode=ro", uri=True)
        OUT["ro"] = [r[0] for r in ro.execute("select x from t")]
        ro.close()
    """)
    assert out["modes"] == ["0o0", "0o400"]
    assert out["rows"] == [1, 2] and out["ro"] == [1, 2] and out["new"] is True
    assert tree(outside) == before, "the user's database changed"
    assert ["modify", str(db), True] in out["events"] and ["create", "new.db", False] in out["events"]


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="needs a second file system: /dev/shm")
def test_a_hard_link_works_when_the_run_directory_is_on_another_file_system(tmp_path: Path) -> None:
    """The user's file on one file system, the run directory on another: a hard link of the user's file (which the
    script alone makes without a problem) raised EXDEV under the probe."""
    import tempfile

    user = tmp_path / "user"
    user.mkdir()
    (user / "train.log").write_text("earlier run\n")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        if os.stat(shm).st_dev == os.stat(user).st_dev:
            pytest.skip("/dev/shm is on the same file system")
        before = tree(user)
        out = scenario(user, Path(shm), """
            os.link("train.log", "hard.log")
            with open("hard.log", "a") as f:
                f.write("more\\n")
            OUT["both"] = [open("train.log").read(), open("hard.log").read()]
        """)
        assert out["both"] == ["earlier run\nmore\n"] * 2
        assert tree(user) == before
