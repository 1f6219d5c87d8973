"""Errors that mean "could not analyse": the CLI prints them as one line on stderr and exits 2. And the one list
of the errors a process of a distributed run reports when a *peer* went away (`is_peer_error`)."""

from __future__ import annotations

from ddpdoctor.plain import LazyPattern


class UsageError(Exception):
    """Bad input from the user (missing file, syntax error, bad option, unknown rule)."""


class InternalError(Exception):
    """ddpdoctor itself failed; still one line and exit 2, never a traceback."""


def require_torch(what: str) -> None:
    """torch is not a dependency of ddpdoctor (the static checks, `report` and the pre-commit hook never need it;
    an isolated hook environment would otherwise pull a multi-GB CUDA build). What runs the user's script, or BN
    layers, does: it runs in this interpreter, the user's training environment. Checked without importing it."""
    import importlib.util
    import sys

    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UsageError(
            f"{what} runs PyTorch in this Python ({sys.executable}), which has no torch: install ddpdoctor in your "
            "training environment (or `pip install torch` here); `ddpdoctor check --static` needs no torch"
        )


PROBE_PACKAGES = ("numpy", "scipy")


def require_analysis_packages(what: str) -> None:
    """numpy and scipy are the `probe` extra, not dependencies: the static checks and the pre-commit hook never
    import them (they are 200 MB of a hook environment). What analyses measurements (the probe, `report`,
    `triage`, `compare-bn`) does: one line naming the missing ones and the install, checked without importing."""
    import importlib.util

    missing = []
    for name in PROBE_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise UsageError(f"{what} needs {' and '.join(missing)}, which this Python does not have: "
                         "pip install 'ddpdoctor[probe]' (`ddpdoctor check --static` needs neither)")


# What a rank reports because a *peer* went away: a consequence, never the root cause. The probe's analyses
# (DD902's first failure) and compare-bn (which rank's error to show) both skip these when they look for the cause.
PEER_ERROR_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "nccl communicator was aborted",
    "ncclremoteerror",
    "socket timeout",
    "connection refused",
    "received 0 bytes",
    "processgroupnccl's watchdog",
    "timed out after",
)


def is_peer_error(text: str) -> bool:
    """Whether an error text is only a peer's failure seen from this process."""
    low = text.lower()
    return any(marker in low for marker in PEER_ERROR_MARKERS)


# The CUDA emulation's error for a device index beyond the devices it gives the run (probe/emulation.py raises it,
# DD902 recognises it: the script addresses more GPUs than the probe emulated, not a bug of the script).
EMULATED_ORDINAL = "CUDA error: invalid device ordinal (cuda:{index}; this run emulates {devices} CUDA devices)"
_EMULATED_ORDINAL_PATTERN = r"invalid device ordinal \(cuda:(\d+); this run emulates (\d+) CUDA devices\)"
# What a CPU machine says where a GPU machine would have a device: raised in a run whose CUDA was emulated, it is a
# call the emulation does not reproduce (`torch.Generator("cuda")`, `torch.cuda.FloatTensor(...)`, a C++ path that
# asks for the accelerator; CPU builds of torch and CUDA builds on a machine without a driver say it differently),
# not an error of the script, which runs on the GPUs it was written for (DD902).
_EMULATION_LIMIT_PATTERN = (
    r"Torch not compiled with CUDA enabled|Cannot access accelerator device when none is available|"
    r"No CUDA GPUs are available|Found no NVIDIA driver|CUDA driver initialization failed|"
    r"no CUDA-capable device is detected|Could not run '[^']+' with arguments from the 'CUDA' backend|"
    r"device type at start of device string: cuda|type torch\.cuda\.\w+Tensor not available|"
    r"Cannot get CUDA generator without ATen_cuda library|"
    # a CUDA build of torch on a machine without a GPU driver (torch 2.11+cu130 on a CPU machine)
    r"CUDA driver version is insufficient for CUDA runtime version"
)
# compiled when a failed run is first read (DD902's probe half): every command imports this module, and `check
# --static` never reads a run
EMULATED_ORDINAL_RE = LazyPattern(_EMULATED_ORDINAL_PATTERN)
EMULATION_LIMIT_RE = LazyPattern(_EMULATION_LIMIT_PATTERN)
# how the probe words a CUDA emulation that could not be installed (torch_ready's `emulation_error`, shown as a
# note); DD902 quotes what follows it
EMULATION_FAILED = "CUDA emulation failed: "
