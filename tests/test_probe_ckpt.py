"""The checkpoint recorder (ddpdoctor/probe/recorders/checkpoint.py): in this process, and the real probe on 2 CPU
ranks over fixtures/probe/ckpt/ (recorded as fixtures/runs/ckpt_*/ by `python -m ddpdoctor.dev.record`)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from ddpdoctor.probe.recorders import checkpoint

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "fixtures" / "runs"


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[Any]:
    from ddpdoctor.probe.session import Probe
    from ddpdoctor.probe.settings import ProbeSettings

    p = Probe(ProbeSettings(run_dir=str(tmp_path / "run"), epochs=0, steps=0), role="rank")
    try:
        checkpoint.install(p)
        yield p
    finally:
        p.patcher.undo()


def events(probe: Any, kind: str) -> list[dict[str, Any]]:
    path = probe.writer.path
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind] if path.exists() else []


def test_state_dicts_are_found_in_the_object_or_one_level_down() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    wrapped = {f"module.{k}": v for k, v in net.state_dict().items()}
    assert checkpoint.state_dicts_in(wrapped)[0] == {"key": "", "keys": 2, "module_prefixed": 2,
                                                     "first_keys": ["module.0.weight", "module.0.bias"]}
    nested = checkpoint.state_dicts_in(
        {"epoch": 3, "model": net.state_dict(), "opt": {"state": {}, "param_groups": []}}
    )
    assert [(s["key"], s["keys"], s["module_prefixed"]) for s in nested] == [("model", 2, 0)]
    assert checkpoint.state_dicts_in([1, 2]) == []


def test_saves_are_written_where_the_script_says_and_recorded(probe: Any, tmp_path: Path) -> None:
    net = nn.Linear(2, 1)
    target = tmp_path / "out" / "ckpt.pt"
    target.parent.mkdir()
    target.write_bytes(b"old")
    torch.save({"model": {f"module.{k}": v for k, v in net.state_dict().items()}}, target)
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    assert torch.load(target)["model"]["module.weight"].shape == (1, 2)  # the real file, rewritten
    first, second = events(probe, "checkpoint_save")
    assert first["abspath"] == str(target) and first["existed"] is True and first["size_before"] == 3
    assert first["bytes"] == target.stat().st_size and first["error"] is None
    assert first["state_dicts"][0]["key"] == "model" and first["state_dicts"][0]["module_prefixed"] == 2
    assert first["site"]["file"] == __file__
    assert second["abspath"] is None and second["target"] == "BytesIO"
    assert second["state_dicts"][0]["module_prefixed"] == 0


def test_non_strict_loads_report_the_skipped_keys(probe: Any) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    prefixed = {f"module.{k}": v for k, v in net.state_dict().items()}
    result = net.load_state_dict(prefixed, strict=False)
    # the user still gets the real result; BatchNorm does not report num_batches_tracked as missing
    assert len(result.missing_keys) == 6
    with pytest.raises(RuntimeError):
        net.load_state_dict(prefixed)
    net.load_state_dict(net.state_dict(), strict=False)
    skipped, raised, clean = events(probe, "state_dict_load")
    assert skipped["strict"] is False and skipped["missing"] == 6 and skipped["unexpected"] == 7
    assert skipped["model_keys"] == 7 and skipped["matched"] == 0
    assert skipped["match_without_prefix"] == 7 and skipped["given_prefixed"] == 7
    assert raised["strict"] is True and "Missing key" in raised["error"]
    assert clean["missing"] == 0 and clean["unexpected"] == 0


def test_an_override_that_calls_super_is_recorded_once(probe: Any) -> None:
    class Net(nn.Linear):
        def load_state_dict(self, state_dict, strict=True, assign=False):  # noqa: ANN001
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    net = Net(2, 1)
    net.load_state_dict({}, strict=False)
    (load,) = events(probe, "state_dict_load")
    assert load["module_class"] == "Net" and load["missing"] == 2


# ------------------------------------------------------------------------------------------------ the real probe

CKPT_FIXTURES = {
    "save_every_rank": ({"DD501", "DD502", "DD503"}, set()),
    "save_rank0": (set(), {"DD501", "DD502", "DD503"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CKPT_FIXTURES))
def test_probe_finds_the_checkpoint_rules(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpdoctor.check import run_check
    from ddpdoctor.config import CheckConfig

    if name != "save_every_rank":
        pytest.skip("replayed from fixtures/runs (recorded by python -m ddpdoctor.dev.record)")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    report = run_check(CheckConfig(script=Path(f"fixtures/probe/ckpt/{name}.py"), script_args=(str(out),),
                                   device="cpu", nproc=2, timeout=600, keep_run=run_dir))
    fire, silent = CKPT_FIXTURES[name]
    probe_rules = {f.rule for f in report.findings if "probe" in f.sources}
    assert fire <= probe_rules, report.to_json()["findings"]
    assert not (silent & probe_rules)
    # the script's file went to the run directory (its writes are redirected), the folder it named stays empty
    assert list(out.iterdir()) == []
    assert sorted(p.name for p in (run_dir / "writes" / str(out).lstrip("/")).iterdir())[0] == "last.pt"
    for f in report.findings:
        if f.rule in fire:
            assert f.sources == ("static", "probe") and f.confidence.label == "certain"


@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)),
                                  lambda: nn.TransformerEncoderLayer(8, 2), lambda: nn.LSTM(3, 4, 2)])
def test_module_keys_match_state_dict_without_calling_it(make) -> None:  # noqa: ANN001
    module = make()
    assert checkpoint.module_keys(module) == list(module.state_dict().keys())
