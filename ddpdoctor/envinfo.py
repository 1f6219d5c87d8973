"""`ddpdoctor env`: a paste-ready block describing this machine for a bug report.

It says what a maintainer needs to reproduce a DDP problem — ddpdoctor, Python, torch with its CUDA / cuDNN / NCCL
versions, the GPUs torch sees, which distributed backends this torch has, what `--device auto` would choose — and
the machine (OS, CPU, memory), the versions of ddpdoctor's own dependencies, and the variables that change how ranks
meet and what torch.distributed does: `MASTER_*`, `NCCL_*`, `TORCH_NCCL_*`, `CUDA_VISIBLE_DEVICES`,
`TORCH_DISTRIBUTED_DEBUG`. Their names are always shown; a value only for the variables known to hold a setting
(`SAFE_VALUES`: a level, a flag, a device list, an interface name) and only when it looks like one; any other
value is withheld. No other environment variable is ever read into the block (tokens, paths and user names live
there), so it is safe to paste.

torch is queried in a child interpreter with a time limit: a broken driver can hang CUDA initialisation, and a bug
report is exactly when that happens; the block then says so instead of hanging.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from ddpdoctor import WITHOUT_CWD, __version__

ENV_PREFIXES = ("MASTER_", "NCCL_", "TORCH_NCCL_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "TORCH_DISTRIBUTED_DEBUG")
# variables whose value is a setting (never a secret, a path or a user name): shown when it looks like one
SAFE_VALUES = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "TORCH_DISTRIBUTED_DEBUG",
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_NET_GDR_LEVEL", "NCCL_ALGO", "NCCL_PROTO", "NCCL_IB_HCA",
    "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_CROSS_NIC", "NCCL_NET", "NCCL_BUFFSIZE", "NCCL_NTHREADS",
    "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD",
    "NCCL_LAUNCH_MODE", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT", "NCCL_TIMEOUT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "TORCH_NCCL_AVOID_RECORD_STREAMS", "TORCH_NCCL_HIGH_PRIORITY", "TORCH_NCCL_USE_COMM_NONBLOCKING",
    "TORCH_NCCL_DESYNC_DEBUG", "TORCH_NCCL_ENABLE_TIMING",
})
WITHHELD = "<set; value not shown>"
_SETTING = re.compile(r"[A-Za-z0-9_.,:+\-^]{0,64}")
PACKAGES = ("numpy", "scipy", "rich", "typer")
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
    """The `MASTER_*`, `NCCL_*`, `TORCH_NCCL_*` variables, `CUDA_VISIBLE_DEVICES` and `TORCH_DISTRIBUTED_DEBUG`,
    sorted; nothing else. A value is shown only for a variable of `SAFE_VALUES` whose value looks like a setting;
    any other is `WITHHELD` (its name still says it is set)."""
    env = os.environ if environ is None else environ
    out = {}
    for k in sorted(env):
        if k.startswith(ENV_PREFIXES) or k in ENV_NAMES:
            value = env[k]
            out[k] = value if k in SAFE_VALUES and _SETTING.fullmatch(value) else WITHHELD
    return out


def machine() -> dict[str, Any]:
    """OS, CPU and memory of this machine (what a maintainer needs to judge timings and emulation)."""
    out: dict[str, Any] = {"os": f"{platform.system()} {platform.release()}"}
    try:
        pretty = platform.freedesktop_os_release().get("PRETTY_NAME")  # type: ignore[attr-defined]
        if pretty:
            out["os"] += f" ({pretty})"
    except (AttributeError, OSError):
        pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    out["cpu"] = cpu
    out["cpu_count"] = os.cpu_count()
    try:
        out["cpus_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        out["cpus_usable"] = out["cpu_count"]
    try:
        out["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (AttributeError, OSError, ValueError):
        out["memory_gib"] = None
    return out


def package_versions() -> dict[str, str | None]:
    """Installed versions of ddpdoctor's dependencies (from their metadata: nothing is imported); None: missing."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


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
        "machine": machine(),
        "packages": package_versions(),
        "torch": query_torch() if torch_info is None else torch_info,
        "variables": launcher_variables(environ),
    }


VARIABLES_LABEL = "MASTER_* / NCCL_* / TORCH_NCCL_* / CUDA_VISIBLE_DEVICES / TORCH_DISTRIBUTED_DEBUG"


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
    m = info.get("machine") or {}
    if m:
        usable = m.get("cpus_usable")
        cores = f"{m.get('cpu_count')} CPUs"
        if usable not in (None, m.get("cpu_count")):
            cores += f", {usable} usable"
        memory = f"{m['memory_gib']} GiB" if m.get("memory_gib") is not None else "unknown"
        lines.append(f"OS:        {m.get('os')}")
        lines.append(f"CPU:       {m.get('cpu')} ({cores})")
        lines.append(f"memory:    {memory}")
    packages = info.get("packages") or {}
    if packages:
        lines.append("packages:  " + ", ".join(f"{k} {v or 'not installed'}" for k, v in packages.items()))
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
        lines.append(f"{VARIABLES_LABEL}:")
        lines.extend(f"  {k}={v}" if v != WITHHELD else f"  {k} (set; value not shown)" for k, v in variables.items())
    else:
        lines.append(f"{VARIABLES_LABEL}: none set")
    return "```text\n" + "\n".join(lines) + "\n```\n"
