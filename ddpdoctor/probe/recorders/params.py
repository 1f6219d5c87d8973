"""Parameter recorder: before the first optimizer step (step 0: the initial weights) and after every step, a digest
of the model's parameters (bit-exact, comparable across ranks) and a small fixed sample of values; at the end, the
parameter vector itself (capped) and digests of the normalisation buffers. DD103 compares them across ranks: the
first step where replicas differ (0: they never started equal) and by how much.

On CUDA nothing is read back per step with a synchronisation: the digest is taken of an exact integer fingerprint
of the parameter bits computed on the device (per dtype: the sum and a position-weighted sum of the bit patterns
as int64, which any change of any covered bit changes), the sampled values are gathered on the device, and both
reach the host through `readback` (pinned, non-blocking, delivered at a later step). The final vector is kept as
a device copy and read once at the end. On the CPU the digest is the blake2b of the parameter bytes, as before.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "params"
DIGEST_BUDGET = 1 << 22  # elements hashed exactly per step; beyond, a strided sample of this many
SAMPLE_TENSORS = 64  # tensors contributing sampled values per step
FINAL_CAP = 1 << 20  # float32 values kept at the end


def local(t: Any) -> Any:
    """A DTensor (FSDP2 `fully_shard`, tensor parallel) as the part this rank holds, without communication; any other
    tensor as it is. A recorder never reduces across ranks: it reads what the rank holds."""
    if hasattr(t, "placements") and callable(getattr(t, "to_local", None)):
        return t.to_local()
    return t


def sharded(t: Any) -> bool:
    """A DTensor sharded across ranks (a Shard placement): the ranks hold different parts, never replicas."""
    return any(type(pl).__name__ == "Shard" or getattr(pl, "is_shard", lambda: False)()
               for pl in getattr(t, "placements", ()) or ())


def _model_params(probe: Probe, optimizer: Any) -> tuple[list[tuple[str, Any]], str]:
    """The parameters the step is recorded on, and their source: "ddp" (the DDP replica: compared across ranks),
    "optimizer", or "sharded" (DTensor shards of FSDP2: each rank's part, recorded, never compared as replicas)."""
    for rec in probe.registry.live_ddps():
        return list(rec.module.named_parameters()), "ddp"
    if optimizer is not None:
        named = [
            (f"group{gi}.{pi}", p) for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])
        ]
        source = "sharded" if any(sharded(p) for _, p in named) else "optimizer"
        return [(n, local(p)) for n, p in named], source
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
    pick = (
        params if len(params) <= SAMPLE_TENSORS
        else [params[i * len(params) // SAMPLE_TENSORS] for i in range(SAMPLE_TENSORS)]
    )
    out: list[float] = []
    with torch.no_grad():
        for _, p in pick:
            n = p.numel()
            if n == 0:
                continue
            idx = torch.tensor(sorted({0, n // 3, (2 * n) // 3, n - 1}), device=p.device)
            out.extend(float(v) for v in p.detach().reshape(-1)[idx].double().cpu().tolist())
    return out


_INT_VIEW = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}
SAMPLE_VALUES = 256  # values sampled per step on the device (evenly spaced over the covered elements)


def device_fingerprint(params: list[tuple[str, Any]]) -> tuple[Any, Any, int, bool]:
    """(fingerprint, sample, elements covered, sampled) computed on the parameters' device in a few kernels,
    whatever the number of tensors. fingerprint: int64, per dtype group in order, the sum and the position-weighted
    sum of the covered elements' bit patterns — integer sums are exact and associative, so it is equal on every
    rank exactly when the covered bits are (up to a collision no real divergence produces). sample: float64
    values at evenly spaced positions of the covered elements, the same positions on every rank."""
    import torch

    total = sum(p.numel() for _, p in params)
    stride = max(1, -(-total // DIGEST_BUDGET))
    groups: dict[Any, list[Any]] = {}
    for _, p in params:
        groups.setdefault(p.dtype, []).append(p.detach().reshape(-1)[::stride])
    sums, samples = [], []
    covered = 0
    with torch.no_grad():
        for dtype, parts in groups.items():
            flat = torch.cat(parts)
            n = flat.numel()
            covered += n
            if n == 0:
                continue
            size = flat.element_size()
            if size in _INT_VIEW and not dtype.is_complex:
                bits = flat.view(getattr(torch, _INT_VIEW[size])).to(torch.int64)
            else:
                bits = flat.view(torch.uint8).to(torch.int64)
            weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
            sums.append(torch.stack([bits.sum(), (bits * weights).sum()]))
            if dtype.is_floating_point:
                k = min(n, SAMPLE_VALUES)
                idx = torch.div(torch.arange(k, device=flat.device) * (n - 1), max(k - 1, 1), rounding_mode="floor")
                samples.append(flat[idx].double())
        fingerprint = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.int64)
        sample = torch.cat(samples) if samples else torch.zeros(0, dtype=torch.float64)
    return fingerprint, sample, covered, stride > 1


def _on_device(params: list[tuple[str, Any]]) -> bool:
    return any(p.device.type != "cpu" for _, p in params)


def install(probe: Probe) -> None:
    from ddpdoctor.probe import readback

    state: dict[str, Any] = {"snapshot": None, "digests": {}}
    reader = readback.for_probe(probe)

    def record(step: int, params: list[tuple[str, Any]], source: str) -> tuple[str | None, int, bool, bool]:
        """Emit the `params` event of `step`; (digest or None when read back later, covered, sampled, on device)."""
        if _on_device(params) or reader.defer_cpu:
            fingerprint, sample, covered, sampled = device_fingerprint(params)

            def emit(host: list[Any]) -> None:
                d = hashlib.blake2b(host[0].numpy().tobytes(), digest_size=16).hexdigest()
                state["digests"] = {step: d}  # the final snapshot's digest, once its step is delivered
                probe.emit("params", step=step, digest=d, numel=covered, sampled=sampled,
                           values=[float(v) for v in host[1].tolist()], source=source, tensors=len(params),
                           on_device=True)

            reader.read([fingerprint, sample], emit, where="params digest")
            return None, covered, sampled, True
        d, covered, sampled = digest(params)
        probe.emit("params", step=step, digest=d, numel=covered, sampled=sampled, values=sample_values(params),
                   source=source, tensors=len(params))
        return d, covered, sampled, False

    def on_step(optimizer: Any) -> None:
        params, source = _model_params(probe, optimizer)
        if not params:
            return
        d, covered, sampled, on_device = record(probe.steps, params, source)
        # The final state is the state after the last step. Kept as a capped copy (on the device for CUDA),
        # never as references: the script may free its model before the run ends (a function that returns,
        # `del model`).
        state["snapshot"] = _snapshot(probe, params, source, d, covered, sampled, keep_on_device=on_device)

    def on_end() -> None:
        snap = state["snapshot"]
        if snap is None:
            return
        vec = snap.pop("vector")
        if "buffer_layout" in snap:  # kept on the device (CUDA): read once, now
            vec = vec.cpu()
            snap["digest"] = state["digests"].get(snap["step"])
            raw = snap.pop("buffer_values").cpu()
            layout = snap.pop("buffer_layout")
            snap["buffers"] = {name: hashlib.blake2b(raw[a:b].numpy().tobytes(), digest_size=16).hexdigest()
                               for name, a, b in layout}
        ref = probe.blob(vec.numpy().tobytes(), dtype="float32", count=int(vec.numel()), compress=False)
        probe.emit("params_final", vector=ref, **snap)

    def before_first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if state["initial"] or probe.quiet_steps or probe.ending:
            return None
        state["initial"] = True
        params, source = _model_params(probe, optimizer)
        if params:
            record(0, params, source)
        return None

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    state["initial"] = False
    handle = register_optimizer_step_pre_hook(
        lambda o, a, k: probe.safely("params before step", before_first_step, o, a, k)
    )
    probe.patcher.add_undo(handle.remove)
    probe.step_hooks.append(on_step)
    probe.end_hooks.append(on_end)


def _snapshot(probe: Probe, params: list[tuple[str, Any]], source: str, d: str | None, covered: int, sampled: bool,
              *, keep_on_device: bool = False) -> dict[str, Any]:
    """The state after this step, for `params_final`. With keep_on_device (CUDA), the copies stay on the device
    (new tensors: the script may free or change its model), two kernels whatever the model: the capped parameter
    vector and the normalisation buffers concatenated (their per-layer digests are taken at the end)."""
    import torch

    total = sum(p.numel() for _, p in params)
    stride = max(1, -(-total // FINAL_CAP))
    with torch.no_grad():
        if keep_on_device:
            parts = [p.detach().reshape(-1)[::stride].float() for _, p in params]
        else:
            parts = [p.detach().reshape(-1)[::stride].float().cpu() for _, p in params]
        vec = torch.cat(parts) if parts else torch.zeros(0)
    layers: list[tuple[str, Any, Any]] = []
    rec = next(iter(probe.registry.live_ddps()), None)
    if rec is not None:
        from torch.nn.modules.batchnorm import _NormBase

        for name, m in rec.module.named_modules():
            if isinstance(m, _NormBase) and getattr(m, "running_mean", None) is not None:
                layers.append((name, m.running_mean, m.running_var))
    out: dict[str, Any] = {"step": probe.steps, "digest": d, "numel": covered, "sampled": sampled, "vector": vec,
                           "vector_stride": stride, "source": source}
    if keep_on_device:
        # bytes of running_mean then running_var per layer, as the CPU digests hash them
        chunks, layout, offset = [], [], 0
        for name, mean, var in layers:
            pieces = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (mean, var)]
            size = sum(x.numel() for x in pieces)
            chunks.extend(pieces)
            layout.append((name, offset, offset + size))
            offset += size
        with torch.no_grad():
            out["buffer_values"] = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
        out["buffer_layout"] = layout
        return out
    buffers: dict[str, str] = {}
    for name, mean, var in layers:
        h = hashlib.blake2b(digest_size=16)
        h.update(_flat_bytes(mean, 1))
        h.update(_flat_bytes(var, 1))
        buffers[name] = h.hexdigest()
    out["buffers"] = buffers
    return out
