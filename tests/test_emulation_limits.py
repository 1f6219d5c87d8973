"""An emulation gap is the emulation's limit, never the script's bug (issue 20): a CUDA call the CPU emulation does
not reproduce fails a rank with what a CPU build says; DD902 says so, and tells the user where the probe can run
it. The same error in a run on real devices (no emulation) stays the script's. Hand-built runs (fast)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_analyses_synthetic import SITE, Run

from ddpdoctor.analyses import analyze_run


@pytest.mark.parametrize("message", [
    "Cannot access accelerator device when none is available.",
    "Cannot get CUDA generator without ATen_cuda library. PyTorch splits its backend into two shared libraries",
    "type torch.cuda.FloatTensor not available. Torch not compiled with CUDA enabled.",
])
def test_a_cuda_call_the_emulation_does_not_reproduce_is_its_limit(tmp_path: Path, message: str) -> None:
    run = Run(tmp_path)
    for pid, rank in ((10, 0), (11, 1)):
        run.process(pid, rank, events=[("torch_ready", {"torch": "2.13.0", "device": "cpu", "cuda_emulated": True}),
                                       ("exception", {"type": "RuntimeError", "message": message,
                                                      "user_frame": SITE})])
    [f] = [f for f in analyze_run(tmp_path).findings if f.rule == "DD902"]
    assert "a limit of ddpdoctor's CUDA emulation" in f.message and "not a bug of the script" in f.message
    assert "Fix the error raised by the script" not in f.fix and "--device cuda" in f.fix
    assert f.evidence["emulation_limit"]


def test_the_same_error_without_emulation_is_the_scripts(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.process(10, 0, events=[("torch_ready", {"torch": "2.13.0", "device": "cuda", "cuda_emulated": False}),
                               ("exception", {"type": "RuntimeError", "message": "No CUDA GPUs are available",
                                              "user_frame": SITE})])
    [f] = [f for f in analyze_run(tmp_path).findings if f.rule == "DD902"]
    assert "emulation" not in f.message and "emulation_limit" not in f.evidence
