"""`check --diff` / `--fix` / `--fix --verify` (issue 25): every bad fixture of a rule with an automatic fix gets a
patch that `patch` applies and after which static analysis no longer finds the rule there (or is listed below with
why it has none); good fixtures get no patch; the tool never touches a file that existed before it ran."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

from ddpdoctor.fixes.command import fixed_path
from ddpdoctor.fixes.engine import Edit, apply, plan
from ddpdoctor.static import analyze_script

REPO = Path(__file__).resolve().parent.parent
STATIC = REPO / "fixtures" / "static"
RULES = ("DD101", "DD104", "DD105", "DD108", "DD207", "DD209", "DD301", "DD302", "DD401", "DD403", "DD501",
         "DD502")

# Bad fixtures whose finding has no mechanical fix, and why (the finding's fix line says "no automatic fix").
NO_FIX = {
    "DD101/bad_convert_in_setup_method.py": "the conversion and the wrapping are in different methods",
    "DD105/bad_current_device_never_bound.py": "no device is bound anywhere: where to bind it is a decision",
    "DD105/bad_no_device_binding.py": "no device is bound anywhere: where to bind it is a decision",
    "DD207/bad_no_grad_decorator_train_mode.py": "returns from inside: eval()/train() go at the call site",
    "DD209/bad_type_checks.py:16": "the classes are a tuple defined elsewhere",
    "DD301/bad_loader_wrapper_constant_epoch.py": "set_epoch lives in a loader wrapper class with its own counter",
    "DD301/bad_step_loop_no_set_epoch.py": "a step loop: no epoch counter to pass",
    "DD403/bad_backward_in_executor_method.py": "the backward and the optimizer step are in different classes",
    "DD403/bad_scaler_helper_flag.py": "the backward is in a helper the step's flag is passed to",
    "DD501/bad_resume_checkpoint_only.py": "loaded back into the wrapper: save and load change together",
    "DD501/bad_unwrap_helper_inverted.py": "the unwrap helper's condition is inverted: which is meant?",
    "DD502/bad_save_local_rank_at_call_site_trainer_only.py": "a local-rank guard: which rank writes is a decision",
    "DD502/bad_save_local_rank_attribute.py": "a local-rank guard: which rank writes is a decision",
    "DD502/bad_save_local_rank_early_return.py": "a local-rank guard: which rank writes is a decision",
    "DD502/bad_save_local_rank_in.py": "a local-rank guard: which rank writes is a decision",
    "DD502/bad_save_rank_modulo_gpus_per_node.py": "a node-local guard: which rank writes is a decision",
}


def _bad(rule: str) -> list[Path]:
    return sorted((STATIC / rule).glob("bad_*.py"))


BAD = [(rule, p) for rule in RULES for p in _bad(rule)]
GOOD = [(rule, p) for rule in RULES for p in sorted((STATIC / rule).glob("good_*.py"))]


def _findings(path: Path, rule: str) -> list:
    return [f for f in analyze_script(path).findings if f.rule == rule]


@pytest.mark.parametrize(("rule", "path"), BAD, ids=[f"{r}/{p.name}" for r, p in BAD])
def test_bad_fixture_diff_applies_and_removes_the_finding(rule: str, path: Path, tmp_path: Path, cli) -> None:
    work = tmp_path / path.name
    shutil.copy(path, work)
    before = _findings(work, rule)
    assert before, f"{path} has no {rule} finding to fix"
    res = cli("check", "--static", path.name, "--select", rule, "--diff", "--unsafe-fixes", cwd=tmp_path)
    key = f"{rule}/{path.name}"
    expected_unfixed = {f.line for f in before if NO_FIX.get(key) or NO_FIX.get(f"{key}:{f.line}")}
    if expected_unfixed == {f.line for f in before}:
        assert res.returncode == 0 and res.stdout == "", res.stdout
        assert "no automatic fix" in res.stderr
        return
    assert res.returncode == 1, res.stderr
    assert res.stdout.startswith(f"--- {path.name}\n+++ {path.name}\n")
    applied = subprocess.run(["patch", "-p0", "--no-backup-if-mismatch", "-s"], input=res.stdout, text=True,
                             cwd=tmp_path, capture_output=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    compile(work.read_text(), str(work), "exec")
    after = _findings(work, rule)
    assert len(after) == len(expected_unfixed), [(f.line, f.message) for f in after]


@pytest.mark.parametrize(("rule", "path"), GOOD, ids=[f"{r}/{p.name}" for r, p in GOOD])
def test_good_fixture_gets_no_patch(rule: str, path: Path, cli) -> None:
    res = cli("check", "--static", str(path.relative_to(REPO)), "--select", rule, "--diff", "--unsafe-fixes")
    assert res.returncode == 0 and res.stdout == ""


def test_demo_diff_fixes_all_its_static_findings(tmp_path: Path, cli) -> None:
    shutil.copy(REPO / "fixtures" / "demo" / "train.py", tmp_path / "train.py")
    res = cli("check", "--static", "train.py", "--diff", "--unsafe-fixes", cwd=tmp_path)
    assert res.returncode == 1
    for rule in ("DD101", "DD104", "DD302", "DD401"):
        assert f"{rule} at train.py" in res.stderr
    assert "no automatic fix" not in res.stderr
    for line in ("+    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n",
                 "+        train_sampler.set_epoch(epoch)\n",
                 "lr=LR * dist.get_world_size()", 'rank=int(os.environ["RANK"])'):
        assert line in res.stdout


def test_fix_writes_a_new_file_and_never_touches_existing_ones(tmp_path: Path, cli) -> None:
    shutil.copy(REPO / "fixtures" / "demo" / "train.py", tmp_path / "train.py")
    (tmp_path / "other.txt").write_text("x")
    snapshot = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
    res = cli("check", "--static", "train.py", "--fix", "--unsafe-fixes", cwd=tmp_path)
    assert res.returncode == 1  # the original still has its findings
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in snapshot} == snapshot
    fixed = tmp_path / "train.ddpdoctor-fixed.py"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt", "train.ddpdoctor-fixed.py", "train.py"]
    assert "fixed copy written: train.ddpdoctor-fixed.py" in res.stdout
    assert "automatic fix written to train.ddpdoctor-fixed.py" in " ".join(res.stdout.split())
    assert {f.rule for f in analyze_script(fixed).findings} <= {"DD402"}  # the scaled lr now wants a warmup
    # a second --fix refuses to overwrite the copy
    content = fixed.read_bytes()
    again = cli("check", "--static", "train.py", "--fix", cwd=tmp_path)
    assert again.returncode == 2 and "never overwrites" in again.stderr
    assert again.stderr.count("\n") == 1 and fixed.read_bytes() == content


def test_a_possible_finding_is_fixed_only_with_unsafe_fixes(tmp_path: Path, cli) -> None:
    """DD401 from the source alone is `possible` (the lr may already suit the global batch): not patched unless
    asked, as ruff's unsafe fixes."""
    res = cli("check", "--static", "fixtures/demo/train.py", "--select", "DD401", "--diff")
    assert res.returncode == 0 and res.stdout == ""
    assert "only possible" in res.stderr and "--unsafe-fixes" in res.stderr


def test_static_verify_says_each_fix_removed_its_finding(tmp_path: Path, cli) -> None:
    shutil.copy(REPO / "fixtures" / "demo" / "train.py", tmp_path / "train.py")
    res = cli("check", "--static", "train.py", "--fix", "--verify", "--unsafe-fixes", "--format", "json",
              cwd=tmp_path)
    import json

    fixes = {f["rule"]: f["fix"] for f in json.loads(res.stdout)["findings"]}
    assert "fix verified: DD302 overlap_fraction - -> not found (static analysis on the fixed copy)" in fixes["DD302"]
    for rule in ("DD101", "DD104", "DD401"):
        assert "fix verified:" in fixes[rule]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.ddpdoctor-fixed.py", "train.py"]


def test_a_fix_that_leaves_the_symptom_demotes_the_finding(tmp_path: Path, cli,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A patch that changes nothing the analysis sees (a comment) stands for a wrong diagnosis: the finding is
    demoted one severity and confidence level and says the diagnosis is in doubt."""
    import json

    from ddpdoctor.fixes.engine import Patch
    from ddpdoctor.rules.dd301_sampler_not_reshuffled import fix as dd301_fix

    def comment_only(finding, code):  # noqa: ANN001, ANN202
        return Patch(rule="DD301", line=finding.line, edits=(code.insert_at(1, 0, "# touched\n"),), summary="x")

    monkeypatch.setattr(dd301_fix, "fix", comment_only)
    shutil.copy(STATIC / "DD301" / "bad_no_set_epoch.py", tmp_path / "train.py")
    before = json.loads(cli("check", "--static", "train.py", "--select", "DD301", "--format", "json",
                            cwd=tmp_path).stdout)["findings"][0]
    res = cli("check", "--static", "train.py", "--select", "DD301", "--fix", "--verify", "--format", "json",
              cwd=tmp_path)
    (after,) = json.loads(res.stdout)["findings"]
    assert "fix did not remove the symptom" in after["fix"]
    assert "diagnosis in doubt" in after["message"]
    order = ["info", "low", "medium", "high", "critical"]
    assert order.index(after["severity"]) == order.index(before["severity"]) - 1


@pytest.mark.parametrize("args", [("--diff", "--fix"), ("--verify",), ("--diff", "--verify"), ("--unsafe-fixes",)])
def test_bad_option_combinations_are_refused(args: tuple[str, ...], cli) -> None:
    res = cli("check", "--static", "fixtures/demo/train.py", *args)
    assert res.returncode == 2 and res.stderr.startswith("ddpdoctor: error:") and res.stdout == ""


def test_fixed_path_is_beside_the_original() -> None:
    assert fixed_path(Path("a/b/train.py")) == Path("a/b/train.ddpdoctor-fixed.py")


def test_edits_apply_bottom_up_and_insertions_keep_their_order() -> None:
    text = "a = 1\nb = 2\n"
    edits = [Edit(1, 0, 1, 0, "x\n"), Edit(1, 0, 1, 0, "y\n"), Edit(2, 4, 2, 5, "3")]
    assert apply(text, edits) == "x\ny\na = 1\nb = 3\n"


def test_overlapping_fixes_conflict_and_the_same_edit_is_made_once() -> None:
    assert Edit(1, 2, 1, 6, "x").overlaps(Edit(1, 4, 1, 8, "y"))
    assert not Edit(1, 2, 1, 6, "x").overlaps(Edit(1, 6, 1, 8, "y"))
    assert not Edit(2, 0, 2, 0, "x").overlaps(Edit(2, 0, 2, 3, "y"))  # an insertion before a replacement
    path = STATIC / "DD209" / "bad_type_checks.py"
    finding = next(f for f in analyze_script(path).findings if f.rule == "DD209")
    p = plan("x.py", path.read_text(), [finding, finding])
    assert len(p.patches) == 1 and len(p.fixed) == 2 and not p.unfixed


@pytest.mark.slow
def test_fix_verify_on_the_demo_says_which_measurement_changed(tmp_path: Path) -> None:
    """One real 2-rank probe of the demo and one of its fixed copy (in this process: conftest's run_cli)."""
    shutil.copy(REPO / "fixtures" / "demo" / "train.py", tmp_path / "train.py")
    res = run_cli("check", "train.py", "--fix", "--verify", "-q", "--base-lr", "0.1", "--base-batch", "32", "--format",
                  "json", cwd=tmp_path)
    assert res.returncode in (0, 1), res.stderr
    import json

    report = json.loads(res.stdout)
    fixes = {f["rule"]: f["fix"] for f in report["findings"]}
    for rule in ("DD101", "DD104", "DD302", "DD401"):
        assert "fix verified:" in fixes[rule], fixes[rule]
    assert "overlap_fraction 1 -> " in fixes["DD302"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.ddpdoctor-fixed.py", "train.py"]


# The probe rules beside the demo's: each bad probe script patched by `--diff` (applied with `patch`), then one
# real 2-rank probe of the patched copy (one launch per script; the unpatched runs are the recorded ones the replay
# tests pin).
PROBED = [
    ("missing_set_epoch.py", ("DD301",), ()),
    ("ckpt/save_every_rank.py", ("DD501", "DD502"), ("{tmp}",)),
    ("legacy_local_rank.py", ("DD108",), ()),
]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "rules", "args"), PROBED, ids=[s for s, _, _ in PROBED])
def test_probe_of_the_patched_copy_no_longer_finds_the_rule(script: str, rules: tuple[str, ...],
                                                             args: tuple[str, ...], tmp_path: Path, cli,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    src = REPO / "fixtures" / "probe" / script
    work = tmp_path / src.name
    shutil.copy(src, work)
    monkeypatch.setenv("PYTHONPATH", str(REPO / "fixtures" / "probe"))  # the fixtures' common.py
    select = ",".join(rules)
    res = cli("check", "--static", work.name, "--select", select, "--diff", cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    for rule in rules:
        assert f"{rule} at {work.name}" in res.stderr and "no automatic fix" not in res.stderr
    applied = subprocess.run(["patch", "-p0", "--no-backup-if-mismatch", "-s"], input=res.stdout, text=True,
                             cwd=tmp_path, capture_output=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    out = tmp_path / "out"
    out.mkdir()
    probed = cli("check", work.name, "-q", "--format", "json", "--",
                 *(a.format(tmp=out) for a in args), cwd=tmp_path)
    import json

    report = json.loads(probed.stdout)
    assert report["environment"].get("backend") == "gloo"  # the ranks ran
    found = {f["rule"] for f in report["findings"]}
    assert not found & {*rules, "DD901", "DD902", "DD904"}, probed.stdout
