"""The conventions of the tools ML engineers already use (issue 22): `-h` everywhere, `--exit-zero` /
`--fail-on none`, `explain` with a prefix, SARIF `helpUri` into docs/rules.md, `--statistics`, `--format concise`
and `markdown`, `-v`. In-process through `ddpdoctor.cli.main(argv)` on the static path and on a recorded run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from ddpdoctor.cli import main
from ddpdoctor.consequences import explain_section
from ddpdoctor.rules import RULES, catalog_markdown_document, get_rule, help_uri

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "fixtures" / "demo" / "train.py"
DEMO_RUN = REPO / "fixtures" / "runs" / "demo"
SCHEMA = REPO / "tests" / "data" / "sarif-schema-2.1.0.json"
COMMANDS = ["check", "triage", "report", "rules", "explain", "compare-bn", "env"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [[], *([c] for c in COMMANDS)], ids=["ddpdoctor", *COMMANDS])
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_on_every_command(capsys, argv, flag):
    code, out, err = run(capsys, *argv, flag)
    assert (code, err) == (0, "")
    assert out.startswith("Usage: ddpdoctor") and "-h, --help" in out


def test_every_command_is_covered_by_the_help_test():
    from typer.main import get_command

    from ddpdoctor.cli import app

    assert sorted(get_command(app).commands) == sorted(COMMANDS)


def test_exit_zero_and_fail_on_none(capsys):
    code, out, _ = run(capsys, "check", "--static", str(DEMO))
    assert code == 1 and "DD104" in out
    for extra in (["--exit-zero"], ["--fail-on", "none"], ["--fail-on", "NONE"]):
        code, out2, err = run(capsys, "check", "--static", str(DEMO), *extra)
        assert (code, err) == (0, "") and out2 == out, extra
    code, _, err = run(capsys, "report", str(DEMO_RUN), "--exit-zero", "--format", "json")
    assert (code, err) == (0, "")
    code, _, err = run(capsys, "check", "--static", str(DEMO), "--fail-on", "nothing")
    assert code == 2 and len(err.splitlines()) == 1 and "none" in err


def test_fail_on_none_from_the_pyproject_table(tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text('[tool.ddpdoctor]\nfail_on = "none"\n', encoding="utf-8")
    script = tmp_path / "train.py"
    script.write_text(DEMO.read_text(encoding="utf-8"), encoding="utf-8")
    code, out, _ = run(capsys, "check", "--static", str(script))
    assert code == 0 and "DD104" in out


def test_explain_takes_a_prefix(capsys):
    code, out, err = run(capsys, "explain", "DD3")
    assert (code, err) == (0, "")
    data_rules = [r for r in RULES if r.code.startswith("DD3")]
    assert len(data_rules) > 1
    for r in data_rules:
        assert r.documentation() in out
    assert "DD101" not in out
    code, out, err = run(capsys, "explain", "dd30")
    assert code == 0 and out.index("DD301 ") < out.index("DD306 ")
    code, out, _ = run(capsys, "explain", "DD101")  # one rule: exactly its documentation and its measured cost
    assert out == get_rule("DD101").documentation() + explain_section(get_rule("DD101"))


@pytest.mark.parametrize("bad", ["DD7", "XX", "DD1015", " "])
def test_explain_unknown_prefix_is_one_line_exit_2(capsys, bad):
    code, out, err = run(capsys, "explain", bad)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("ddpdoctor: error: unknown rule or prefix")


def test_docs_rules_md_is_generated_and_has_an_anchor_per_rule():
    text = (REPO / "docs" / "rules.md").read_text(encoding="utf-8")
    assert text == catalog_markdown_document(), (
        "docs/rules.md is stale: regenerate it with `.venv/bin/python -m ddpdoctor.dev.rules_doc`")
    headings = re.findall(r"^## (\S+)$", text, flags=re.M)
    # GitHub's anchor of `## DD301` is `dd301`: the fragment help_uri gives
    assert headings == [r.code for r in RULES]
    for r in RULES:
        uri = help_uri(r.code)
        assert uri.endswith("/docs/rules.md#" + r.code.lower())


def test_sarif_rules_have_help_uri_and_still_validate(capsys):
    code, out, _ = run(capsys, "report", str(DEMO_RUN), "--format", "sarif")
    assert code == 1
    log = json.loads(out)
    jsonschema.Draft4Validator(json.loads(SCHEMA.read_text(encoding="utf-8"))).validate(log)
    rules = log["runs"][0]["tool"]["driver"]["rules"]
    assert rules and all(r["helpUri"] == help_uri(r["id"]) for r in rules)


def test_statistics_counts_per_rule(capsys):
    code, out, err = run(capsys, "check", "--static", str(DEMO), "--statistics")
    assert code == 1 and err == ""
    rows = [line.split() for line in out.splitlines()]
    assert sorted(r[1] for r in rows) == ["DD101", "DD104", "DD302", "DD401"]
    assert all(r[0] == "1" and r[2].startswith("[") and r[3] == get_rule(r[1]).name for r in rows)
    code, out, _ = run(capsys, "check", "--static", str(DEMO), "--statistics", "--format", "json")
    assert {(e["rule"], e["count"]) for e in json.loads(out)} == {(c, 1) for c in ("DD101", "DD104", "DD302",
                                                                                  "DD401")}
    code, _, err = run(capsys, "check", "--static", str(DEMO), "--statistics", "--format", "sarif")
    assert code == 2 and len(err.splitlines()) == 1


def test_format_concise_one_line_per_finding(capsys):
    code, out, err = run(capsys, "report", str(DEMO_RUN), "--format", "json")
    findings = json.loads(out)["findings"]
    code, out, err = run(capsys, "report", str(DEMO_RUN), "--format", "concise")
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert len(lines) == len(findings)
    pattern = re.compile(r"^(?P<where>\S+): (?P<rule>DD\d{3}) \[(?P<sev>[a-z]+)\] (?P<msg>.+)$")
    for line, f in zip(lines, findings):
        m = pattern.match(line)
        assert m, line
        assert (m["rule"], m["sev"]) == (f["rule"], f["severity"])
        if f["file"]:
            assert m["where"] == f"{f['file']}:{f['line']}"


def test_format_markdown_is_a_report_to_paste(capsys):
    code, out, err = run(capsys, "report", str(DEMO_RUN), "--format", "markdown")
    assert code == 1 and err == ""
    findings = json.loads(run(capsys, "report", str(DEMO_RUN), "--format", "json")[1])["findings"]
    assert out.startswith("### ddpdoctor check: `")
    assert f"**{len(findings)} findings: " in out
    for f in findings:
        assert f"{f['rule']} {f['name']}" in out
        assert f"**Fix:** {f['fix']}" in out
    assert out.count("<details>") + out.count("<details open>") == out.count("</details>")
    assert "<summary>Evidence</summary>" in out
    assert "<summary>Environment</summary>" in out and "torch: " in out
    assert out.count("```") % 2 == 0  # every fence closed
    tables = [line for line in out.splitlines() if line.startswith("|")]
    assert tables and all(line.endswith("|") for line in tables)


def test_verbose_shows_every_evidence_item(capsys):
    _, short, _ = run(capsys, "report", str(DEMO_RUN))
    assert "more evidence item" in short and "-v shows all" in short
    code, full, err = run(capsys, "report", str(DEMO_RUN), "-v")
    assert code == 1 and err == ""
    assert "more evidence item" not in full
    findings = json.loads(run(capsys, "report", str(DEMO_RUN), "--format", "json")[1])["findings"]
    for f in findings:
        for key in f["evidence"]:
            assert f"{key}:" in full, (f["rule"], key)
