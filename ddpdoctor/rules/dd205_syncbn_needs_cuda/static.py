"""DD205 syncbn-needs-cuda: SyncBatchNorm in a script that can run on CPU/gloo.

What it flags (info): SyncBatchNorm layers (converted or built) when the process group backend is gloo, or is
chosen at run time and can be gloo (`"nccl" if torch.cuda.is_available() else "gloo"`). In plain PyTorch, DDP's
constructor then raises "SyncBatchNorm layers only work with GPU modules" and SyncBN's forward refuses CPU input.

What stays silent: SyncBN with an nccl-only script; SyncBN converted only on a GPU path
(`if torch.cuda.is_available(): model = convert_sync_batchnorm(model)`); scripts without SyncBN.
"""

from __future__ import annotations

import re
from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd205_syncbn_needs_cuda import CODE
from ddpdoctor.static.model import ScriptModel
from ddpdoctor.static.semantic import Event, constant_values, is_constant

# SyncBN converted only on a GPU path (`if use_cuda:`, `if torch.cuda.is_available():`) is deliberate
_GPU_ONLY = re.compile(r"cuda|gpu|nccl", re.I)


def check(script: ScriptModel) -> Iterator[Finding]:
    syncbn = [
        ev
        for ev in script.of("convert_syncbn", "syncbn_layer")
        if not any(c.kind == "cond" and _GPU_ONLY.search(str(c.info)) for c in ev.ctx)
    ]
    if not syncbn:
        return
    gloo_lines: list[int] = []
    gloo_events: list[Event] = []
    chosen_at_run_time = False
    for ev in script.of("init_pg"):
        backend = ev.data["params"].get("backend") or ()
        values = [str(v).lower() for v in constant_values(backend)]
        if any("gloo" in v for v in values):
            gloo_lines.append(ev.line)
            gloo_events.append(ev)
            chosen_at_run_time = chosen_at_run_time or not (is_constant(backend) and len(set(values)) == 1)
    if not gloo_lines:
        return
    first = syncbn[0]
    yield script.finding(
        CODE,
        line=first,
        message=f"SyncBatchNorm (line {first.line}) with the gloo backend of {script.place(gloo_events[0], first)}"
        + (" (chosen when CUDA is unavailable)" if chosen_at_run_time else "")
        + ": plain PyTorch raises \"SyncBatchNorm layers only work with GPU modules\" when DDP wraps it on CPU",
        confidence=Confidence.LIKELY if chosen_at_run_time else Confidence.CERTAIN,
        evidence={
            "syncbn_line": first.line, "gloo_lines": gloo_lines, "backend_chosen_at_run_time": chosen_at_run_time
        },
    )
