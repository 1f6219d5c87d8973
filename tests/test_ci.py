"""CI and pre-commit as the README wires them.

The GitHub workflow of the README: valid YAML whose ddpdoctor steps run as written (on this repository's fixtures
in place of `.`). The pre-commit hook (.pre-commit-hooks.yaml, id `ddpdoctor`): static checks of the staged Python
files, at two levels: the hook file's contract, checked offline (pre-commit's own manifest schema, and the command it
runs over a file list, as pre-commit passes it); and the real thing, `pre-commit try-repo` against this checkout, which
builds the hook's isolated environment from the package index (no torch: ddpdoctor does not depend on it). Set
DDPDOCTOR_OFFLINE=1 to skip the latter where no package index can be reached.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOOKS = REPO / ".pre-commit-hooks.yaml"
BAD_A = REPO / "fixtures" / "static" / "DD101" / "bad_convert_after_wrap.py"  # DD101 (medium)
BAD_B = REPO / "fixtures" / "static" / "DD104" / "bad_literal_rank.py"  # DD104 (critical)
GOOD = REPO / "fixtures" / "static" / "DD104" / "good_env_rank.py"

clientlib = pytest.importorskip("pre_commit.clientlib", reason="pre-commit is not installed (pip install -e .[test])")


def _hook() -> dict:
    (hook,) = clientlib.load_manifest(str(HOOKS))
    return hook


def test_hook_file_follows_pre_commits_schema_and_our_contract() -> None:
    hook = _hook()
    assert hook["id"] == "ddpdoctor"
    assert hook["language"] == "python"  # an isolated environment with ddpdoctor installed, without torch
    assert shlex.split(hook["entry"]) == ["ddpdoctor", "check", "--static"]
    assert hook["types"] == ["python"] and hook["pass_filenames"] is True


def _run_entry(files: list[Path], *args: str) -> subprocess.CompletedProcess:
    """What pre-commit runs: the entry, the user's args, then the staged files (relative to the repository)."""
    entry = shlex.split(_hook()["entry"])
    assert entry[0] == "ddpdoctor"
    cmd = [sys.executable, "-m", "ddpdoctor", *entry[1:], *args, *(str(f.relative_to(REPO)) for f in files)]
    return subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_entry_checks_every_file_it_is_given() -> None:
    done = _run_entry([BAD_A, GOOD, BAD_B], "--format", "json")
    assert done.returncode == 1, done.stderr  # findings at or above medium fail the commit
    findings = json.loads(done.stdout)["findings"]
    assert {(f["rule"], f["file"]) for f in findings} >= {
        ("DD101", str(BAD_A.relative_to(REPO))), ("DD104", str(BAD_B.relative_to(REPO)))}
    assert not [f for f in findings if f["file"] == str(GOOD.relative_to(REPO))]
    text = _run_entry([BAD_A, GOOD, BAD_B])  # what the hook prints: the text report
    assert text.returncode == 1 and " DD101 sync-bn-after-ddp" in text.stdout and " DD104 hardcoded-rank" in text.stdout


def test_entry_passes_clean_files_and_honours_args() -> None:
    assert _run_entry([GOOD]).returncode == 0
    # args from .pre-commit-config.yaml come before the files: only critical findings fail the commit
    only_critical = _run_entry([BAD_A], "--fail-on", "critical")
    assert only_critical.returncode == 0 and "DD101" in only_critical.stdout


def test_readme_pre_commit_config_uses_this_hook() -> None:
    import yaml

    config = yaml.safe_load(_readme_block("# .pre-commit-config.yaml"))
    hooks = [h for repo in config["repos"] for h in repo["hooks"]]
    assert [h["id"] for h in hooks] == ["ddpdoctor"]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DDPDOCTOR_OFFLINE") == "1", reason="DDPDOCTOR_OFFLINE=1: no package index")
def test_pre_commit_try_repo_runs_the_hook(tmp_path: Path) -> None:
    """pre-commit itself: the hook environment built from this checkout, run on a user's repository."""
    project = tmp_path / "project"
    project.mkdir()
    git = shutil.which("git")
    assert git
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPDOCTOR_", "GIT_", "PRE_COMMIT"))}
    env.update(PRE_COMMIT_HOME=str(tmp_path / "cache"), GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    subprocess.run([git, "init", "-q"], cwd=project, check=True, env=env)
    shutil.copy(BAD_A, project / "train.py")
    (project / "utils").mkdir()
    shutil.copy(BAD_B, project / "utils" / "dist.py")
    shutil.copy(GOOD, project / "clean.py")
    (project / "README.txt").write_text("not python\n")
    subprocess.run([git, "add", "."], cwd=project, check=True, env=env)
    pre_commit = [sys.executable, "-m", "pre_commit"]
    done = subprocess.run([*pre_commit, "try-repo", str(REPO), "ddpdoctor", "--all-files"], check=False,
                          cwd=project, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]  # the hook failed the (simulated) commit
    assert "ddpdoctor" in out and "Failed" in out
    assert "train.py:" in out and "utils/dist.py:" in out and " DD101 " in out and " DD104 " in out
    assert "README.txt" not in out  # types: [python]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DDPDOCTOR_OFFLINE") == "1", reason="DDPDOCTOR_OFFLINE=1: no package index")
def test_the_hook_environment_is_typer_and_rich_only(tmp_path: Path) -> None:
    """What `pip install .` (the hook's environment) resolves to: ddpdoctor, typer, rich and theirs, none of the
    probe extra's numpy and scipy, no torch (issue 22: they were 216 MB of a 267 MB hook environment)."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), str(REPO)], capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"ddpdoctor", "typer", "rich"} <= names
    assert not names & {"numpy", "scipy", "torch"}, names


def _readme_rev() -> str:
    import yaml

    (repo,) = yaml.safe_load(_readme_block("# .pre-commit-config.yaml"))["repos"]
    return str(repo["rev"])


def test_readme_pre_commit_rev_exists_in_this_repository() -> None:
    """The README's `rev:` names a revision this repository has (issue 22: `rev: v0.1.0` named a tag that did not
    exist, so the instructions failed as written)."""
    git = shutil.which("git")
    if git is None or subprocess.run([git, "rev-parse", "--git-dir"], cwd=REPO, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    shallow = subprocess.run([git, "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    rev = _readme_rev()
    found = subprocess.run([git, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=REPO,
                           capture_output=True).returncode == 0
    if not found and shallow.stdout.strip() == "true":
        pytest.skip(f"a shallow clone may lack {rev}")
    assert found, f"README's pre-commit rev {rev!r} is no revision of this repository"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DDPDOCTOR_OFFLINE") == "1", reason="DDPDOCTOR_OFFLINE=1: no package index")
def test_readme_pre_commit_config_works_as_written(tmp_path: Path) -> None:
    """The README's .pre-commit-config.yaml, with this checkout as the repository: pre-commit fetches the README's
    rev, builds the hook's environment and the hook fails the commit."""
    git = shutil.which("git")
    assert git
    block = _readme_block("# .pre-commit-config.yaml")
    project = tmp_path / "project"
    project.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPDOCTOR_", "GIT_", "PRE_COMMIT"))}
    env.update(PRE_COMMIT_HOME=str(tmp_path / "cache"), GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    subprocess.run([git, "init", "-q"], cwd=project, check=True, env=env)
    (project / ".pre-commit-config.yaml").write_text(
        re.sub(r"repo: \S+", f"repo: {REPO}", block, count=1), encoding="utf-8")
    shutil.copy(BAD_A, project / "train.py")
    subprocess.run([git, "add", "."], cwd=project, check=True, env=env)
    done = subprocess.run([sys.executable, "-m", "pre_commit", "run", "--all-files"], check=False, cwd=project,
                          env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "train.py:" in out, out[-4000:]


def _readme_block(marker: str) -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(" + re.escape(marker) + r".*?)```", readme, re.S)
    assert block, f"README shows {marker}"
    return block.group(1)


def test_readme_workflow_is_valid_and_its_ddpdoctor_steps_run(tmp_path: Path) -> None:
    import yaml

    workflow = yaml.safe_load(_readme_block("# .github/workflows/ddpdoctor.yml"))
    (job,) = workflow["jobs"].values()
    assert job["permissions"]["security-events"] == "write"
    steps = job["steps"]
    upload = next(s for s in steps if str(s.get("uses", "")).startswith("github/codeql-action/upload-sarif"))
    commands = [s["run"] for s in steps if str(s.get("run", "")).startswith("ddpdoctor ")]
    assert any("--format github" in c for c in commands) and any("--format sarif" in c for c in commands)
    target = "fixtures/static/DD101"  # a directory of scripts, as `.` is in the user's repository
    for command in commands:
        args = shlex.split(command)[1:]
        args = [target if a == "." else a for a in args]
        args = [str(tmp_path / a) if a.endswith(".sarif") else a for a in args]
        done = subprocess.run([sys.executable, "-m", "ddpdoctor", *args], check=False, cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode in (0, 1), (command, done.stderr)
        if "--format github" in command:
            assert done.stdout.startswith("::") and "file=fixtures/static/DD101/" in done.stdout
    sarif = tmp_path / upload["with"]["sarif_file"]
    doc = json.loads(sarif.read_text())
    assert doc["version"] == "2.1.0" and doc["runs"][0]["results"]

