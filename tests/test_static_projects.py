"""Static analysis of projects, not files: every directory under fixtures/projects is analysed as
`ddpdoctor check --static DIR` analyses it, and its findings must match the `# expect: DDNNN` comments in all of
its files (rule, file, line) — in a helper's file when the code is there. Then what the command line adds: many
paths at once, `exclude`, suppressions and SARIF locations in helper files, notes for what could not be read, the
import budget, and never importing torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddpdoctor.cli import main
from ddpdoctor.dev.evidence import PROJECTS, REPO
from ddpdoctor.dev.evidence import expectations as file_expectations
from ddpdoctor.errors import UsageError
from ddpdoctor.static import analyze_file, analyze_paths, analyze_script, build_project_model
from ddpdoctor.static.project import Limits

# projects analysed from their entry script: a file that does not parse (its directory cannot be linted as a whole),
# a package only the installed project makes importable (linted as a directory, it would be an entry of its own);
# checked elsewhere: a suppression
ANALYSED_BY_ENTRY = {"broken_helper": "main.py", "installed_package": "scripts/train.py"}
NOT_BY_EXPECT = {"suppressed_in_helper"}


def expectations(root: Path) -> dict[tuple[str, str, int], str | None]:
    out: dict[tuple[str, str, int], str | None] = {}
    for path in sorted(root.rglob("*.py")):
        for (code, lineno), confidence in file_expectations(path).items():
            out[(code, path.relative_to(root).as_posix(), lineno)] = confidence
    return out


def _projects() -> list[Path]:
    return sorted(p for p in PROJECTS.iterdir() if p.is_dir() and p.name not in NOT_BY_EXPECT)


@pytest.mark.parametrize("project", _projects(), ids=lambda p: p.name)
def test_project_findings_match_expect_comments(project: Path, monkeypatch) -> None:
    monkeypatch.chdir(project)
    if project.name in ANALYSED_BY_ENTRY:
        result = analyze_script(Path(ANALYSED_BY_ENTRY[project.name]))
    else:
        result = analyze_paths([Path(".")])
    got = {(f.rule, f.file, f.line): f for f in result.findings}
    want = expectations(project)
    detail = "\n".join(f"  {f.rule} {f.file}:{f.line} {f.confidence.label}: {f.message}" for f in result.findings)
    assert set(got) == set(want), (
        f"missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}\n{detail}"
    )
    for key, confidence in want.items():
        if confidence is not None:
            assert got[key].confidence.label == confidence
    for f in result.findings:
        json.loads(json.dumps(f.to_json(), allow_nan=False))


def test_a_finding_in_a_helper_names_its_file_and_the_calls_that_led_there(monkeypatch) -> None:
    monkeypatch.chdir(PROJECTS / "mingpt_like")
    (f,) = analyze_file(Path("main.py"))
    assert (f.rule, f.file) == ("DD502", "trainer.py")
    assert f.evidence["call_chain"] == [
        "main.py:21 main()",
        "main.py:16 Trainer.train()",
        "trainer.py:49 Trainer._save_snapshot()",
    ]
    assert "(line 48)" in f.message  # the guard, in the same file as the finding


def test_a_place_in_another_file_is_named_with_its_file(monkeypatch) -> None:
    monkeypatch.chdir(PROJECTS / "ddp_in_helper")
    (f,) = analyze_file(Path("main.py"))
    assert f.rule == "DD101" and f.file == "main.py"
    assert "at utils/dist.py:18 but convert_sync_batchnorm is applied to `model` at line 14" in f.message
    assert "call_chain" not in f.evidence  # the finding is in the script itself


def test_the_helper_that_reads_local_rank_is_read(monkeypatch) -> None:
    """DINO: `--local_rank` in the script, LOCAL_RANK read in utils.py — no DD108, and the read is seen there."""
    monkeypatch.chdir(PROJECTS / "dino_like")
    model = build_project_model(Path("main_dino.py"))
    reads = {(ev.file, ev.data["var"]) for ev in model.of("env_read")}
    assert ("utils.py", "LOCAL_RANK") in reads
    assert [f.rule for f in analyze_file(Path("main_dino.py"))] == []


def test_a_helper_that_does_not_parse_is_a_note(monkeypatch) -> None:
    monkeypatch.chdir(PROJECTS / "broken_helper")
    result = analyze_script(Path("main.py"))
    assert [n for n in result.notes if n.startswith("broken_helpers.py:1: syntax error")], result.notes
    assert sorted((f.rule, f.file) for f in result.findings) == [("DD302", "data.py"), ("DD401", "main.py")]
    code = main(["check", "main.py", "--static", "--format", "json", "--fail-on", "critical"])
    assert code == 0
    # named on the command line it is a file to analyse: one line, exit 2
    with pytest.raises(UsageError, match=r"broken_helpers.py:1: syntax error"):
        analyze_paths([Path(".")])


def test_an_import_cycle_is_followed_once_and_reported_once(monkeypatch) -> None:
    monkeypatch.chdir(PROJECTS / "import_cycle")
    for result in (analyze_paths([Path(".")]), analyze_paths([Path("loop.py"), Path("train.py")])):
        assert [(f.rule, f.file) for f in result.findings] == [("DD301", "loop.py")]
    model = build_project_model(Path("train.py"))
    assert sorted(model.sources) == ["loop.py", "train.py"]


def test_a_module_only_imported_is_analysed_in_its_importers_context(monkeypatch) -> None:
    """Given alone, trainer.py is a script of its own; given with main.py, it is main.py's helper: the save is
    reported once, at its line, with main.py's call chain."""
    monkeypatch.chdir(PROJECTS / "mingpt_like")
    both = analyze_paths([Path("trainer.py"), Path("main.py"), Path("model.py")])
    assert [(f.rule, f.file, f.line) for f in both.findings] == [("DD502", "trainer.py", 43)]
    assert both.findings[0].evidence["call_chain"][0] == "main.py:21 main()"
    alone = analyze_paths([Path("trainer.py")])
    assert [(f.rule, f.file, f.line) for f in alone.findings] == [("DD502", "trainer.py", 43)]


def test_check_static_over_paths_with_exclude_suppressions_and_sarif(tmp_path: Path, monkeypatch, capsys) -> None:
    import shutil

    for name in ("suppressed_in_helper", "save_in_helper"):
        shutil.copytree(PROJECTS / name, tmp_path / name)
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "old.py").write_text("import torch\ntorch.save({}, 'x.pt')\nDDP = 1\n")
    (tmp_path / "pyproject.toml").write_text('[tool.ddpdoctor]\nexclude = ["legacy"]\n')
    monkeypatch.chdir(tmp_path)
    code = main(["check", "--static", "suppressed_in_helper", "save_in_helper", "--format", "sarif"])
    sarif = json.loads(capsys.readouterr().out)
    results = sarif["runs"][0]["results"]
    uris = [r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in results]
    assert uris == ["save_in_helper/checkpoint.py"]  # the suppressed save in helpers.py is gone, legacy/ excluded
    assert results[0]["locations"][0]["physicalLocation"]["region"]["startLine"] == 5
    assert code == 0  # DD502 is low: below the default --fail-on medium


def test_dashdash_still_separates_script_arguments_from_paths(monkeypatch, capsys) -> None:
    monkeypatch.chdir(PROJECTS / "save_in_helper")
    assert main(["check", "main.py", "--static", "--format", "json", "--", "--epochs", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [f["file"] for f in report["findings"]] == ["checkpoint.py"]
    assert report["target"]["args"] == ["--epochs", "3"]
    assert main(["check", "main.py", "missing_dir", "--static"]) == 2


def test_sys_path_additions_become_import_roots_but_installed_packages_never(tmp_path: Path) -> None:
    model = build_project_model(PROJECTS / "sys_path_root" / "scripts" / "train.py")
    assert any(name.endswith("lib/data.py") for name in model.sources)
    added = model.of("sys_path")
    assert added and added[0].data["added"] is True
    script = tmp_path / "train.py"
    site = Path(json.__file__).parent.parent  # the standard library
    script.write_text(f"import sys\nsys.path.insert(0, {str(site)!r})\nimport json\nimport torch\njson.dumps({{}})\n")
    model = build_project_model(script)
    assert list(model.sources) == [str(script)]
    assert model.of("sys_path")[0].data["added"] is False


def test_the_import_budget_is_a_note_not_a_failure(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"m{i}.py").write_text(
            f"import m{i + 1}\n\ndef f():\n    return m{i + 1}.f()\n" if i < 4 else "def f():\n    return 1\n"
        )
    (tmp_path / "main.py").write_text("import m0\nm0.f()\n")
    result = analyze_script(tmp_path / "main.py", limits=Limits(max_depth=2))
    assert len(result.files) == 3  # main, m0, m1
    assert any("imports nest deeper than 2 levels" in n for n in result.notes)
    result = analyze_script(tmp_path / "main.py", limits=Limits(max_files=2))
    assert len(result.files) == 3 and any("larger than 2 files" in n for n in result.notes)


def test_a_project_run_imports_no_torch() -> None:
    dirs = [str(p) for p in sorted(PROJECTS.iterdir()) if p.is_dir() and p.name != "broken_helper"]
    code = textwrap.dedent(
        f"""
        import contextlib, io, json, sys
        from ddpdoctor.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["check", "--static", *{dirs!r}, "--format", "json", "--fail-on", "critical"])
        report = json.loads(out.getvalue())
        print(json.dumps({{"torch": "torch" in sys.modules, "n": len(report["findings"])}}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["torch"] is False and result["n"] >= 8


@pytest.mark.slow
def test_the_probe_and_static_analysis_meet_at_the_helper_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """Every rank calls a helper that writes the checkpoint: the probe measures the write at the helper's line,
    static analysis reads it there, and the report holds one finding from both."""
    import shutil

    shutil.copytree(PROJECTS / "save_in_helper", tmp_path / "proj")
    monkeypatch.chdir(tmp_path / "proj")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    code = main(
        [
            "check",
            "main.py",
            "--format",
            "json",
            "--nproc",
            "2",
            "--epochs",
            "1",
            "--steps",
            "2",
            "--fail-on",
            "critical",
            "--timeout",
            "240",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    saves = [f for f in report["findings"] if f["rule"] == "DD502"]
    assert [(f["file"], f["line"]) for f in saves] == [("checkpoint.py", 5)], saves
    assert sorted(saves[0]["sources"]) == ["probe", "static"]
