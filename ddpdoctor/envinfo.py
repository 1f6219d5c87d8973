"""`ddpdoctor env`: a paste-ready block describing this machine for a bug report.

It says what a maintainer needs to reproduce a DDP problem — ddpdoctor, Python, torch with its CUDA / cuDNN / NCCL
versions, the GPUs torch sees, which distributed backends this torch has, what `--device auto` would choose — and
the launcher variables that change how ranks meet: `MASTER_*` and `NCCL_*`. No other environment variable is ever
read into the block (tokens, paths and user names live there), so it is safe to paste.

torch is queried in a child interpreter with a time limit: a broken driver can hang CUDA initialisation, and a bug
report is exactly when that happens; the block then says so instead of hanging.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from ddpdoctor import WITHOUT_CWD, __version__

ENV_PREFIXES = ("MASTER_", "NCCL_")
TORCH_TIMEOUT_S = 60.0

# Runs in a child interpreter (`python -c`): prints one JSON object about torch and its devices.
_TORCH_QUERY = r"""
import json, sys
out = {}
try:
    import torch
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
out["version"] = torch.__version__
out["cuda_build"] = getattr(torch.version, "cuda", None)
out["hip_build"] = getattr(torch.version, "hip", None)
try:
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
except Exception:
    out["cudnn"] = None
try:
    v = torch.cuda.nccl.version() if out["cuda_build"] or out["hip_build"] else None
    out["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else v
except Exception:
    out["nccl"] = None
gpus = []
try:
    out["cuda_available"] = bool(torch.cuda.is_available())
    for i in range(torch.cuda.device_count() if out["cuda_available"] else 0):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                     "memory_gib": round(p.total_memory / 2**30, 1)})
except Exception as exc:
    out["cuda_error"] = f"{type(exc).__name__}: {exc}"
out["gpus"] = gpus
backends = {}
try:
    import torch.distributed as dist
    out["distributed"] = bool(dist.is_available())
    for name in ("gloo", "nccl", "mpi", "ucc"):
        fn = getattr(dist, f"is_{name}_available", None)
        backends[name] = bool(fn()) if fn is not None and out["distributed"] else False
except Exception as exc:
    out["distributed"] = False
    out["distributed_error"] = f"{type(exc).__name__}: {exc}"
out["backends"] = backends
print(json.dumps(out))
"""


def launcher_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `MASTER_*` and `NCCL_*` variables, sorted; nothing else."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith(ENV_PREFIXES)}


def query_torch(python: str | None = None, timeout: float = TORCH_TIMEOUT_S) -> dict[str, Any]:
    """What torch in `python` (default: this interpreter, which is the one the probe launches ranks with) says
    about itself and its devices. The child inherits the caller's environment (CUDA_VISIBLE_DEVICES decides which
    GPUs it sees) and prints only the fields of `_TORCH_QUERY`: no variable's value reaches the block this way."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}
    try:
        done = subprocess.run(
            [python or sys.executable, "-c", WITHOUT_CWD + _TORCH_QUERY],
            check=False, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"importing torch and querying CUDA did not finish within {timeout:.0f} s"}
    except OSError as exc:
        return {"error": f"could not start {python or sys.executable}: {exc.strerror or exc}"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"error": f"the torch query failed: {tail}"}
    try:
        return json.loads(lines[-1])
    except ValueError:
        return {"error": "the torch query printed no readable answer"}


def auto_device(torch_info: Mapping[str, Any], nproc: int = 2) -> str:
    """What `ddpdoctor check --device auto --nproc N` would run on (probe.instrument.resolve_device's rule)."""
    gpus = len(torch_info.get("gpus") or ())
    if torch_info.get("cuda_available") and gpus >= nproc:
        return f"cuda with NCCL ({gpus} GPUs visible, --nproc up to {gpus})"
    return f"cpu: CUDA emulated over gloo ({gpus} GPU{'s' if gpus != 1 else ''} visible, fewer than --nproc {nproc})"


def collect(environ: Mapping[str, str] | None = None, torch_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything `ddpdoctor env` shows, as JSON values."""
    return {
        "ddpdoctor": __version__,
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": platform.platform(),
        "torch": query_torch() if torch_info is None else torch_info,
        "variables": launcher_variables(environ),
    }


def _yes(flag: Any) -> str:
    return "yes" if flag else "no"


def render_env(info: Mapping[str, Any]) -> str:
    """The block, fenced so that it pastes into a GitHub issue as it is."""
    py = info["python"]
    lines = [
        f"ddpdoctor: {info['ddpdoctor']}",
        f"Python:    {py['version']} ({py['implementation']}, {py['executable']})",
        f"platform:  {info['platform']}",
    ]
    t = info["torch"]
    if "error" in t:
        lines.append(f"torch:     unavailable: {t['error']}")
    else:
        if t.get("cuda_build"):
            build = f"CUDA {t['cuda_build']}"
        elif t.get("hip_build"):
            build = f"ROCm/HIP {t['hip_build']}"
        else:
            build = "CPU-only build"
        extras = []
        if t.get("cudnn"):
            extras.append(f"cuDNN {t['cudnn']}")
        if t.get("nccl"):
            extras.append(f"NCCL {t['nccl']}")
        lines.append(f"torch:     {t['version']} ({', '.join([build, *extras])})")
        gpus = t.get("gpus") or []
        if t.get("cuda_error"):
            lines.append(f"GPUs:      CUDA query failed: {t['cuda_error']}")
        elif not gpus:
            lines.append("GPUs:      none visible")
        else:
            lines.append(f"GPUs:      {len(gpus)} visible")
            lines.extend(
                f"  cuda:{g['index']}  {g['name']}  (compute {g['capability']}, {g['memory_gib']} GiB)" for g in gpus
            )
        backends = t.get("backends") or {}
        if not t.get("distributed"):
            lines.append("backends:  torch.distributed is not available in this build")
        else:
            lines.append("backends:  " + ", ".join(f"{name} {_yes(ok)}" for name, ok in backends.items()))
        lines.append(f"--device auto (2 ranks): {auto_device(t)}")
    variables = info["variables"]
    if variables:
        lines.append("MASTER_* / NCCL_* variables:")
        lines.extend(f"  {k}={v}" for k, v in variables.items())
    else:
        lines.append("MASTER_* / NCCL_* variables: none set")
    return "```text\n" + "\n".join(lines) + "\n```\n"
