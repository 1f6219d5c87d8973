"""Scripts built on Lightning, Accelerate and the Hugging Face Trainer (issue 21).

Static analysis reads them through the models of apis/frameworks.py (the fixtures in fixtures/static/frameworks/
and fixtures/static/DD904/ carry their `# expect:` markers and run in tests/test_static_fixtures.py); here: the
command line never gives such a script, or one whose engine is not modelled, a false "No findings", and the
static path never imports a framework.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

REPO = Path(__file__).resolve().parent.parent
STATIC = REPO / "fixtures" / "static"
FRAMEWORK_MODULES = ("lightning", "pytorch_lightning", "accelerate", "transformers", "deepspeed")


def _check_static(path: Path) -> tuple[int, dict]:
    """`ddpdoctor check --static` in this process (conftest's run_cli): no launch is under test here."""
    proc = run_cli("check", "--static", str(path), "--format", "json", cwd=REPO)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize(
    "name, codes",
    [
        ("frameworks/bad_lightning.py", {"DD504", "DD209", "DD401"}),
        ("frameworks/bad_accelerate.py", {"DD501", "DD502", "DD401"}),
        ("DD904/bad_deepspeed.py", {"DD904"}),
        ("DD904/bad_unknown_trainer.py", {"DD904"}),
    ],
)
def test_buggy_framework_scripts_are_never_a_clean_bill(name: str, codes: set[str]) -> None:
    rc, report = _check_static(STATIC / name)
    assert {f["rule"] for f in report["findings"]} == codes
    assert rc == 1  # a high or medium finding among them fails the default gate


@pytest.mark.parametrize("name", ["frameworks/good_lightning.py", "frameworks/good_accelerate.py",
                                  "frameworks/good_hf_trainer.py"])
def test_correct_framework_scripts_pass(name: str) -> None:
    rc, report = _check_static(STATIC / name)
    assert rc == 0
    assert report["findings"] == []


def test_not_analysed_names_the_engine() -> None:
    rc, report = _check_static(STATIC / "DD904" / "bad_deepspeed.py")
    (finding,) = report["findings"]
    assert finding["message"].startswith("not analysed: DeepSpeed (deepspeed.initialize)")
    assert finding["severity"] == "high" and rc == 1


def test_static_path_never_imports_a_framework() -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ddpdoctor.static import analyze_file\n"
        f"for p in sorted(Path({str(STATIC / 'frameworks')!r}).glob('*.py')):\n"
        "    analyze_file(p)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORK_MODULES!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------- the probe through the frameworks (2 ranks)

PROBE_FIXTURES = REPO / "fixtures" / "frameworks"


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def needs(module: str):  # noqa: ANN201
    return pytest.mark.skipif(not _installed(module), reason=f"{module} is not installed (the `test` extra has it)")


def _check(name: str, *options: str, tmp_path: Path) -> tuple[int, dict]:
    """`ddpdoctor check` as the user runs it from `tmp_path` (in this process: conftest's run_cli), on 2 CPU ranks."""
    out = tmp_path / "report.json"
    proc = run_cli("check", str(PROBE_FIXTURES / f"{name}.py"), "--nproc", "2", "--timeout", "600", "--format", "json",
                   "-o", str(out), *options, cwd=tmp_path)
    assert out.is_file(), proc.stderr[-2000:]
    return proc.returncode, json.loads(out.read_text(encoding="utf-8"))


def _rules(report: dict, source: str | None = None) -> dict[str, dict]:
    return {f["rule"]: f for f in report["findings"] if source is None or source in f["sources"]}


def _above_low(report: dict) -> list[str]:
    return [f["rule"] for f in report["findings"] if f["severity"] not in ("low", "info")]


@pytest.mark.slow
@needs("lightning")
def test_lightning_script_measured_through_the_trainer(tmp_path: Path) -> None:
    """Lightning under torchrun (its TorchElasticEnvironment): the fused BN+ReLU converted by sync_batchnorm=True
    (DD208), the single-process lr (DD401, measured), the unsynced validation metric (DD504); the closure Lightning
    steps with is followed (no false DD405), its DistributedSampler seen (no DD301/DD302)."""
    code, report = _check("lightning_bad", "--base-lr", "0.1", "--base-batch", "32", tmp_path=tmp_path)
    probe = _rules(report, "probe")
    assert probe["DD208"]["severity"] == "critical"
    assert "static" in probe["DD401"]["sources"]
    assert "DD504" in _rules(report)
    assert not {"DD301", "DD302", "DD305", "DD405", "DD904"} & set(_rules(report))
    assert code == 1


@pytest.mark.slow
@needs("lightning")
def test_correct_lightning_script_passes(tmp_path: Path) -> None:
    code, report = _check("lightning_good", tmp_path=tmp_path)
    assert _above_low(report) == [] and code == 0


@pytest.mark.slow
@needs("accelerate")
def test_accelerate_save_of_the_prepared_model_on_every_process(tmp_path: Path) -> None:
    """Accelerate under torchrun: DD501 and DD502 measured; its BatchSamplerShard shards (the indices drawn are
    disjoint), so no DD302."""
    code, report = _check("accelerate_bad", tmp_path=tmp_path)
    probe = _rules(report, "probe")
    assert {"DD501", "DD502"} <= set(probe)
    assert probe["DD502"]["evidence"]["writers"] == [0, 1]
    assert "DD302" not in _rules(report)
    assert code == 1
    assert not (tmp_path / "model.pt").exists()  # the probe redirects the checkpoint writes


@pytest.mark.slow
@needs("accelerate")
def test_correct_accelerate_script_passes(tmp_path: Path) -> None:
    code, report = _check("accelerate_good", tmp_path=tmp_path)
    assert _above_low(report) == [] and code == 0


@pytest.mark.slow
@needs("transformers")
def test_hf_trainer_runs_to_its_steps(tmp_path: Path) -> None:
    """The Trainer steps (no DD904), and what it does to BatchNorm is measured: 8 samples per rank (DD202)."""
    code, report = _check("hf_trainer", tmp_path=tmp_path)
    assert "DD904" not in _rules(report) and "DD902" not in _rules(report)
    assert report["environment"]["nproc"] == 2
    assert _above_low(report) == ["DD202"] and code == 1


@pytest.mark.slow
@needs("lightning")
def test_triage_confirms_the_conversion_lightning_performs_first(tmp_path: Path) -> None:
    """The arms intercept torch's converter that `sync_batchnorm=True` calls: arm P undoes it, and the fused
    BN+ReLU subclass it replaced is the confirmed first cause (DD208). The arms pair (same weights, same batches):
    the DDP wrapper Lightning leaves in eval mode after its sanity check still counts as training."""
    out = tmp_path / "triage.json"
    proc = run_cli("triage", str(PROBE_FIXTURES / "lightning_bad.py"), "--epochs", "2", "--steps", "4", "--format",
                   "json", "-o", str(out), cwd=tmp_path)
    assert out.is_file(), proc.stderr[-2000:]
    tri = json.loads(out.read_text(encoding="utf-8"))["triage"]
    assert (tri["causes"][0]["rule"], tri["causes"][0]["verdict"]) == ("DD208", "confirmed")
    assert tri["paired"] is True
    assert [a["name"] for a in tri["arms"]] == ["A", "L", "P"] and all(a["steps"] > 0 for a in tri["arms"])


def test_a_fabric_script_without_launch_is_started_as_fabric_run_starts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fabric() without .launch() is written for `fabric run`, which sets LT_CLI_USED: under torchrun's variables
    alone Fabric refuses more than one device ("you must call .launch() or use the CLI"), and a public Fabric
    example got a critical DD902 "fix the error raised by the script" for the launcher the probe left out. A script
    that calls .launch() is started as before (`fabric run` would make its .launch() raise)."""
    import os

    from ddpdoctor.probe import launch_env
    from ddpdoctor.probe.plan import plan_launch
    from ddpdoctor.probe.settings import ProbeSettings

    cli = plan_launch("import lightning as L\nfabric = L.Fabric()\nfabric.setup(model, opt)\n", nproc=2)
    assert cli.launcher == "fabric-run" and cli.mode == "torchrun" and "fabric run --devices 2" in cli.reason
    assert plan_launch((PROBE_FIXTURES / "fabric_run_good.py").read_text()).launcher == "fabric-run"
    launched = "from lightning.fabric import Fabric\nfabric = Fabric(devices=2)\nfabric.launch()\n"
    assert plan_launch(launched).launcher == "torchrun"
    assert plan_launch("import torch.distributed as dist\ndist.init_process_group('nccl')\n").launcher == "torchrun"
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    for key in ("LT_CLI_USED", "LT_DEVICES", "LT_NUM_NODES", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    done = launch_env.apply(ProbeSettings(run_dir="/nonexistent", launcher="fabric-run"))
    assert done == {"launcher": "fabric-run", "removed": [],
                    "set": {"LT_CLI_USED": "1", "LT_DEVICES": "2", "LT_NUM_NODES": "1"}}
    assert os.environ["RANK"] == "1" and os.environ["LT_CLI_USED"] == "1"


@pytest.mark.slow
@needs("lightning")
def test_correct_fabric_run_script_passes(tmp_path: Path) -> None:
    code, report = _check("fabric_run_good", tmp_path=tmp_path)
    assert "DD902" not in _rules(report) and "DD904" not in _rules(report)
    assert any("never calls .launch()" in n for n in report["notes"])
    assert _above_low(report) == [] and code == 0
