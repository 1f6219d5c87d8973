"""Report renderers: text (rich, without colour), JSON (SPEC shape, strict) and SARIF (validated against the
SARIF 2.1.0 schema, copied into tests/data so the test does not need ../shared)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest

from ddpdoctor import __version__
from ddpdoctor.errors import UsageError
from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.report import Report
from ddpdoctor.report.render import render, render_rules
from ddpdoctor.report.sarif import artifact_location, sarif_log
from ddpdoctor.report.text import format_ranks, render_text
from ddpdoctor.rules import RULES, get_rule

DATA = Path(__file__).resolve().parent / "data"
SCHEMA_COPY = DATA / "sarif-schema-2.1.0.json"
SCHEMA_SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "sarif-schema-2.1.0.json"

ENV = {
    "torch": "2.13.0",
    "python": "3.11.7",
    "nproc": 2,
    "backend": "gloo",
    "device": "cpu",
    "cuda_emulated": True,
}
TRACEBACK = "Traceback (most recent call last):\n" + "".join(
    f'  File "train.py", line {i}, in step\n    step()\n' for i in range(1, 11)
) + "RuntimeError: Expected all tensors to be on the same device\n"


def strict_loads(text: str):
    """json.loads that refuses NaN/Infinity, like jq and GitHub do."""

    def reject(token):
        raise ValueError(f"non-standard JSON constant {token}")

    return json.loads(text, parse_constant=reject)


@pytest.fixture()
def report() -> Report:
    findings = (
        Finding(
            rule="DD301",
            severity=Severity.HIGH,
            confidence=Confidence.CERTAIN,
            message="Epochs 0 and 1 iterated the same 64 indices in the same order on ranks [0, 1].",
            fix=get_rule("DD301").fix,
            sources=("static", "probe"),
            file="train.py",
            line=41,
            ranks=(0, 1),
            evidence={"epochs": [0, 1], "identical_orders": 2, "set_epoch_calls": 0, "samplers": ["train"]},
        ),
        Finding(
            rule="DD902",
            severity=Severity.CRITICAL,
            confidence=Confidence.CERTAIN,
            message="Rank 1 raised RuntimeError at step 3",
            fix=get_rule("DD902").fix,
            sources=("probe",),
            ranks=(1,),
            evidence={"exit_code": 1, "traceback": TRACEBACK},
        ),
        Finding(
            rule="DD406",
            severity=Severity.HIGH,
            confidence=Confidence.LIKELY,
            message="The loss was NaN from step 2 on rank 0.",
            fix=get_rule("DD406").fix,
            sources=("probe",),
            file="train.py",
            line=77,
            ranks=(0,),
            evidence={"first_loss": float("nan"), "grad_max": float("inf"), "bn_var_min": float("-inf")},
        ),
        Finding(
            rule="DD502",
            severity=Severity.LOW,
            confidence=Confidence.POSSIBLE,
            message="torch.save is reached by every rank.",
            fix=get_rule("DD502").fix,
            sources=("static",),
            file="utils/ckpt io.py",
            line=12,
        ),
    )
    return Report(
        script="train.py",
        args=("--epochs", "90", "--data", "/data/image net"),
        environment=dict(ENV),
        findings=findings,
        notes=("CUDA was emulated on CPU: 2 virtual devices, nccl mapped to gloo",),
        tables={
            "bn_errors": {
                "title": "BN running_var relative error vs the global-batch reference",
                "columns": ["layer", "local BN", "SyncBN", "batch"],
                "rows": [["bn1", 0.1312, 2.4e-7, 16], ["layer1.0.bn1", 0.0456, None, 16]],
            }
        },
    )


# ---------------------------------------------------------------- text


def test_text_without_colour_has_every_part(report):
    out = render(report, "text", color=False)
    assert "\x1b[" not in out
    assert all(len(line) <= 100 for line in out.splitlines())
    assert out.splitlines()[0] == f"ddpdoctor {__version__}  train.py --epochs 90 --data '/data/image net'"
    env_line = out.splitlines()[1]
    for part in ("torch 2.13.0", "python 3.11.7", "2 ranks", "backend gloo", "device cpu", "CUDA emulated"):
        assert part in env_line
    assert "note: CUDA was emulated on CPU: 2 virtual devices, nccl mapped to gloo" in out

    # grouped by severity, critical first, numbered in rank order
    assert out.index("CRITICAL (1)") < out.index("HIGH (2)") < out.index("LOW (1)")
    assert "MEDIUM" not in out.split("summary:")[0].replace("medium", "")
    assert " 1. DD902 rank-failed  critical, certain, probe" in out
    assert " 2. DD301 sampler-not-reshuffled  high, certain, static+probe" in out
    assert " 3. DD406 non-finite  high, likely, probe" in out
    assert " 4. DD502 save-on-every-rank  low, possible, static" in out
    assert "train.py:41  ranks 0-1" in out
    assert "utils/ckpt io.py:12" in out
    # messages are printed verbatim: brackets are not taken as rich markup
    assert "on ranks [0, 1]." in out
    assert "fix: " + get_rule("DD301").fix[:60] in out

    # evidence: short values inline, the traceback's tail as a block
    assert "evidence: epochs=[0, 1], identical_orders=2, set_epoch_calls=0, samplers=[train]" in out
    assert "traceback: (last 12 of 22 lines)" in out
    assert "RuntimeError: Expected all tensors to be on the same device" in out
    assert "first_loss=nan" in out and "grad_max=inf" in out

    # the BN table and the summary
    assert "BN running_var relative error vs the global-batch reference" in out
    table_row = next(line for line in out.splitlines() if line.startswith("bn1"))
    assert table_row.split() == ["bn1", "0.1312", "2.400e-07", "16"]
    assert out.rstrip().splitlines()[-1] == "summary: 1 critical, 2 high, 0 medium, 1 low, 0 info (4 findings)"


def test_text_with_colour_uses_escape_codes(report):
    out = render_text(report, color=True, width=120)
    assert "\x1b[" in out
    assert "DD902" in out


def test_empty_report_says_nothing_was_found():
    probe_run = render(Report(script="train.py", environment=dict(ENV)), "text", color=False)
    assert "No findings: static analysis and a 2-rank probe run found nothing to report." in probe_run
    assert probe_run.rstrip().endswith("summary: no findings")
    static = render(Report(script="t.py", environment={"nproc": 2, "static_only": True}), "text", color=False)
    assert "environment: static analysis only (the script was not run)" in static
    assert "No findings: static analysis found nothing to report." in static


def test_text_tolerates_missing_environment_and_malformed_tables():
    rep = Report(
        script="train.py",
        environment={},
        findings=(
            Finding(
                rule="DD903",
                severity=Severity.INFO,
                confidence=Confidence.CERTAIN,
                message="No rank initialised a process group.",
                fix="f",
                sources=("probe",),
                evidence={"nested": {"a": {"b": 1}}},
            ),
        ),
        tables={
            "broken": "not a table",
            "no_rows": {"columns": ["a"], "rows": []},
            "short": {"columns": ["a", "b"], "rows": [[1]]},
        },
    )
    out = render(rep, "text", color=False)
    assert "environment: unknown" in out
    assert "INFO (1)" in out and "(+1 more evidence item: -v shows all, as does --format json)" in out
    assert "summary: 0 critical, 0 high, 0 medium, 0 low, 1 info (1 finding)" in out


def test_format_ranks_compresses_runs():
    assert format_ranks([3, 0, 1, 2, 6, 8, 9]) == "0-3, 6, 8-9"
    assert format_ranks([5]) == "5"


# ---------------------------------------------------------------- json


def test_json_follows_the_spec_shape(report):
    data = strict_loads(render(report, "json", color=False))
    assert data["schema"] == "ddpdoctor.report/1"
    assert data["tool"] == {"name": "ddpdoctor", "version": __version__}
    assert data["target"] == {"script": "train.py", "args": ["--epochs", "90", "--data", "/data/image net"]}
    assert data["environment"] == ENV
    assert data["summary"] == {"critical": 1, "high": 2, "medium": 0, "low": 1, "info": 0}
    assert [f["rule"] for f in data["findings"]] == ["DD902", "DD301", "DD406", "DD502"]
    spec_keys = {"rule", "name", "severity", "confidence", "source", "file", "line", "ranks", "message"}
    spec_keys |= {"evidence", "fix"}
    for f in data["findings"]:
        assert spec_keys <= set(f)
    dd301 = data["findings"][1]
    assert dd301["name"] == "sampler-not-reshuffled" and dd301["source"] == "static+probe"
    assert dd301["file"] == "train.py" and dd301["line"] == 41 and dd301["ranks"] == [0, 1]
    assert data["notes"] == list(report.notes)
    assert data["tables"]["bn_errors"]["rows"][0] == ["bn1", 0.1312, 2.4e-7, 16]


def test_json_is_strict_even_with_non_finite_or_numpy_like_evidence(report):
    class Scalar:  # what scipy hands back: a numpy scalar with .item()
        def item(self):
            return 0.25

    rep = Report(
        script="train.py",
        findings=(
            Finding(
                rule="DD203",
                severity=Severity.HIGH,
                confidence=Confidence.CERTAIN,
                message="m",
                fix="f",
                sources=("probe",),
                evidence={"p": Scalar(), "ranks": {1, 0}, "var": float("nan"), "path": Path("a/b.py")},
            ),
        ),
    )
    data = strict_loads(render(rep, "json", color=False))
    assert data["findings"][0]["evidence"] == {"p": 0.25, "ranks": [0, 1], "var": "NaN", "path": "a/b.py"}
    nan_report = strict_loads(render(report, "json", color=False))
    ev = nan_report["findings"][2]["evidence"]
    assert ev == {"first_loss": "NaN", "grad_max": "Infinity", "bn_var_min": "-Infinity"}
    assert math.isnan(report.findings[2].evidence["first_loss"])  # the report itself is untouched


# ---------------------------------------------------------------- sarif


@pytest.fixture(scope="module")
def sarif_validator():
    schema = json.loads(SCHEMA_COPY.read_text(encoding="utf-8"))
    return jsonschema.Draft4Validator(schema)


def test_schema_copy_matches_shared():
    if not SCHEMA_SHARED.is_file():
        pytest.skip("../shared is not beside this clone")
    assert SCHEMA_COPY.read_bytes() == SCHEMA_SHARED.read_bytes()


def test_sarif_validates_and_describes_each_used_rule_once(report, sarif_validator, tmp_path):
    text = render(report, "sarif", color=False, base_dir=tmp_path)
    log = strict_loads(text)
    sarif_validator.validate(log)  # raises with the failing path
    assert log["version"] == "2.1.0"
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "ddpdoctor" and driver["version"] == __version__
    assert driver["informationUri"] == "https://github.com/ddpdoctor/ddpdoctor"
    ids = [r["id"] for r in driver["rules"]]
    assert ids == ["DD301", "DD406", "DD502", "DD902"]
    dd301 = driver["rules"][0]
    assert dd301["name"] == "sampler-not-reshuffled"
    assert dd301["shortDescription"]["text"] == get_rule("DD301").summary
    assert dd301["help"]["text"] == get_rule("DD301").documentation()
    assert "```python" in dd301["help"]["markdown"]
    assert dd301["defaultConfiguration"]["level"] == "error"
    assert dd301["properties"]["severity"] == "high" and dd301["properties"]["category"] == "data"

    results = run["results"]
    assert [r["ruleId"] for r in results] == ["DD902", "DD301", "DD406", "DD502"]
    for r in results:
        assert driver["rules"][r["ruleIndex"]]["id"] == r["ruleId"]
    assert [r["level"] for r in results] == ["error", "error", "error", "note"]

    r301 = results[1]
    assert r301["message"]["text"].startswith("Epochs 0 and 1 iterated")
    assert r301["message"]["text"].endswith("Fix: " + get_rule("DD301").fix)
    loc = r301["locations"][0]["physicalLocation"]
    assert loc == {"artifactLocation": {"uri": "train.py", "uriBaseId": "SRCROOT"}, "region": {"startLine": 41}}
    assert r301["properties"]["confidence"] == "certain"
    assert r301["properties"]["sources"] == ["static", "probe"] and r301["properties"]["ranks"] == [0, 1]
    assert r301["properties"]["evidence"]["identical_orders"] == 2

    # no file: the result points at the script, without a region
    r902 = results[0]
    assert r902["locations"][0]["physicalLocation"] == {
        "artifactLocation": {"uri": "train.py", "uriBaseId": "SRCROOT"}
    }
    assert "traceback" in r902["properties"]["evidence"]
    assert results[2]["properties"]["evidence"]["first_loss"] == "NaN"
    # a path with a space is a valid URI reference
    assert results[3]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "utils/ckpt%20io.py"

    assert run["originalUriBaseIds"]["SRCROOT"]["uri"] == tmp_path.resolve().as_uri() + "/"
    (invocation,) = run["invocations"]
    assert invocation["executionSuccessful"] is True
    assert invocation["toolExecutionNotifications"][0]["message"]["text"] == report.notes[0]
    assert run["properties"]["environment"]["backend"] == "gloo"


@pytest.mark.parametrize(
    ("severity", "level"),
    [("critical", "error"), ("high", "error"), ("medium", "warning"), ("low", "note"), ("info", "note")],
)
def test_sarif_levels(severity, level, sarif_validator):
    finding = Finding(
        rule="DD201",
        severity=Severity.parse(severity),
        confidence=Confidence.CERTAIN,
        message="m",
        fix="f",
        sources=("probe",),
    )
    log = sarif_log(Report(script="train.py", findings=(finding,)))
    sarif_validator.validate(log)
    assert log["runs"][0]["results"][0]["level"] == level


def test_empty_sarif_is_valid(sarif_validator):
    log = strict_loads(render(Report(script="train.py"), "sarif", color=False))
    sarif_validator.validate(log)
    assert log["runs"][0]["results"] == [] and log["runs"][0]["tool"]["driver"]["rules"] == []


def test_artifact_location_relative_inside_root_absolute_outside(tmp_path):
    inside = tmp_path / "src" / "train.py"
    assert artifact_location(str(inside), tmp_path) == {"uri": "src/train.py", "uriBaseId": "SRCROOT"}
    outside = tmp_path.parent / "elsewhere" / "train.py"
    assert artifact_location(str(outside), tmp_path) == {"uri": outside.resolve().as_uri()}
    assert artifact_location("../x.py", tmp_path / "a") == {"uri": (tmp_path / "x.py").resolve().as_uri()}


# ---------------------------------------------------------------- formats


def test_unknown_format_is_a_usage_error(report):
    with pytest.raises(UsageError):
        render(report, "xml", color=False)
    with pytest.raises(UsageError):
        render_rules("sarif", color=False)


def test_render_rules_json_and_text():
    rules = strict_loads(render_rules("json", color=False))
    assert len(rules) == len(RULES)
    dd204 = next(r for r in rules if r["rule"] == "DD204")
    assert dd204["name"] == "syncbn-large-batch" and dd204["severity"] == "low"
    assert dd204["category"] == "batchnorm" and dd204["static"] is False and dd204["probe"] is True
    assert dd204["summary"] == get_rule("DD204").summary
    text = render_rules("text", color=False)
    assert "\x1b[" not in text
    for code in ("DD101", "DD204", "DD504", "DD903"):
        assert code in text
    assert "ddpdoctor explain CODE" in text
