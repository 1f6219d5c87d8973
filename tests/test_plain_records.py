"""The records written out in place of frozen dataclasses (ddpdoctor.plain.FrozenRecord) behave as the dataclasses
they replace: the same repr, equality and hash (fields declared `compare=False` left out), read-only after `__init__`.
Each is checked against a dataclass made here with the same fields."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ddpdoctor.causes import Explains
from ddpdoctor.findings import Clearance, Consequence, Finding, Measurement, Measures
from ddpdoctor.levels import Confidence, Severity
from ddpdoctor.output import Target
from ddpdoctor.plain import FrozenRecord
from ddpdoctor.rules import get_rule
from ddpdoctor.rules.rule import Rule, Setting
from ddpdoctor.static.apis.registry import Method
from ddpdoctor.static.project import Limits


def _when(*_args):
    return None


_FINDING = Finding(rule="DD301", severity=Severity.HIGH, confidence=Confidence.LIKELY, message="m", fix="f",
                   file="a.py", line=3)
_RULE = get_rule("DD301")
CASES = [
    (Setting, dict(name="n", default=3, unit="u", meaning="m", option=True)),
    (Setting, dict(name="n", default=2.5, unit="u", meaning="m")),
    (Explains, dict(cause="DD110", consequence="DD103", when=_when)),
    (Target, dict(path=Path("r.json"), fd=4)),
    (Limits, dict(max_depth=2)),
    (Method, dict(handler=_when, kinds=frozenset({"model"}))),
    (Consequence, dict(finding=_FINDING, because="b")),
    (Measures, dict(scope="site", what="w")),
    (Measurement, dict(rule="DD303", reason="r", line=4, about=("x",), evidence={"k": 1})),
    (Clearance, dict(rule="DD303", reason="r", file="a.py", evidence={"k": [1]})),
    (Rule, {f: getattr(_RULE, f) for f in Rule.__match_args__}),
]


def _reference(cls: type) -> type:
    compared = cls.__compared__ if cls.__compared__ is not None else cls.__match_args__
    return dataclasses.make_dataclass(
        cls.__name__, [(n, object, dataclasses.field(compare=n in compared)) for n in cls.__match_args__],
        frozen=True,
    )


def _all_fields(cls: type, kwargs: dict) -> dict:
    made = cls(**kwargs)
    return {n: getattr(made, n) for n in cls.__match_args__}


@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_a_frozen_record_behaves_as_the_frozen_dataclass_it_replaces(cls: type, kwargs: dict) -> None:
    assert issubclass(cls, FrozenRecord)
    ref = _reference(cls)
    values = _all_fields(cls, kwargs)
    a, b, r = cls(**kwargs), cls(**kwargs), ref(**values)
    assert repr(a) == repr(r)
    hashable = all(isinstance(values[n], (str, int, float, tuple, frozenset, Path, type(None), Severity))
                   or callable(values[n]) or isinstance(values[n], Finding)
                   for n in (cls.__compared__ or cls.__match_args__))
    assert a == b and not (a != b)
    if hashable:
        assert hash(a) == hash(r) == hash(b)
    assert (a == object()) is False
    for name in cls.__match_args__:
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot assign to field '{name}'"):
            setattr(a, name, None)
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot delete field '{name}'"):
            delattr(a, name)
        changed = {**values, name: "other"}
        compared = name in (cls.__compared__ or cls.__match_args__)
        c = object.__new__(cls)
        for key, value in changed.items():
            object.__setattr__(c, key, value)
        assert (c == a) is (not compared) is (ref(**changed) == r), name


def test_defaults_are_the_dataclasses_defaults() -> None:
    assert _all_fields(Limits, {}) == {"max_files": 400, "max_bytes": 8_000_000, "max_depth": 16}
    assert _all_fields(Target, {"path": Path("x")}) == {"path": Path("x"), "fd": None, "node": False}
    m = Measurement(rule="DD303", reason="r")
    assert (m.measured, m.file, m.line, m.about, m.evidence) == (True, None, None, (), {})
    assert Measurement(rule="DD303", reason="r").evidence is not m.evidence  # a fresh dict each, as default_factory
    with pytest.raises(ValueError, match="scope"):
        Measures(scope="file", what="w")
    with pytest.raises(TypeError):
        Clearance("DD303", "r")  # keyword-only, as kw_only=True


def test_lazy_pattern_answers_as_the_compiled_pattern() -> None:
    """`LazyPattern` compiles on first use and answers `match`/`search`/`fullmatch` exactly as `re.compile` does,
    for the lazily compiled patterns of the package (their own text and flags) on strings that hit and miss."""
    import re

    from ddpdoctor import check, torchnames
    from ddpdoctor.plain import LazyPattern
    from ddpdoctor.rules.dd106_data_parallel import static as dd106
    from ddpdoctor.rules.dd504_unreduced_metric import static as dd504
    from ddpdoctor.static.apis import ranks

    lazy = [
        check._SUPPRESS, torchnames._TORCHVISION_WITHOUT_BN, ranks._DISTRIBUTED_FLAG, ranks._DISTRIBUTED_CALL,
        dd504._WRITES, dd106._DISTRIBUTED_WORDS,
    ]
    texts = [
        "", "x = 1  # ddpdoctor: ignore[DD301, dd1]", "#DDPDOCTOR:ignore[DD3]", "vgg16", "vgg16_bn", "resnet50",
        "vit_b_16", "is_distributed", "use_ddp", "args_dist_mode", "distributed", "is_dist_avail_and_initialized",
        "dist_is_initialized", "is_initialized", "torch.save", "json.dump", "WRITER", "world_size", "NPROC", "load",
    ]
    for pat in lazy:
        assert isinstance(pat, LazyPattern)
        eager = re.compile(pat.pattern, pat.flags)
        for text in texts:
            for how in ("match", "search", "fullmatch"):
                got, want = getattr(pat, how)(text), getattr(eager, how)(text)
                assert (got and (got.span(), got.groups())) == (want and (want.span(), want.groups())), (pat, text)
    fresh = LazyPattern(r"a(b)?", re.I)
    assert fresh._compiled is None  # nothing compiled until used
    assert fresh.search("xAB").group(1) == "B" and fresh._compiled is not None
