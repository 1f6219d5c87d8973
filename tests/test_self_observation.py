"""ddpdoctor never observes itself: what the probe's own code reads, writes or calls (inside a recorder, under
`probe.safely`) is never attributed to a line of the user's script (issue 20). The case that went wrong: the legacy
`--local_rank` override reads LOCAL_RANK inside ddpdoctor's `parse_known_args` wrapper, the env-read recorder walked
past ddpdoctor's frames to the script's `parser.parse_known_args()` line, and DD108 was cleared "because the script
reads LOCAL_RANK itself" on a script that never does. Fast: one in-process probe, no ranks."""

from __future__ import annotations

import json
import runpy
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest

from ddpdoctor.probe.recorders import cli_args
from ddpdoctor.probe.session import Probe
from ddpdoctor.probe.settings import ProbeSettings


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Probe]:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr("sys.argv", ["train.py"])
    p = Probe(ProbeSettings(run_dir=str(tmp_path / "run"), epochs=0, steps=0, mode="torchrun"), role="rank")
    try:
        cli_args.install(p)
        yield p
    finally:
        p.patcher.undo()


def _events(probe: Probe, kind: str) -> list[dict[str, Any]]:
    path = probe.writer.path
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind] if path.exists() else []


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "proj" / "train.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def test_the_probes_own_local_rank_read_is_not_the_scripts(probe: Probe, tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--local_rank", type=int, default=0)
        args, unknown = parser.parse_known_args()
    """)
    runpy.run_path(str(script), run_name="__main__")
    assert _events(probe, "env_read") == []
    [arg] = _events(probe, "local_rank_arg")
    assert arg["value"] == 0 and arg["env_local_rank"] == "1"


def test_the_scripts_own_read_after_parsing_is_still_recorded(probe: Probe, tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import argparse, os
        parser = argparse.ArgumentParser()
        parser.add_argument("--local_rank", type=int, default=0)
        args, unknown = parser.parse_known_args()
        local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    """)
    runpy.run_path(str(script), run_name="__main__")
    [read] = _events(probe, "env_read")
    assert read["site"]["file"] == str(script) and read["site"]["line"] == 6 and read["value"] == "1"


def test_anything_read_inside_recorder_code_is_ddpdoctors(probe: Probe) -> None:
    import os

    probe.safely("test", lambda: os.environ["LOCAL_RANK"])
    probe.safely("test", lambda: "LOCAL_RANK" in os.environ)
    assert _events(probe, "env_read") == []
    assert probe.recording == 0
