"""Checkpoint analyses (DD501–DD503) replayed from recorded probe runs (fixtures/runs/ckpt_*, recorded by
tests/test_probe_ckpt.py from fixtures/probe/ckpt/), plus the multi-node case a single-node probe cannot record,
built as event logs by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddpdoctor.analyses import analyze_run
from ddpdoctor.check import report_run
from ddpdoctor.events import SCHEMA
from ddpdoctor.findings import Confidence, Severity

RUNS = Path(__file__).resolve().parent.parent / "fixtures" / "runs"
SITE = {"file": "/w/train.py", "line": 50, "function": "<module>"}


def probe_findings(run: str | Path, rule: str) -> list:
    path = run if isinstance(run, Path) else RUNS / run
    return [f for f in analyze_run(path).findings if f.rule == rule]


def make_run(tmp_path: Path, per_rank: dict[int, tuple[str, list[dict[str, Any]]]]) -> Path:
    """rank -> (host, events): one log per rank, named after its host as the probe names them."""
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"schema": SCHEMA, "script": "train.py", "script_abs": "/w/train.py",
                                               "cwd": "/w", "nproc": len(per_rank), "mode": "attach"}))
    for r, (host, evs) in per_rank.items():
        pid = 100 + r
        head = [{"kind": "process_start", "role": "attached", "host": host},
                {"kind": "pg_init", "ok": True, "rank": r, "world_size": len(per_rank)}]
        lines = [{"t": 1.0 + i, "pid": pid, "seq": i + 1, "rank": r, **e} for i, e in enumerate(head + evs)]
        (run / "events" / f"{host}-p{pid}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return run


def save(local_rank: int, path: str = "/shared/ckpt.pt", t: float = 10.0) -> dict[str, Any]:
    return {"kind": "checkpoint_save", "site": SITE, "path": path, "abspath": path, "target": "str",
            "existed": False, "bytes": 1000, "object": "dict", "state_dicts": [], "local_rank": local_rank,
            "t_start": t, "seconds": 0.5, "error": None}


# ------------------------------------------------------------------------------------------------ DD501


def test_dd501_module_prefixed_state_dict_under_a_key() -> None:
    (f,) = probe_findings("ckpt_save_every_rank", "DD501")
    assert f.evidence["state_dict_key"] == "model" and f.evidence["keys"] == 4 and f.evidence["module_prefixed"] == 4
    assert f.evidence["saves"] == 4 and f.ranks == (0, 1) and f.line == 35
    assert "loaded 0 of the model's 4 keys" in f.message  # the consequence, measured in the same run


def test_dd501_silent_for_the_unwrapped_state_dict() -> None:
    assert probe_findings("ckpt_save_rank0", "DD501") == []


def _prefixed_save() -> dict[str, Any]:
    sd = {"key": "model", "keys": 4, "module_prefixed": 4, "first_keys": ["module.fc.weight"]}
    return {**save(0, "/w/ckpt.pt"), "state_dicts": [sd]}


def _load(is_ddp: bool) -> dict[str, Any]:
    return {"kind": "state_dict_load", "site": {**SITE, "line": 20}, "module_class": "DDP" if is_ddp else "Net",
            "is_ddp": is_ddp, "strict": True, "given_keys": 4, "model_keys": 4, "missing": 0 if is_ddp else 4,
            "unexpected": 0 if is_ddp else 4, "given_prefixed": 4, "model_prefixed": 4 if is_ddp else 0,
            "matched": 4 if is_ddp else 0, "match_without_prefix": 0 if is_ddp else 4, "match_with_prefix": 0,
            "error": None, "step": 0}


def test_dd501_is_low_when_the_run_loads_it_back_only_into_the_wrapper(tmp_path: Path) -> None:
    # a resume checkpoint: the script's own use of it works, what breaks is another program's (issue 20: medium on
    # every resume-into-the-wrapper recipe made correct scripts fail the default gate)
    (f,) = probe_findings(make_run(tmp_path, {0: ("h", [_load(True), _prefixed_save()])}), "DD501")
    assert f.severity == Severity.LOW and "loads it back into the DDP wrapper" in f.message


def test_dd501_stays_medium_without_a_load_or_with_a_plain_one(tmp_path: Path) -> None:
    (f,) = probe_findings(make_run(tmp_path / "a", {0: ("h", [_prefixed_save()])}), "DD501")
    assert f.severity == Severity.MEDIUM
    (g,) = probe_findings(make_run(tmp_path / "b", {0: ("h", [_prefixed_save(), _load(False)])}), "DD501")
    assert g.severity == Severity.MEDIUM


# ------------------------------------------------------------------------------------------------ DD502


def test_dd502_every_rank_writes_the_same_file() -> None:
    (f,) = probe_findings("ckpt_save_every_rank", "DD502")
    assert f.evidence["writers"] == [0, 1] and f.evidence["saves_per_rank"] == {"0": 2, "1": 2}
    assert f.evidence["path"].endswith("/out/last.pt") and f.severity == Severity.LOW
    assert "every rank (ranks 0, 1)" in f.message


def test_dd502_silent_for_rank0_saves_and_per_rank_files() -> None:
    assert probe_findings("ckpt_save_rank0", "DD502") == []


def test_the_report_says_where_the_probe_run_saved() -> None:
    notes = analyze_run(RUNS / "ckpt_save_rank0").notes
    (note,) = [n for n in notes if "saved checkpoints" in n]
    assert "last.pt (rank 0)" in note and "rng_rank0.pt (rank 0)" in note and "rng_rank1.pt (rank 1)" in note


def test_dd502_local_rank_0_of_every_node(tmp_path: Path) -> None:
    run = make_run(tmp_path, {0: ("node-a", [save(0, t=10.0)]), 1: ("node-a", []),
                              2: ("node-b", [save(0, t=10.2)]), 3: ("node-b", [])})
    (f,) = probe_findings(run, "DD502")
    assert f.ranks == (0, 2) and f.evidence["hosts"] == ["node-a", "node-b"]
    assert f.evidence["overlapping_writes"] == 1
    assert "local rank 0 of each of 2 nodes" in f.message


# ------------------------------------------------------------------------------------------------ DD503


def test_dd503_strict_false_loaded_nothing() -> None:
    (f,) = probe_findings("ckpt_save_every_rank", "DD503")
    # nothing loaded: the whole run trains from the random initialisation (critical: ranks above any high finding
    # about batch statistics on the same run, issue 20)
    assert f.severity == Severity.CRITICAL
    assert f.evidence["missing"] == 4 and f.evidence["model_keys"] == 4 and f.evidence["loaded"] == 0
    assert f.evidence["match_without_module_prefix"] == 4 and f.evidence["calls"] == 4
    assert "start with \"module.\"" in f.message and f.magnitude == 1.0


def test_dd503_silent_when_only_unexpected_keys_were_ignored() -> None:
    assert probe_findings("ckpt_save_rank0", "DD503") == []


def test_checkpoint_findings_merge_with_static_analysis() -> None:
    merged = {f.rule: f for f in report_run(RUNS / "ckpt_save_every_rank").findings}
    for rule in ("DD501", "DD502", "DD503"):
        assert merged[rule].sources == ("static", "probe") and merged[rule].confidence == Confidence.CERTAIN
    order = [f.rule for f in report_run(RUNS / "ckpt_save_every_rank").ranked()]
    assert order.index("DD503") < order.index("DD501") < order.index("DD502")  # critical, medium, low


def test_dd503_strict_false_loads_that_loaded_every_key_clear_the_static_finding() -> None:
    assert probe_findings("ckpt_save_rank0", "DD503") == []
    report = report_run(RUNS / "ckpt_save_rank0")
    assert "DD503" not in {f.rule for f in report.findings}
    assert (
        "static DD503 at fixtures/probe/ckpt/save_rank0.py:45 cleared by the probe: load_state_dict(strict=False) "
        "loaded all 4 keys of Sequential (4 loads on ranks 0, 1, 0 missing, 1 unexpected checkpoint key ignored)"
    ) in report.notes


def _save_of(key: str | None, first_keys: list[str], keys: int, prefixed: int, line: int) -> dict[str, Any]:
    sd = {"key": key, "keys": keys, "module_prefixed": prefixed, "first_keys": first_keys}
    return {**save(0, f"/w/ckpt{line}.pt"), "site": {**SITE, "line": line}, "state_dicts": [sd]}


def test_dd501_is_info_when_the_run_also_saves_the_plain_backbone(tmp_path: Path) -> None:
    # a self-supervised pretrainer: the resume checkpoint from the wrapper, and the backbone's plain weights
    # saved beside it for every other consumer (issue 20's trial: DD501 stayed although the probe saw both)
    resume = _save_of("model", ["module.backbone.conv.weight", "module.backbone.bn.weight", "module.head.weight"],
                      6, 6, 50)
    plain = _save_of(None, ["conv.weight", "bn.weight"], 4, 0, 60)
    (f,) = probe_findings(make_run(tmp_path / "a", {0: ("h", [resume, plain])}), "DD501")
    assert f.severity == Severity.INFO and "also saved 4 plain keys" in f.message
    other = _save_of(None, ["classifier.weight", "classifier.bias"], 2, 0, 60)
    (f,) = probe_findings(make_run(tmp_path / "b", {0: ("h", [resume, other])}), "DD501")
    assert f.severity == Severity.MEDIUM
