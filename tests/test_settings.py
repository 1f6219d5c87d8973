"""Settings declared once: each rule's threshold (`Rule.settings`) has its default written in one file, the rule's
`__init__.py`, and everything else reads it through the catalog (`ddpdoctor.rules.setting`).

The check reads the source: for each setting, the module constant its declaration names, and every place in the
package that binds that constant's name or the setting's name to a number (an assignment, a dataclass field's
default, a keyword argument)."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from ddpdoctor.analyses.context import Settings
from ddpdoctor.config import PYPROJECT_KEYS, CheckConfig, Options
from ddpdoctor.rules import RULES, SETTINGS, Setting, setting

PACKAGE = Path(__file__).resolve().parents[1] / "ddpdoctor"
DECLARED = [(rule, s) for rule in RULES for s in rule.settings]


def _number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


def _numeric_bindings(tree: ast.AST) -> set[str]:
    """Lower-cased names bound to a number anywhere in `tree` (`X = 16`, `x: int = 16`, `f(x=16)`, `A, B = 1, 2`)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts))
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs.append((node.target, node.value))
        elif isinstance(node, ast.keyword) and node.arg:
            if _number(node.value):
                out.add(node.arg.lower())
        for target, value in pairs:
            if isinstance(target, ast.Name) and _number(value):
                out.add(target.id.lower())
    return out


BINDINGS = {p: _numeric_bindings(ast.parse(p.read_text(encoding="utf-8"))) for p in PACKAGE.rglob("*.py")}


def _constant_of(rule, s: Setting) -> str:
    """The module constant `Setting(name, CONSTANT, ...)` names in the rule's `__init__.py`."""
    init = PACKAGE.parent.joinpath(*rule.package.split("."), "__init__.py")
    for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Setting" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == s.name):
            assert isinstance(node.args[1], ast.Name), f"{s.name}: declare the default as the rule's module constant"
            return node.args[1].id
    raise AssertionError(f"{s.name}: no Setting({s.name!r}, ...) in {init}")


def test_setting_names_are_unique():
    names = [s.name for _, s in DECLARED]
    assert len(names) == len(set(names)) == len(SETTINGS)


@pytest.mark.parametrize(("rule", "s"), DECLARED, ids=lambda x: getattr(x, "name", ""))
def test_a_default_is_written_in_one_file(rule, s: Setting):
    constant = _constant_of(rule, s)
    files = sorted(str(p.relative_to(PACKAGE.parent)) for p, names in BINDINGS.items()
                   if constant.lower() in names or s.name in names)
    assert files == [str(Path(*rule.package.split("."), "__init__.py"))], (s.name, files)


@pytest.mark.parametrize(("rule", "s"), DECLARED, ids=lambda x: getattr(x, "name", ""))
def test_a_setting_is_documented(rule, s: Setting):
    assert s.unit and s.meaning
    assert s.line() in rule.documentation().replace("\n", " ") or s.name in rule.documentation()
    assert f"- {s.line()}" in rule.markdown()


def test_an_option_reaches_the_pyproject_the_check_and_the_analyses():
    options = [s for s in SETTINGS.values() if s.option]
    assert options, "small_bn_batch at least"
    for s in options:
        assert s.name in PYPROJECT_KEYS
        for cls in (Options, CheckConfig, Settings):
            assert s.name in {f.name for f in fields(cls)}, (cls, s.name)
        assert getattr(CheckConfig(script=Path("x.py")), s.name) == s.default
        assert getattr(Settings(), s.name) == s.default


def test_setting_looks_up_by_name():
    assert setting("small_bn_batch").default == 16
    with pytest.raises(KeyError):
        setting("no_such_setting")
