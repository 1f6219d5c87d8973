"""Each rule's probe fixtures on 2 real gloo ranks: every `fixtures/probe/ddnnn/bad_*.py` makes the probe report
DDNNN, every `good_*.py` beside it does not. One test for every rule's folder, so a new rule's probe half needs its
fixtures and no test module of its own (CONTRIBUTING "Adding a rule")."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpdoctor.check import run_check
from ddpdoctor.config import CheckConfig
from ddpdoctor.dev.evidence import REPO, probe_fixtures

SCRIPTS = probe_fixtures()  # every rule's fixtures/probe/ddnnn/{bad,good}_*.py (the index of the rules' evidence)
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_probe_finds_the_rule_on_bad_scripts_only(script: Path, tmp_path: Path, monkeypatch):
    code = script.parent.name.upper()
    monkeypatch.chdir(REPO)
    cfg = CheckConfig(script=script.relative_to(REPO), nproc=2, timeout=90.0, keep_run=tmp_path / "run")
    found = {f.rule for f in run_check(cfg).findings if "probe" in f.sources}
    assert (code in found) == script.name.startswith("bad_"), sorted(found)
