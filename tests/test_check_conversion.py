"""`check` alone reports the conversion defects `triage` confirms (issue 20): whenever its probe sees SyncBatchNorm
layers it runs triage's deterministic conversion checks on two short arms (ddpdoctor.conversion), so code that
selects norm layers by exact class — in a helper module static analysis does not read — is reported as DD209 at the
file and line of its class test, next to DD208, DD210 and DD216 from the run itself; a static exact-class suspicion
the arms measured as harmless is cleared; a script without SyncBN runs no arm.

Slow: each SyncBN case is one `check` (its run, then arms A and P) on 2 CPU ranks, made once per module, and shared
by the tests that read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "triage"
OPTIONS = ("--epochs", "2", "--steps", "3")

# fixture → (rule, file name, line) `check` must report, from the run (None: no DD209 at all)
CASES = {
    "wd_helper": ("DD209", "norm_utils.py", 17),  # optimizer groups: the builder called where the optimizer is made
    "momentum_helper": ("DD209", "norm_utils.py", 27),  # a momentum schedule: the `if` around its setter
    "precise_bn_helper": ("DD209", "norm_utils.py", 34),  # a precise-BN helper that returns early
    "freeze_helper": ("DD209", "norm_utils.py", 53),  # freezing by exact class
    "fused_act_torch": ("DD208", "fused_act_torch.py", None),
    "frozen_unfrozen": ("DD210", "frozen_unfrozen.py", None),
    "cloning_after_optimizer": ("DD216", "cloning_after_optimizer.py", None),
    "init_before_conversion": None,  # the good twin: exact-class code run before the conversion
}

pytestmark = pytest.mark.xdist_group("check_conversion")

_RUNS: dict[str, tuple[int, dict, Path, str]] = {}


def _check(folder: Path, name: str) -> tuple[int, dict, Path, str]:
    """`ddpdoctor check` as the user runs it (in this process: tests/conftest.py run_cli), with --keep-run."""
    keep, out = folder / "keep", folder / f"{name}.json"
    done = run_cli("check", str(FIXTURES / f"{name}.py"), "--format", "json", "-o", str(out), "--keep-run", str(keep),
                   *OPTIONS)
    assert out.is_file(), done.stderr[-3000:]
    return done.returncode, json.loads(out.read_text(encoding="utf-8")), keep, done.stderr


def checked(factory: pytest.TempPathFactory, name: str) -> tuple[int, dict, Path, str]:
    """One check per fixture, shared by the tests of this module that read it."""
    if name not in _RUNS:
        _RUNS[name] = _check(factory.mktemp(name), name)
    return _RUNS[name]


def _all(findings: list[dict]) -> list[dict]:
    return [f for top in findings for f in (top, *_all(top.get("consequences", [])))]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c is not None))
def test_check_reports_the_conversion_defect(tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    rule, file, line = CASES[name]
    code, report, keep, _ = checked(tmp_path_factory, name)
    hits = [f for f in _all(report["findings"]) if f["rule"] == rule]
    assert hits, [(f["rule"], f["file"], f["line"]) for f in report["findings"]]
    f = hits[0]
    assert "probe" in f["sources"], f
    assert f["file"].endswith(file), f
    if line is not None:  # a DD209 names the class test
        assert f["line"] == line, f
        assert f"{file}:{line}" in f["message"], f["message"]
        assert f["evidence"].get("measured_by", "").startswith("conversion check"), f["evidence"]
    assert f["severity"] in ("high", "critical") and code == 1
    assert (keep / "conversion.json").is_file()


@pytest.mark.slow
def test_a_static_suspicion_the_arms_measured_harmless_is_cleared(tmp_path_factory: pytest.TempPathFactory) -> None:
    code, report, keep, _ = checked(tmp_path_factory, "init_before_conversion")
    assert not [f for f in _all(report["findings"]) if f["rule"] == "DD209"], report["findings"]
    assert any("DD209" in n and "conversion check" in n for n in report["notes"]), report["notes"]
    assert not any("shows only against a run without the conversion" in n for n in report["notes"])
    assert json.loads((keep / "conversion.json").read_text(encoding="utf-8"))["measured"] is True


@pytest.mark.slow
def test_report_of_a_kept_run_shows_the_same_conversion_findings(tmp_path_factory: pytest.TempPathFactory) -> None:
    from ddpdoctor.check import report_run

    _, report, keep, _ = checked(tmp_path_factory, "wd_helper")
    again = report_run(keep)
    mine = sorted((f["rule"], f["file"], f["line"]) for f in report["findings"])
    assert sorted((f.rule, f.file, f.line) for f in again.findings) == mine


@pytest.mark.slow
def test_the_progress_says_why_the_arms_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    _, _, _, stderr = checked(tmp_path_factory, "momentum_helper")
    assert "SyncBatchNorm layers seen: conversion check" in stderr


@pytest.mark.slow
def test_no_arm_runs_without_syncbn(tmp_path: Path) -> None:
    """A plain-BN script costs no extra launch: one run, no conversion check."""
    keep, out = tmp_path / "keep", tmp_path / "r.json"
    done = run_cli("check", str(FIXTURES / "plain_bn_small.py"), "--format", "json", "-o", str(out), "--keep-run",
                   str(keep), *OPTIONS)
    assert out.is_file(), done.stderr[-3000:]
    assert not (keep / "conversion.json").exists()
    assert "conversion check" not in done.stderr
    assert done.stderr.count("ddpdoctor: probing ") == 1, done.stderr
