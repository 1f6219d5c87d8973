"""The rule scaffolder (python -m ddpdoctor.dev.new_rule): what it would write, checked without writing it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddpdoctor.dev.new_rule import _pending, diff_stat, main, plan
from ddpdoctor.errors import UsageError
from ddpdoctor.rules import RULES
from ddpdoctor.static import analyze_source

REPO = Path(__file__).resolve().parents[1]


def test_a_rule_with_both_halves_gets_its_package_fixtures_test_and_contract_row():
    r, files, _ = plan("DD599", "example-rule", static=True, probe=True, severity="low", summary="an example")
    rel = {str(p.relative_to(REPO)) for p in files}
    assert rel == {
        "ddpdoctor/rules/dd599_example_rule/__init__.py",
        "ddpdoctor/rules/dd599_example_rule/static.py",
        "ddpdoctor/rules/dd599_example_rule/probe.py",
        "fixtures/static/DD599/bad_example_rule.py",
        "fixtures/static/DD599/good_example_rule.py",
        "fixtures/probe/dd599/bad_example_rule.py",
        "fixtures/probe/dd599/good_example_rule.py",
        "ddpdoctor/rules/__init__.py",
        "README.md",
        "docs/contract.md",
        "ddpdoctor/dev/evidence.py",  # no recorded run yet that clears or confirms it: the index says so
    }
    for path, text in files.items():
        if path.suffix == ".py":
            ast.parse(text, filename=str(path))
    by_name = {str(p.relative_to(REPO)): t for p, t in files.items()}
    # registered once in code order, in the contract, in the README table
    registry = by_name["ddpdoctor/rules/__init__.py"]
    assert registry.count('    "dd599_example_rule",\n') == 1
    assert registry.index('"dd504_unreduced_metric",') < registry.index('"dd599_example_rule",') < registry.index(
        '"dd901_probe_hang",')
    assert "| DD599 | example-rule | low | yes | yes | an example |" in by_name["README.md"]
    assert "| DD599 | example-rule | low | yes | yes | |" in by_name["docs/contract.md"]
    # the start fails the tests until it is written: TODO in the documentation, an expected finding in the bad fixture
    assert "TODO" in by_name["ddpdoctor/rules/dd599_example_rule/__init__.py"]
    assert "# expect: DD599" in by_name["fixtures/static/DD599/bad_example_rule.py"]
    assert "# expect" not in by_name["fixtures/static/DD599/good_example_rule.py"]
    index = by_name["ddpdoctor/dev/evidence.py"]
    assert '    "DD599": NO_CLEARED_RUN_YET,' in index and '    "DD599": NO_CONFIRMED_RUN_YET,' in index
    assert "11 files changed" in diff_stat(files)
    # CONTRIBUTING names every path the scaffolder writes
    contributing = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    for path in rel:
        generic = path.replace("dd599_example_rule", "ddNNN_<name>").replace("DD599", "DDNNN").replace("dd599", "ddnnn")
        assert generic.rsplit("/", 1)[0] in contributing or generic in contributing, path


@pytest.mark.parametrize("halves", [(True, False), (False, True), (True, True)], ids=["static", "probe", "both"])
def test_the_templates_trip_no_rule_and_follow_contributing(halves):
    static, probe = halves
    _, files, _ = plan("DD599", "example-rule", static=static, probe=probe, severity="low", summary="an example")
    for path, text in files.items():
        if "fixtures" in path.parts:  # the fixtures are correct DDP code until the TODO is written
            assert [(f.rule, f.line) for f in analyze_source(text, path.name)] == [], path
    check = next((t for p, t in files.items() if p.name == "static.py"), "")
    if static:  # pass the event, not its line (CONTRIBUTING)
        assert ".line," not in check and "line=ev," in check



def test_a_pending_row_gives_name_and_severity_and_leaves_pending():
    contract = (REPO / "docs" / "contract.md").read_text(encoding="utf-8")
    pending = _pending(contract)
    if not pending:
        pytest.skip("no pending row left in the contract")
    code, (name, severity, static, probe) = next(iter(pending.items()))
    r, files, warnings = plan(code, None, static=static, probe=probe, severity=None, summary=None)
    assert (r.name, r.severity.label) == (name, severity) and not warnings
    page = files[REPO / "docs" / "contract.md"]
    assert code not in _pending(page)
    assert next(line for line in page.splitlines() if line.startswith(f"| {code} |")).endswith("| |")
    assert any(p.name == "static.py" for p in files) == static
    assert any(p.name == "probe.py" for p in files) == probe


@pytest.mark.parametrize(
    "args, message",
    [
        (("DD301", "again"), "already has a package"),
        (("DD7001", "x"), "a rule code is"),
        (("DD701", "x"), "first digit"),
        (("DD599", "Bad_Name"), "lower-case words"),
        (("DD599", None), "give its name"),
    ],
)
def test_bad_requests_are_one_line_errors(args, message):
    with pytest.raises(UsageError, match=message):
        plan(*args, static=True, probe=False, severity="low", summary=None)


def test_a_rule_needs_a_half():
    with pytest.raises(UsageError, match="--static, --probe or both"):
        plan("DD599", "x", static=False, probe=False, severity="low", summary=None)


def test_dry_run_writes_nothing(capsys):
    before = sorted(p for p in (REPO / "ddpdoctor" / "rules").iterdir())
    assert main(["DD599", "example-rule", "--static", "--probe", "--severity", "low", "--dry-run"]) == 0
    assert "would scaffold DD599 example-rule" in capsys.readouterr().out
    assert sorted(p for p in (REPO / "ddpdoctor" / "rules").iterdir()) == before
    assert "DD599" not in {r.code for r in RULES}
