"""`ddpdoctor env`: the paste-ready block for bug reports, and what it must never contain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ddpdoctor.envinfo import VARIABLES_LABEL, WITHHELD, auto_device, collect, launcher_variables, render_env

REPO = Path(__file__).resolve().parents[1]

# Values no honest block could contain by accident: if one appears, a variable leaked.
SENTINELS = {
    "AWS_SECRET_ACCESS_KEY": "sentinel-aws-7f3a9c",
    "HF_TOKEN": "sentinel-hf-51d2e8",
    "GITHUB_TOKEN": "sentinel-gh-0b44c1",
    "MASTERKEY": "sentinel-masterkey-9e1",  # MASTER without the underscore is not a launcher variable
    "MY_NCCL_DEBUG": "sentinel-prefix-c2d",  # NCCL_ in the middle does not count either
}
# torch reads this one itself and rejects unknown values: a valid value (shown: a known setting)
DEBUG = {"TORCH_DISTRIBUTED_DEBUG": "INFO"}
# names always shown, values only of the known settings
WITHHELD_VALUES = {"NCCL_TOPO_FILE": "/home/sentinel-user-4d1/topo.xml", "TORCH_NCCL_SECRETISH": "sentinel-tn-88a",
                   "NCCL_DEBUG_SUBSYS": "sentinel value with spaces"}
SHOWN = {"MASTER_ADDR": "10.9.8.7", "MASTER_PORT": "29511", "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth7"}


def test_only_master_and_nccl_variables_are_selected() -> None:
    env = {**SENTINELS, **SHOWN, "PATH": "/usr/bin"}
    assert launcher_variables(env) == dict(sorted(SHOWN.items()))


def test_cuda_debug_and_torch_nccl_variables_names_always_values_of_settings_only() -> None:
    env = {**SENTINELS, **SHOWN, **DEBUG, **WITHHELD_VALUES, "CUDA_VISIBLE_DEVICES": "2,3",
           "TORCH_NCCL_BLOCKING_WAIT": "1"}
    got = launcher_variables(env)
    assert got["CUDA_VISIBLE_DEVICES"] == "2,3" and got["TORCH_DISTRIBUTED_DEBUG"] == "INFO"
    assert got["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    for key in WITHHELD_VALUES:
        assert got[key] == WITHHELD
    text = render_env(collect(environ=env, torch_info={"error": "none"}))
    for key, value in WITHHELD_VALUES.items():
        assert f"  {key} (set; value not shown)" in text and value not in text
    assert "  CUDA_VISIBLE_DEVICES=2,3\n" in text and "  TORCH_DISTRIBUTED_DEBUG=INFO\n" in text


def test_machine_and_package_versions() -> None:
    from importlib.metadata import version

    info = collect(environ={}, torch_info={"error": "none"})
    m = info["machine"]
    assert m["os"] and m["cpu"] and m["cpu_count"] >= 1 and m["memory_gib"] > 0
    assert info["packages"] == {name: version(name) for name in ("numpy", "scipy", "rich", "typer")}
    text = render_env(info)
    for label in ("OS:        ", "CPU:       ", "memory:    ", "packages:  numpy "):
        assert f"\n{label}" in text
    assert f"typer {version('typer')}" in text


def test_block_rendered_from_canned_torch_answers() -> None:
    torch_info = {
        "version": "2.13.0+cu128", "cuda_build": "12.8", "hip_build": None, "cudnn": 91000, "nccl": "2.27.3",
        "cuda_available": True, "distributed": True,
        "gpus": [{"index": 0, "name": "NVIDIA H100", "capability": "9.0", "memory_gib": 79.1},
                 {"index": 1, "name": "NVIDIA H100", "capability": "9.0", "memory_gib": 79.1}],
        "backends": {"gloo": True, "nccl": True, "mpi": False, "ucc": False},
    }
    text = render_env(collect(environ={**SENTINELS, **SHOWN}, torch_info=torch_info))
    assert text.startswith("```text\n") and text.endswith("```\n")
    assert "torch:     2.13.0+cu128 (CUDA 12.8, cuDNN 91000, NCCL 2.27.3)" in text
    assert "GPUs:      2 visible" in text and "cuda:1  NVIDIA H100  (compute 9.0, 79.1 GiB)" in text
    assert "backends:  gloo yes, nccl yes, mpi no, ucc no" in text
    assert "cuda with NCCL (2 GPUs visible" in text
    for key, value in SHOWN.items():
        assert f"  {key}={value}\n" in text
    for key, value in SENTINELS.items():
        assert value not in text and key not in text


def test_auto_device_follows_the_probe_rule() -> None:
    one_gpu = {"cuda_available": True, "gpus": [{"index": 0}]}
    assert auto_device(one_gpu, nproc=1).startswith("cuda")
    assert auto_device(one_gpu, nproc=2).startswith("cpu: CUDA emulated")
    assert auto_device({"cuda_available": False, "gpus": []}).startswith("cpu")


def test_a_missing_torch_is_said_not_raised() -> None:
    text = render_env(collect(environ={}, torch_info={"error": "ModuleNotFoundError: No module named 'torch'"}))
    assert "torch:     unavailable: ModuleNotFoundError" in text
    assert f"{VARIABLES_LABEL}: none set" in text


def _env_cli(*args: str, extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "NCCL_", "TORCH_NCCL_"))
           and k not in ("CUDA_VISIBLE_DEVICES", "TORCH_DISTRIBUTED_DEBUG")}
    env.update(extra)
    return subprocess.run([sys.executable, "-m", "ddpdoctor", "env", *args], check=False, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_env_command_never_shows_other_variables() -> None:
    """The real command, real torch: every variable of the caller's environment other than MASTER_*/NCCL_* is
    absent from both formats, whatever its name."""
    done = _env_cli(extra={**SENTINELS, **SHOWN, **DEBUG})
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "ddpdoctor: " in text and "torch:     " in text and "backends:  " in text and "gloo yes" in text
    for key, value in SHOWN.items():
        assert f"{key}={value}" in text
    for key, value in SENTINELS.items():
        assert value not in text and key not in text
    assert "TORCH_DISTRIBUTED_DEBUG=INFO" in text
    as_json = _env_cli("--format", "json", extra={**SENTINELS, **SHOWN})
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["variables"] == dict(sorted(SHOWN.items()))
    assert doc["torch"]["backends"]["gloo"] is True
    for value in SENTINELS.values():
        assert value not in as_json.stdout
    # nothing else from the environment: no value of any other variable (long enough to be telling) appears,
    # apart from parts of the interpreter's path, which the block shows on purpose
    others = [v for k, v in os.environ.items() if len(v) >= 12 and not k.startswith(("MASTER_", "NCCL_"))
              and v not in sys.executable]
    leaked = [v for v in others if v in text]
    assert not leaked, leaked


def test_env_rejects_an_unknown_format() -> None:
    done = _env_cli("--format", "xml", extra={})
    assert done.returncode == 2 and done.stderr.startswith("ddpdoctor: error: --format")
    assert "Traceback" not in done.stderr
