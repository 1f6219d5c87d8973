"""`ddpdoctor check --static` options end to end: exit codes, --fail-on, --select/--ignore, --output, inline
suppressions and `[tool.ddpdoctor]` in the nearest pyproject.toml. Static only, so no ranks are launched."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from ddpdoctor.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "fixtures" / "demo" / "train.py"

# DD101 (medium) at the convert line, DD104 (critical) at init_process_group, DD205 (info: SyncBN on gloo).
SCRIPT = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", rank=0, world_size=2){rank_comment}
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    model = DDP(model)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model){convert_comment}
    """
)


def write_script(tmp_path: Path, rank_comment: str = "", convert_comment: str = "") -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(rank_comment=rank_comment, convert_comment=convert_comment), encoding="utf-8")
    return path


def run_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    code = main(["check", *args, "--static", "--format", "json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def rules_of(report: dict) -> list[str]:
    return [f["rule"] for f in report["findings"]]


def test_findings_at_or_above_fail_on_exit_1(tmp_path: Path, capsys) -> None:
    script = write_script(tmp_path)
    code, report = run_json([str(script)], capsys)
    assert code == 1
    assert rules_of(report)[:2] == ["DD104", "DD101"]  # critical ranks above medium
    assert report["summary"]["critical"] == 1


def test_fail_on_threshold(tmp_path: Path, capsys) -> None:
    script = write_script(tmp_path)
    code, _ = run_json([str(script), "--fail-on", "critical"], capsys)
    assert code == 1
    code, _ = run_json([str(script), "--ignore", "DD104", "--fail-on", "high"], capsys)
    assert code == 0  # DD101 is medium


def test_select_and_ignore_prefix_match(tmp_path: Path, capsys) -> None:
    script = write_script(tmp_path)
    _, report = run_json([str(script), "--select", "DD10"], capsys)
    assert set(rules_of(report)) == {"DD101", "DD104"}
    _, report = run_json([str(script), "--select", "DD101"], capsys)
    assert rules_of(report) == ["DD101"]
    _, report = run_json([str(script), "--ignore", "DD1"], capsys)
    assert rules_of(report) == ["DD205"]
    _, report = run_json([str(script), "--ignore", "DD1,DD2"], capsys)
    assert rules_of(report) == []


def test_unknown_rule_in_select_is_bad_input(tmp_path: Path, capsys) -> None:
    script = write_script(tmp_path)
    code = main(["check", str(script), "--static", "--select", "XX9"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "XX9" in err


def test_inline_suppression_on_the_offending_line(tmp_path: Path, capsys) -> None:
    script = write_script(tmp_path, convert_comment="  # ddpdoctor: ignore[DD101]")
    code, report = run_json([str(script)], capsys)
    assert "DD101" not in rules_of(report) and "DD104" in rules_of(report)
    script = write_script(tmp_path, rank_comment="  # ddpdoctor: ignore[DD1]")
    _, report = run_json([str(script)], capsys)
    assert "DD104" not in rules_of(report) and "DD101" in rules_of(report)


def test_pyproject_table_is_read_from_the_nearest_pyproject(tmp_path: Path, capsys) -> None:
    project = tmp_path / "proj"
    (project / "src").mkdir(parents=True)
    script = write_script(project / "src")
    (project / "pyproject.toml").write_text(
        '[tool.ddpdoctor]\nignore = ["DD104"]\nfail_on = "critical"\n', encoding="utf-8"
    )
    code, report = run_json([str(script)], capsys)
    assert rules_of(report) == ["DD101", "DD205"] and code == 0
    # the command line wins over the table
    code, _ = run_json([str(script), "--fail-on", "medium"], capsys)
    assert code == 1


def test_pyproject_with_unknown_key_is_bad_input(tmp_path: Path, capsys) -> None:
    script = write_script(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[tool.ddpdoctor]\nfial_on = 'high'\n", encoding="utf-8")
    code = main(["check", str(script), "--static"])
    err = capsys.readouterr().err
    assert code == 2 and "fial_on" in err and err.count("\n") == 1


def test_output_file_gets_the_report_and_stdout_stays_empty(tmp_path: Path, capsys) -> None:
    script = write_script(tmp_path)
    out = tmp_path / "report.sarif"
    code = main(["check", str(script), "--static", "--format", "sarif", "--output", str(out)])
    assert code == 1
    assert capsys.readouterr().out == ""
    sarif = json.loads(out.read_text(encoding="utf-8"))
    assert sarif["version"] == "2.1.0"
    assert {r["ruleId"] for r in sarif["runs"][0]["results"]} == {"DD101", "DD104", "DD205"}


@pytest.mark.parametrize(
    "args, needle",
    [
        (["check", "does-not-exist.py", "--static"], "does-not-exist.py"),
        (["check", str(DEMO), "--static", "--format", "xml"], "--format"),
        (["check", str(DEMO), "--static", "--fail-on", "severe"], "severe"),
        (["check", str(DEMO), "--base-lr", "0.1"], "--base-batch"),
        (["check", str(DEMO), "--static", "--device", "tpu"], "--device"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, capsys) -> None:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_syntax_error_names_file_and_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\n\ndef f(:\n    pass\n", encoding="utf-8")
    code = main(["check", str(bad), "--static"])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}:3" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------- report DIR


def _demo_run_in_a_project(tmp_path: Path, table: str) -> Path:
    """The demo's recorded run, as if its script sat in a project whose pyproject.toml holds `table`."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(ROOT / "fixtures" / "runs" / "demo", run)
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(textwrap.dedent(table), encoding="utf-8")
    (project / "train.py").write_text(DEMO.read_text(encoding="utf-8"), encoding="utf-8")
    meta = json.loads((run / "meta.json").read_text(encoding="utf-8"))
    meta["script_abs"] = str(project / "train.py")
    (run / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return run


def test_report_reads_the_projects_pyproject_like_check(tmp_path: Path, capsys) -> None:
    run = _demo_run_in_a_project(tmp_path, """
        [tool.ddpdoctor]
        select = ["DD3"]
        fail_on = "critical"
    """)
    code = main(["report", str(run), "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert set(rules_of(report)) == {"DD302"} and code == 0  # the demo's only critical finding (DD104) not selected
    # the command line wins, as for check: --select replaces the table's list, --fail-on its threshold
    code = main(["report", str(run), "--format", "json", "--select", "DD1", "--fail-on", "medium"])
    report = json.loads(capsys.readouterr().out)
    assert rules_of(report) and all(r.startswith("DD1") for r in rules_of(report)) and code == 1


def test_report_with_a_bad_pyproject_is_bad_input(tmp_path: Path, capsys) -> None:
    run = _demo_run_in_a_project(tmp_path, """
        [tool.ddpdoctor]
        lr_scaling = "cubic"
    """)
    assert main(["report", str(run)]) == 2
    assert "--lr-scaling: 'cubic' is not one of" in capsys.readouterr().err
