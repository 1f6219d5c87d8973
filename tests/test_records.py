"""The run directory's JSON files as typed records (ddpdoctor.records): every recorded run reads and writes back
unchanged, RunMeta is what META_KEYS documents, and a record reads like the dict it replaces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpdoctor.events import META_KEYS
from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.records import LaunchRecord, RunMeta, StaticRecord

RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "runs"
RECORDED = sorted(p for p in RUNS.iterdir() if (p / "meta.json").is_file())


def test_run_meta_is_what_meta_keys_documents():
    assert set(RunMeta._field_names()) == set(META_KEYS)


@pytest.mark.parametrize("run", RECORDED, ids=lambda p: p.name)
def test_recorded_files_read_and_write_back_unchanged(run: Path):
    meta = json.loads((run / "meta.json").read_text(encoding="utf-8"))
    assert RunMeta.from_json(meta).to_json() == meta
    if (run / "launcher.json").is_file():
        launch = json.loads((run / "launcher.json").read_text(encoding="utf-8"))
        assert LaunchRecord.from_json(launch).to_json() == launch
    if (run / "static.json").is_file():
        static = json.loads((run / "static.json").read_text(encoding="utf-8"))
        record = StaticRecord.from_json(static)
        if isinstance(static, list):  # recorded before static.json held notes: a bare list of findings
            assert [f.to_json() for f in record.findings] == [Finding.from_json(item).to_json() for item in static]
        else:
            assert list(record.notes) == static.get("notes", [])
            assert [f.to_json() for f in record.findings] == [
                Finding.from_json(item).to_json() for item in static["findings"]
            ]


def test_keys_this_version_does_not_know_are_kept():
    meta = RunMeta.from_json({"mode": "torchrun", "nproc": 4, "from_a_newer_version": {"x": 1}})
    assert (meta.mode, meta.nproc, meta.extra) == ("torchrun", 4, {"from_a_newer_version": {"x": 1}})
    assert meta.to_json() == {"mode": "torchrun", "nproc": 4, "from_a_newer_version": {"x": 1}}


def test_a_record_reads_like_the_dict_it_replaces():
    meta = RunMeta.from_json({"mode": "attach", "epochs": 0})
    assert meta.get("mode") == "attach" and meta["epochs"] == 0 and meta.epochs == 0
    assert "keep_run" not in meta and meta.get("keep_run") is None and meta.keep_run is None  # absent, not null
    assert not RunMeta.from_json({}) and RunMeta.from_json({}).device is None
    written = RunMeta(mode="torchrun", nproc=2)
    assert "keep_run" in written and written["keep_run"] is None  # a check's run: kept nowhere
    changed = RunMeta.from_json({"mode": "spawn"}).updated(mode="torchrun", sources={"a.py": "source/a.py"})
    assert changed.to_json() == {"mode": "torchrun", "sources": {"a.py": "source/a.py"}}
    launch = LaunchRecord.from_json({"returncode": -9, "timed_out": True, "agent": {"pid": 7}})
    assert launch.timed_out and launch.get("agent") == {"pid": 7} and launch.get("interrupted") is None


def test_static_record_has_the_notes_and_reads_old_runs():
    f = Finding(rule="DD301", severity=Severity.HIGH, confidence=Confidence.CERTAIN, message="m", fix="x",
                file="t.py", line=3, magnitude=2.0)
    record = StaticRecord(findings=(f,), notes=("static rule DD999 failed on t.py: KeyError: 'x'",))
    again = StaticRecord.from_json(json.loads(json.dumps(record.to_json())))
    assert again.notes == record.notes and again.findings[0].to_json() == f.to_json()
    old = StaticRecord.from_json([f.to_json()])  # runs recorded before notes: a bare list
    assert old.notes == () and old.findings[0].magnitude == 2.0
