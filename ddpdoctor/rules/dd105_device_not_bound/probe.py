"""DD105 device-not-bound: two ranks of one node hold their DDP replica (or feed their batches) on the same GPU.

What it does: the DDP recorder notes, at construction and at the first training forward, which device the
wrapped module's parameters and the forward's input are on — the real device on a GPU machine, the emulated
one under CPU emulation (`.cuda()` without an index means the device current at that moment, cuda:0 until
`set_device` changes it), as the node numbers its GPUs: cuda:i of a process whose CUDA_VISIBLE_DEVICES lists GPUs
is the i-th of them (a worker that sets it to its own GPU and uses cuda:0 is on that GPU). Ranks on the same host
that share a CUDA device are reported with each rank's devices, its current device and the `device_ids` DDP got.
Ranks that each hold a device of their own clear the static suspicion ("nothing binds each process to its own
GPU"): the binding happened, wherever it is written.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd105_device_not_bound import CODE

MEASURES = Measures(
    scope="run",
    what="the (emulated) GPU each rank's DDP replica and first batch were on",
)
# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the ranks measured holding their replica on one device",
    measure=key("ranks_sharing"), floor=1)


def placements(ctx: RunContext) -> dict[int, dict[str, Any]]:
    """rank -> {host, params, inputs, current_device, device_ids, site} of its first DDP."""
    out: dict[int, dict[str, Any]] = {}
    for rank, p in ctx.ranks.items():
        init = next((e for e in p.of("ddp_init") if e.get("ok")), None)
        if init is None:
            continue
        first = next((e for e in p.of("ddp_inputs") if e.get("ddp") == init.get("ddp")), None)
        out[rank] = {
            "host": p.host,
            "params": (first or {}).get("params_device") or init.get("params_device"),
            "inputs": (first or {}).get("device"),
            "current_device": init.get("current_device"),
            "device_ids": init.get("device_ids"),
            "site": init.get("site"),
        }
    return out


def analyze(ctx: RunContext) -> list[Finding]:
    seen = placements(ctx)
    cuda = {r: v for r, v in seen.items() if str(v.get("params") or "").startswith("cuda")}
    if len(cuda) < 2:
        return []
    shared: dict[tuple[str, str], list[int]] = {}
    for r, v in cuda.items():
        for what in ("params", "inputs"):
            dev = v.get(what)
            if dev and str(dev).startswith("cuda"):
                shared.setdefault((v["host"], str(dev)), [])
                if r not in shared[(v["host"], str(dev))]:
                    shared[(v["host"], str(dev))].append(r)
    clash = {k: sorted(rs) for k, rs in shared.items() if len(rs) > 1}
    evidence = {"per_rank": {str(r): {k: v[k] for k in ("host", "params", "inputs", "current_device", "device_ids")}
                             for r, v in sorted(seen.items())}}
    if not clash:
        devices = ", ".join(f"rank {r} {v['params']}" for r, v in sorted(cuda.items()))
        # wherever the static rule looked (the script or a project module), the binding happened
        ctx.measured(CODE, run_wide=True, reason=f"each rank held its replica on its own device ({devices})",
                     evidence=evidence)
        return []
    (_host, device), ranks = max(clash.items(), key=lambda kv: len(kv[1]))
    inputs_too = all(cuda[r].get("inputs") == device for r in ranks)
    ids = sorted({str(cuda[r].get("device_ids")) for r in ranks})
    message = (
        f"{fmt_ranks(ranks)} on one node hold their DDP replica on {device}"
        + (" and feed their batches there" if inputs_too else "")
        + f": no rank was bound to a GPU of its own (current device {cuda[ranks[0]].get('current_device')} on "
        f"each, device_ids {ids[0] if len(ids) == 1 else ids}); on real GPUs NCCL refuses the setup (duplicate GPU) "
        "or every rank shares one GPU while the others idle"
    )
    return [
        ctx.finding(
            CODE,
            message=message,
            site=cuda[ranks[0]].get("site"),
            ranks=ranks,
            evidence={**evidence, "shared_device": device, "ranks_sharing": ranks},
        )
    ]
