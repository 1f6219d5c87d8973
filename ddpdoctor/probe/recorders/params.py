"""Parameter recorder: before the first optimizer step (step 0: the initial weights) and after every step, a digest
of the model's parameters (bit-exact, comparable across ranks) and a small fixed sample of values; at the end, the
parameter vector itself (capped) and digests of the normalisation buffers. DD103 compares them across ranks: the
first step where replicas differ (0: they never started equal) and by how much.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "params"
DIGEST_BUDGET = 1 << 22  # elements hashed exactly per step; beyond, a strided sample of this many
SAMPLE_TENSORS = 64  # tensors contributing sampled values per step
FINAL_CAP = 1 << 20  # float32 values kept at the end


def _model_params(probe: Probe, optimizer: Any) -> tuple[list[tuple[str, Any]], str]:
    for rec in probe.registry.live_ddps():
        return list(rec.module.named_parameters()), "ddp"
    if optimizer is not None:
        return [(f"group{gi}.{pi}", p) for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])], "optimizer"
    return [], "none"


def _flat_bytes(t: Any, stride: int) -> bytes:
    import torch

    flat = t.detach().reshape(-1)
    if stride > 1:
        flat = flat[::stride]
    flat = flat.contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().tobytes()


def digest(params: list[tuple[str, Any]]) -> tuple[str, int, bool]:
    total = sum(p.numel() for _, p in params)
    stride = max(1, -(-total // DIGEST_BUDGET))
    h = hashlib.blake2b(digest_size=16)
    covered = 0
    for _, p in params:
        data = _flat_bytes(p, stride)
        h.update(data)
        covered += -(-p.numel() // stride)
    return h.hexdigest(), covered, stride > 1


def sample_values(params: list[tuple[str, Any]]) -> list[float]:
    """Four values per tensor at fixed relative positions, from up to SAMPLE_TENSORS tensors chosen evenly: the
    same positions on every rank, so differences are comparable."""
    import torch

    if not params:
        return []
    pick = params if len(params) <= SAMPLE_TENSORS else [params[i * len(params) // SAMPLE_TENSORS] for i in range(SAMPLE_TENSORS)]
    out: list[float] = []
    with torch.no_grad():
        for _, p in pick:
            n = p.numel()
            if n == 0:
                continue
            idx = torch.tensor(sorted({0, n // 3, (2 * n) // 3, n - 1}), device=p.device)
            out.extend(float(v) for v in p.detach().reshape(-1)[idx].double().cpu().tolist())
    return out


def install(probe: Probe) -> None:
    state: dict[str, Any] = {"snapshot": None}

    def on_step(optimizer: Any) -> None:
        params, source = _model_params(probe, optimizer)
        if not params:
            return
        d, covered, sampled = digest(params)
        probe.emit("params", step=probe.steps, digest=d, numel=covered, sampled=sampled, values=sample_values(params),
                   source=source, tensors=len(params))
        # The final state is the state after the last step. Kept as a capped CPU copy, never as references: the
        # script may free its model before the run ends (a function that returns, `del model`).
        state["snapshot"] = _snapshot(probe, params, source, d, covered, sampled)

    def on_end() -> None:
        snap = state["snapshot"]
        if snap is None:
            return
        vec = snap.pop("vector")
        ref = probe.blob(vec.numpy().tobytes(), dtype="float32", count=int(vec.numel()), compress=False)
        probe.emit("params_final", vector=ref, **snap)

    def before_first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if state["initial"] or probe.quiet_steps or probe.ending:
            return None
        state["initial"] = True
        params, source = _model_params(probe, optimizer)
        if params:
            d, covered, sampled = digest(params)
            probe.emit("params", step=0, digest=d, numel=covered, sampled=sampled,
                       values=sample_values(params), source=source, tensors=len(params))
        return None

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    state["initial"] = False
    handle = register_optimizer_step_pre_hook(
        lambda o, a, k: probe.safely("params before step", before_first_step, o, a, k)
    )
    probe.patcher.add_undo(handle.remove)
    probe.step_hooks.append(on_step)
    probe.end_hooks.append(on_end)


def _snapshot(probe: Probe, params: list[tuple[str, Any]], source: str, d: str, covered: int, sampled: bool) -> dict[str, Any]:
    import torch

    total = sum(p.numel() for _, p in params)
    stride = max(1, -(-total // FINAL_CAP))
    with torch.no_grad():
        parts = [p.detach().reshape(-1)[::stride].float().cpu() for _, p in params]
        vec = torch.cat(parts) if parts else torch.zeros(0)
    buffers: dict[str, str] = {}
    rec = next(iter(probe.registry.live_ddps()), None)
    if rec is not None:
        from torch.nn.modules.batchnorm import _NormBase

        for name, m in rec.module.named_modules():
            if isinstance(m, _NormBase) and getattr(m, "running_mean", None) is not None:
                h = hashlib.blake2b(digest_size=16)
                h.update(_flat_bytes(m.running_mean, 1))
                h.update(_flat_bytes(m.running_var, 1))
                buffers[name] = h.hexdigest()
    return {"step": probe.steps, "digest": d, "numel": covered, "sampled": sampled, "vector": vec,
            "vector_stride": stride, "source": source, "buffers": buffers}
