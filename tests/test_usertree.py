"""The before/after fingerprint of the user's folders (ddpdoctor.probe.usertree): what it sees, what it leaves to
the tools that own it, and what it reports."""

from __future__ import annotations

import os
from pathlib import Path

from ddpdoctor.probe import usertree
from ddpdoctor.probe.usertree import changes, fingerprint


def make_project(root: Path) -> None:
    (root / "ckpt").mkdir(parents=True)
    (root / "ckpt" / "last.pt").write_bytes(b"weights")
    (root / "train.py").write_text("print('hi')\n")
    venv = root / ".venv" / "lib" / "site-packages" / "pkg"
    venv.mkdir(parents=True)
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    for i in range(50):
        (venv / f"m{i}.py").write_text("")
    conda = root / "env"
    (conda / "conda-meta").mkdir(parents=True)
    (conda / "python.txt").write_text("")
    (root / ".git" / "objects").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"")


def test_environments_vcs_stores_and_caches_are_left_to_their_tools(tmp_path: Path) -> None:
    make_project(tmp_path)
    fp = fingerprint([str(tmp_path)], skip=[])
    names = {os.path.relpath(p, tmp_path) for p in fp.entries}
    assert {"ckpt", "ckpt/last.pt", "train.py", "pkg"} <= names
    # the folders themselves are there or not; what is inside them is their tools' business
    assert {".venv", "env", ".git", "pkg/__pycache__"} <= names
    assert not [n for n in names if n.startswith((".venv/", "env/", ".git/", "pkg/__pycache__/"))], names
    assert fp.complete
    assert sorted(os.path.relpath(p, tmp_path) for p in fp.tool_dirs) == [".git", ".venv", "env"]


def test_a_change_to_the_users_files_is_reported_and_one_inside_a_tool_folder_is_not(tmp_path: Path) -> None:
    make_project(tmp_path)
    before = fingerprint([str(tmp_path)], skip=[])
    (tmp_path / "ckpt" / "last.pt").write_bytes(b"overwritten weights")
    (tmp_path / "train.py").unlink()
    (tmp_path / "made.txt").write_text("new\n")
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/other\n")
    (tmp_path / ".venv" / "lib" / "site-packages" / "pkg" / "m0.py").write_text("x = 1\n")
    tree = changes(before, skip=[])
    assert tree["complete"] and tree["counts"] == {"modified": 1, "deleted": 1, "created": 1}
    assert [os.path.relpath(p, tmp_path) for p in tree["modified"]] == ["ckpt/last.pt"]
    assert [os.path.relpath(p, tmp_path) for p in tree["deleted"]] == ["train.py"]
    assert [os.path.relpath(p, tmp_path) for p in tree["created"]] == ["made.txt"]
    assert sorted(os.path.relpath(p, tmp_path) for p in tree["left_out"]) == [".git", ".venv", "env"]


def test_a_bounded_walk_covers_the_shallow_folders_first(tmp_path: Path, monkeypatch) -> None:
    """A dataset folder larger than the bound must not hide a checkpoint beside the script (the walk used to go
    depth first and spend its whole budget inside the first large folder)."""
    data = tmp_path / "aaa_data" / "train" / "class0"
    data.mkdir(parents=True)
    for i in range(60):
        (data / f"img{i}.jpg").write_bytes(b"")
    (tmp_path / "zzz_ckpt").mkdir()
    (tmp_path / "zzz_ckpt" / "best.pt").write_bytes(b"w")
    monkeypatch.setattr(usertree, "MAX_ENTRIES", 20)
    fp = fingerprint([str(tmp_path)], skip=[])
    assert not fp.complete
    assert str(tmp_path / "zzz_ckpt" / "best.pt") in fp.entries


def test_the_run_directory_is_skipped(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("")
    (tmp_path / "train.py").write_text("")
    fp = fingerprint([str(tmp_path)], skip=[str(run)])
    assert set(fp.entries) == {str(tmp_path / "train.py")}


def test_ddpdoctors_own_output_files_are_not_the_scripts_writes(tmp_path: Path) -> None:
    """`ddpdoctor check train.py > report.txt 2> log.txt` in the project folder: ddpdoctor writes those files
    during the run itself; they headed every such report as "files changed behind the probe's back"."""
    import subprocess
    import sys

    (tmp_path / "train.py").write_text("")
    code = (
        "import sys\n"
        "from ddpdoctor.probe.usertree import changes, fingerprint\n"
        "before = fingerprint([sys.argv[1]], skip=[])\n"
        "sys.stderr.write('progress\\n' * 100); sys.stderr.flush()\n"
        "open(sys.argv[1] + '/made.txt', 'w').write('x')\n"
        "tree = changes(before, skip=[])\n"
        "print(tree['counts'], file=sys.__stdout__)\n"
    )
    with open(tmp_path / "log.txt", "w") as err, open(tmp_path / "report.txt", "w") as out:
        subprocess.run([sys.executable, "-c", code, str(tmp_path)], stdout=out, stderr=err, check=True)
    assert (tmp_path / "report.txt").read_text().strip() == "{'modified': 0, 'deleted': 0, 'created': 1}"


def test_a_bytecode_cache_that_appears_is_not_a_change_to_the_users_files(tmp_path: Path) -> None:
    """A first run from a fresh clone (`make demo`) has the ranks write ddpdoctor's own __pycache__ folders under
    the project: the interpreter's cache, not a write of the script's to report."""
    make_project(tmp_path)
    before = fingerprint([str(tmp_path)], skip=[])
    (tmp_path / "ckpt" / "__pycache__").mkdir()
    (tmp_path / "ckpt" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"")
    tree = changes(before, skip=[])
    assert tree["complete"] and tree["counts"] == {"modified": 0, "deleted": 0, "created": 0}, tree


def test_a_change_of_permissions_alone_is_a_change(tmp_path: Path) -> None:
    """`chmod 000 ckpt/last.pt` (a program the script ran) changes no byte and no time: still reported."""
    make_project(tmp_path)
    before = fingerprint([str(tmp_path)], skip=[])
    os.chmod(tmp_path / "ckpt" / "last.pt", 0o000)
    os.chmod(tmp_path / "pkg", 0o700)
    tree = changes(before, skip=[])
    assert sorted(os.path.relpath(p, tmp_path) for p in tree["modified"]) == ["ckpt/last.pt", "pkg"]



def test_other_ddpdoctor_runs_outputs_are_theirs(tmp_path: Path) -> None:
    """ddpdoctor.live: another ddpdoctor running now (found in /proc by its command line) — its --output report
    (and the temporary file beside it), its stdout file — and another run's --keep-run folder are not changes the
    script made."""
    import subprocess
    import sys

    from ddpdoctor.live import Neighbours

    project = tmp_path / "project"
    make_project(project)
    before = fingerprint([str(project)], skip=[])
    # a stand-in with ddpdoctor's command line that waits: `python -m ddpdoctor` is not run, only named
    fake = tmp_path / "fake"
    (fake / "ddpdoctor").mkdir(parents=True)
    (fake / "ddpdoctor" / "__init__.py").write_text("")
    (fake / "ddpdoctor" / "__main__.py").write_text("import sys\nprint('ready', file=sys.stderr, flush=True)\n"
                                                    "sys.stdin.read()\n")
    with open(project / "their.txt", "wb") as out:
        other = subprocess.Popen([sys.executable, "-m", "ddpdoctor", "check", "x.py", "-o", "report.json"],
                                 cwd=project, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": str(fake)})
    try:
        assert other.stderr.readline().strip() == b"ready"  # running, under its own command line
        others = Neighbours()
        others.look()
    finally:
        other.communicate(b"", timeout=60)
    with open(project / "their.txt", "a") as out:
        out.write("more\n")
    (project / "report.json").write_text("{}")
    (project / ".report.json.abc123.tmp").write_text("{")
    (project / "run_b").mkdir()
    (project / "run_b" / ".ddpdoctor-run").write_text("{}")
    (project / "run_b" / "meta.json").write_text("{}")
    (project / "mine.txt").write_text("the script's\n")
    tree = changes(before, skip=[], others=others)
    assert [os.path.relpath(p, project) for p in tree["created"]] == ["mine.txt"], tree
