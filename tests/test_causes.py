"""Root causes first: the declared 'explains' relation, the per-run evidence check, and how folded consequences
appear in text, JSON and SARIF."""

from __future__ import annotations

import json

from ddpdoctor.causes import EXPLAINS, Explains, flatten, fold_consequences, relations
from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.report import Report
from ddpdoctor.report.render import render
from ddpdoctor.rules import get_rule


def make(rule: str, severity: Severity = Severity.HIGH, **kw) -> Finding:
    base = {"rule": rule, "severity": severity, "confidence": Confidence.CERTAIN, "message": f"{rule} message",
                "fix": f"{rule} fix", "sources": ("probe",), "file": "train.py", "line": 10}
    base.update(kw)
    return Finding(**base)


def test_relation_is_declared_over_catalog_codes_and_acyclic() -> None:
    graph = relations()
    for cause, effects in graph.items():
        get_rule(cause)
        for effect in effects:
            get_rule(effect)
            assert effect != cause
    state: dict[str, int] = {}

    def visit(code: str) -> None:
        assert state.get(code) != 1, f"cycle through {code}"
        if state.get(code) == 2:
            return
        state[code] = 1
        for nxt in graph.get(code, ()):
            visit(nxt)
        state[code] = 2

    for code in graph:
        visit(code)


def test_dd110_folds_dd203_only_when_the_replicas_diverged() -> None:
    cause = make("DD110", Severity.CRITICAL, evidence={"replicas_diverged": True, "max_param_diff": 0.3})
    symptom = make("DD203", evidence={"replicas_diverged": True})
    (top,) = fold_consequences([symptom, cause])
    assert top.rule == "DD110" and [c.finding.rule for c in top.consequences] == ["DD203"]
    assert "diverged" in top.consequences[0].because

    identical = make("DD110", Severity.CRITICAL, evidence={"replicas_diverged": False})
    out = fold_consequences([make("DD203", evidence={"replicas_diverged": False}), identical])
    assert [f.rule for f in out] == ["DD110", "DD203"] and not out[0].consequences


def test_dd108_folds_a_crash_on_the_default_local_rank_unless_the_probe_overrode_it() -> None:
    per_rank = {str(r): {"default": -1, "value": -1, "LOCAL_RANK": str(r)} for r in (0, 1)}
    crash = make("DD902", Severity.CRITICAL, evidence={"root_cause": {
        "type": "RuntimeError", "message": "Expected a torch.device with a specified index or an integer, but got:-1"}})
    cause = make("DD108", Severity.MEDIUM, evidence={"per_rank": per_rank, "injected_by_probe": False,
                                                     "overridden_by_probe": {}})
    (top,) = fold_consequences([crash, cause])
    assert top.rule == "DD108" and top.severity == Severity.CRITICAL
    assert [c.finding.rule for c in top.consequences] == ["DD902"] and "-1" in top.consequences[0].because

    other = make("DD902", Severity.CRITICAL, evidence={"root_cause": {"type": "KeyError", "message": "'lr'"}})
    assert [f.rule for f in fold_consequences([other, cause])] == ["DD902", "DD108"]
    overridden = make("DD108", Severity.MEDIUM, evidence={"per_rank": per_rank, "overridden_by_probe": {"0": 0}})
    assert [f.rule for f in fold_consequences([crash, overridden])] == ["DD902", "DD108"]


def test_a_script_that_never_forms_a_process_group_explains_its_unsharded_data_and_shared_saves() -> None:
    """pytorch/examples' single_gpu.py launched on 2 ranks: DD302 (high) and DD502 ranked above DD903 (info), the
    finding that says why — each process is a run of its own."""
    cause = make("DD903", Severity.INFO, evidence={"process_group": False, "processes": 2})
    data, saves = make("DD302"), make("DD502", Severity.LOW)
    (top,) = fold_consequences([data, saves, cause])
    assert top.rule == "DD903" and top.severity == Severity.HIGH
    assert [c.finding.rule for c in top.consequences] == ["DD302", "DD502"]
    assert "never initialised a process group" in top.consequences[0].because
    formed = make("DD903", Severity.INFO, evidence={"process_group": True})  # a group, but no DDP: not this
    assert [f.rule for f in fold_consequences([make("DD302"), formed])] == ["DD302", "DD903"]


def test_chains_nest_and_the_cause_takes_the_worst_severity() -> None:
    relation = (
        Explains("DD305", "DD302", lambda c, y, fs: "split"),
        Explains("DD302", "DD304", lambda c, y, fs: "overlap"),
    )
    out = fold_consequences(
        [make("DD304", Severity.LOW), make("DD302", Severity.CRITICAL), make("DD305", Severity.MEDIUM)], relation
    )
    assert [f.rule for f in out] == ["DD305"]
    top = out[0]
    assert top.severity == Severity.CRITICAL and top.evidence["severity_from_consequence"] == "DD302"
    assert [f.rule for f in flatten(out)] == ["DD305", "DD302", "DD304"]


def test_without_its_cause_a_consequence_stays_a_finding() -> None:
    out = fold_consequences([make("DD203"), make("DD201", Severity.MEDIUM)])
    assert [f.rule for f in out] == ["DD203", "DD201"]


def _report() -> Report:
    cause = make("DD110", Severity.CRITICAL, evidence={"replicas_diverged": True, "max_param_diff": 0.25}, line=20)
    return Report(script="train.py", findings=tuple(fold_consequences([make("DD203", line=33), cause])))


def test_text_json_and_sarif_show_the_consequence_under_its_cause(tmp_path) -> None:
    report = _report()
    text = render(report, "text", color=False)
    assert text.index("DD110") < text.index("explains 1 more finding") < text.index("DD203")
    assert "because: the ranks' models had diverged" in text
    assert "(1 finding; 1 more explained by them)" in text

    data = json.loads(render(report, "json", color=False))
    assert [f["rule"] for f in data["findings"]] == ["DD110"]
    (c,) = data["findings"][0]["consequences"]
    assert c["rule"] == "DD203" and c["line"] == 33 and "diverged" in c["because"]
    assert data["summary"]["high"] == 0
    round_trip = Finding.from_json(data["findings"][0])
    assert round_trip.consequences[0].finding.rule == "DD203"

    sarif = json.loads(render(report, "sarif", color=False, base_dir=tmp_path))
    (result,) = sarif["runs"][0]["results"]
    assert result["ruleId"] == "DD110"
    (related,) = result["relatedLocations"]
    assert related["physicalLocation"]["region"]["startLine"] == 33
    assert related["message"]["text"].startswith("DD203 non-iid-shards (high, explained by DD110)")


def test_declared_relations_cover_the_issue_pairs() -> None:
    pairs = {(e.cause, e.consequence) for e in EXPLAINS}
    for pair in [("DD110", "DD103"), ("DD110", "DD201"), ("DD110", "DD203"), ("DD102", "DD103"),
                 ("DD102", "DD201"), ("DD102", "DD203"), ("DD104", "DD901")]:
        assert pair in pairs
