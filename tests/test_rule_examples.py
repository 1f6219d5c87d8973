"""The documentation as evidence: each static rule's documented example, run through static analysis.

A rule's `example` is what `explain`, SARIF and docs/rules.md show; `example_context` is what the example assumes
and does not show (see `Rule.example_context`). The Bad half must trigger the rule and the Good half must not, so
the documentation cannot drift from what the rule finds. A rule whose example shows a case only the probe can find
says so (`example_context=None`) and must have a probe half.
"""

from __future__ import annotations

import pytest

from ddpdoctor.rules import RULES
from ddpdoctor.rules.rule import Rule
from ddpdoctor.static import analyze_source

STATIC = [r for r in RULES if r.static]
CHECKED = [r for r in STATIC if r.example_context is not None]


def _codes(rule: Rule, half: str) -> set[str]:
    return {f.rule for f in analyze_source(rule.example_script(half), f"{rule.code.lower()}_{half}_example.py")}


@pytest.mark.parametrize("rule", CHECKED, ids=lambda r: r.code)
def test_bad_example_triggers_the_rule(rule: Rule):
    assert rule.code in _codes(rule, "bad"), rule.example_script("bad")


@pytest.mark.parametrize("rule", CHECKED, ids=lambda r: r.code)
def test_good_example_is_silent(rule: Rule):
    assert rule.code not in _codes(rule, "good"), rule.example_script("good")


@pytest.mark.parametrize("rule", [r for r in STATIC if r.example_context is None], ids=lambda r: r.code)
def test_an_unchecked_example_is_the_probes_case(rule: Rule):
    assert rule.probe


def test_nearly_every_static_example_is_checked():
    # a static rule whose example only the probe could find is the exception, not a way to skip the check
    assert len(CHECKED) >= len(STATIC) - 1


def test_the_example_takes_the_place_of_the_ellipsis_indented():
    rule = next(r for r in RULES if r.code == "DD404")
    script = rule.example_script("bad")
    assert "\n    for p in ddp.parameters():\n        dist.all_reduce(p.grad)\n" in script
    assert "\n    ...\n" not in script


@pytest.mark.parametrize("rule", STATIC, ids=lambda r: r.code)
def test_known_limits_come_from_the_static_half(rule: Rule):
    assert rule.known_limits, f"{rule.code}: static.py's docstring has no 'What stays silent:' paragraph"
    assert "Known limits (static analysis stays silent on)\n" in rule.documentation()
    assert "### Known limits" in rule.markdown()


def test_a_probe_only_rule_has_no_known_limits_section():
    rule = next(r for r in RULES if not r.static)
    assert rule.known_limits is None
    assert "Known limits" not in rule.documentation()
