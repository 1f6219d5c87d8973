"""DD205 syncbn-needs-cuda: SyncBatchNorm used where plain PyTorch refuses it (CPU tensors, gloo).

What it does: the batchnorm recorder marks a SyncBatchNorm layer `would_raise` when it ran a training-mode
forward with a process group initialised while the script itself kept the layer on the CPU (under ddpdoctor's
CUDA emulation a layer the script put on `cuda:N` runs on the CPU too, and is not reported: on the GPU machine
it is fine). PyTorch raises in that situation — DDP's constructor ("SyncBatchNorm layers only work with GPU
modules") and SyncBatchNorm.forward ("expected input tensor to be on GPU ...") — so the finding says whether the
emulation stood in (exact global statistics over gloo, the run went on) or the rank really raised (DD902).
Severity info: not an accuracy problem by itself.

Run-wide measurement: SyncBatchNorm layers that synchronised in training with none kept on the CPU (the script
chose the GPU path: `"nccl" if torch.cuda.is_available() else "gloo"` picked nccl, the layers went to cuda:N)
clear the static suspicion, with the devices and the backend.
"""

from __future__ import annotations

from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd205_syncbn_needs_cuda import CODE

MEASURES = Measures(
    scope="run",
    what="where the script put each SyncBatchNorm layer that ran a training forward with a process group, and the "
    "backend it asked for",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the SyncBN layers measured on a device or backend SyncBN cannot run on",
    measure=key("layers"))


def _backends(ctx: RunContext) -> list[str]:
    return sorted({str(e.get("backend_requested") or e.get("backend")) for _, e in ctx.run.events("pg_init")
                   if e.get("ok")})


def analyze(ctx: RunContext) -> list[Finding]:
    bn = bc.bn_for(ctx)
    if bn is None:
        return []
    layers = [layer for layer in bn.layers if any(rl.info.get("would_raise") for rl in layer.ranks.values())]
    if not layers:
        synced = [layer for layer in bn.layers if layer.kind != "plain" and layer.synced]
        if synced:
            placed = sorted({str(rl.info.get("placed")) for layer in synced for rl in layer.ranks.values()})
            ctx.measured(CODE, run_wide=True, reason=(
                f"the {len(synced)} SyncBatchNorm layers that synchronised in training ran on {', '.join(placed)} "
                f"with the {'/'.join(_backends(ctx)) or '?'} backend the script asked for: the GPU setup plain "
                "PyTorch supports"
            ))
        return []
    ranks = sorted({r for layer in layers for r, rl in layer.ranks.items() if rl.info.get("would_raise")})
    emulated = all(layer.kind == "emulated_sync" for layer in layers)
    backends = sorted({str(e.get("backend_requested") or e.get("backend")) for _, e in ctx.run.events("pg_init")
                       if e.get("ok")})
    setup = f"a {'/'.join(backends)} process group and the model on the CPU" if backends else "the model on the CPU"
    if emulated:
        outcome = (
            "ddpdoctor's CPU emulation computed exact global-batch statistics over gloo so the run could be "
            "measured, but plain PyTorch raises here (DDP: \"SyncBatchNorm layers only work with GPU modules\")"
        )
    else:
        outcome = "PyTorch raised (\"SyncBatchNorm expected input tensor to be on GPU\"; see DD902)"
    message = f"{len(layers)} SyncBatchNorm layers ran training forwards with {setup}: {outcome}"
    site = bc.convert_site(ctx.run) or layers[0].info.get("site")
    evidence = {
        "layers": [layer.name for layer in layers],
        "placed": sorted({str(rl.info.get("placed")) for layer in layers for rl in layer.ranks.values()}),
        "backend": backends,
        "emulated": emulated,
    }
    return [
        ctx.finding(CODE, message=message, site=site, ranks=ranks, evidence=evidence,
                    magnitude=float(len(layers)))
    ]
