"""Every fixture under fixtures/static is analysed and compared with the `# expect:` comments it carries.

A fixture declares each finding it must produce on the offending line: `x = DDP(m)  # expect: DD101` (several:
`# expect: DD501, DD502`; a confidence: `# expect: DD102(certain)`). The findings must match the comments exactly
— a finding without a comment is a false alarm, a comment without a finding is a miss. Per-rule folders hold
`bad_*.py` (must trigger their rule) and `good_*.py` (a close variant that must not); `scripts/` holds whole
training scripts in the styles people write, whose `good_*` versions may carry nothing above `low`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpdoctor.dev.evidence import STATIC_FIXTURES as FIXTURES
from ddpdoctor.dev.evidence import expectations, static_fixtures
from ddpdoctor.findings import Severity
from ddpdoctor.static import analyze_file, build_model

ALL = static_fixtures()  # where a rule's fixtures are: the index of the rules' evidence


def _id(p: Path) -> str:
    return str(p.relative_to(FIXTURES))


def test_fixture_tree_is_populated() -> None:
    rule_dirs = {p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name.startswith("DD")}
    from ddpdoctor.rules import hooks

    RULES = hooks("static")
    assert rule_dirs == {r.CODE for r in RULES}, "every static rule has a fixture folder, and only those"
    for d in rule_dirs:
        files = [p.name for p in (FIXTURES / d).glob("*.py")]
        assert any(f.startswith("bad_") for f in files), f"{d} has no bad_ fixture"
        assert any(f.startswith("good_") for f in files), f"{d} has no good_ fixture"


@pytest.mark.parametrize("path", ALL, ids=_id)
def test_fixture_findings_match_expect_comments(path: Path) -> None:
    findings = analyze_file(path)
    got = {(f.rule, f.line): f for f in findings}
    want = expectations(path)
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    detail = "\n".join(f"  {f.rule} L{f.line} {f.severity.label}/{f.confidence.label}: {f.message}" for f in findings)
    assert not missing and not extra, f"missing {missing}, unexpected {extra}; findings:\n{detail}"
    for f in findings:
        json.loads(json.dumps(f.to_json(), allow_nan=False))  # evidence holds JSON values only
    for key, confidence in want.items():
        if confidence is not None:
            assert got[key].confidence.label == confidence, f"{key}: {got[key].confidence.label} != {confidence}"


@pytest.mark.parametrize("path", ALL, ids=_id)
def test_fixture_is_understood_without_internal_errors(path: Path) -> None:
    model = build_model(path.read_text(encoding="utf-8"), str(path))
    assert model.errors == []
    assert not model.truncated


@pytest.mark.parametrize("path", [p for p in ALL if p.parent.name.startswith("DD")], ids=_id)
def test_rule_fixture_is_about_its_rule(path: Path) -> None:
    rule = path.parent.name
    codes = {code for code, _ in expectations(path)}
    if path.name.startswith("bad_"):
        assert rule in codes, f"{path.name} must expect {rule}"
    else:
        assert path.name.startswith("good_"), "fixtures are bad_*.py or good_*.py"
        assert rule not in codes, f"{path.name} is the correct variant: it must not trigger {rule}"


@pytest.mark.parametrize("path", [p for p in ALL if p.name.startswith("good_") and p.parent.name == "scripts"], ids=_id)
def test_correct_scripts_have_nothing_above_low(path: Path) -> None:
    above = [f for f in analyze_file(path) if f.severity > Severity.LOW]
    assert above == []


def test_findings_point_at_the_file_as_given_and_carry_catalog_fix(tmp_path: Path) -> None:
    src = FIXTURES / "scripts" / "bad_torchrun.py"
    findings = analyze_file(src)
    assert findings and all(f.file == str(src) and f.sources == ("static",) for f in findings)
    from ddpdoctor.rules import get_rule

    for f in findings:
        rule = get_rule(f.rule)
        assert f.fix == rule.named(rule.fix, f.evidence)  # the catalog's fix, in the script's own names
        assert f.message and "\n" not in f.message
        assert isinstance(f.evidence, dict)
