"""Does a converted BatchNorm layer compute what the layer it replaced computed? (DD208)

`compare_functions(original, converted, x)` runs both on the same input, at identical weights and running
statistics, on copies (the user's layers are never touched), in train and in eval mode, with the converted layer
normalising over this rank's batch alone (`ddpdoctor.probe.arms.local_stats`: what arm L computes) — so the only
thing that can differ is the forward code itself. eps and momentum are copied from the original onto the
converted copy first: a conversion that lost them is a different defect (DD209), reported from the attributes.

Deterministic: both sides run the same batch-norm kernel on the same numbers, so a plain BatchNorm converted to
SyncBatchNorm agrees bit for bit; the tolerance only absorbs a reordered computation (a fused subclass that
applies the same affine transform in a different order). A difference above it is a changed function — a fused
activation dropped, a subclass's own forward replaced — measured as the largest difference relative to the
largest output.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

# relative tolerance by the output dtype: float32 rounding of a reordered computation stays below 1e-6
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for item in out:
            t = first_tensor(item)
            if t is not None:
                return t
    if isinstance(out, dict):
        for item in out.values():
            t = first_tensor(item)
            if t is not None:
                return t
    return None


def compare_outputs(a: Any, b: Any) -> dict[str, Any]:
    """{"equal", "max_abs", "rel", "tolerance"} of two outputs (first tensors); shapes that differ are unequal."""
    ta, tb = first_tensor(a), first_tensor(b)
    if ta is None or tb is None:
        return {"equal": ta is None and tb is None, "max_abs": None, "rel": None, "tolerance": None,
                "reason": "no tensor output"}
    if ta.shape != tb.shape:
        return {"equal": False, "max_abs": None, "rel": None, "tolerance": None,
                "reason": f"output shapes differ: {tuple(ta.shape)} vs {tuple(tb.shape)}"}
    da, db = ta.detach().double(), tb.detach().double()
    both_nan = torch.isnan(da) & torch.isnan(db)
    diff = torch.where(both_nan, torch.zeros_like(da), (da - db).abs())
    max_abs = float(torch.nan_to_num(diff, nan=float("inf")).max().item()) if diff.numel() else 0.0
    scale = max(float(torch.nan_to_num(da.abs(), nan=0.0).max().item()) if da.numel() else 0.0,
                float(torch.nan_to_num(db.abs(), nan=0.0).max().item()) if db.numel() else 0.0, 1e-30)
    tol = TOLERANCE.get(ta.dtype, 1e-4)
    rel = max_abs / scale
    return {"equal": bool(rel <= tol), "max_abs": max_abs, "rel": rel, "tolerance": tol}


def _load_common_state(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """Copy parameters and buffers that both modules have under the same name and shape into `target`."""
    mine = target.state_dict()
    theirs = source.state_dict()
    common = {k: v for k, v in theirs.items() if k in mine and mine[k].shape == v.shape}
    if common:
        target.load_state_dict(common, strict=False)


def compare_functions(original: torch.nn.Module, converted: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Outputs of `original` (as it was before the conversion) and `converted` (normalising locally) on `x`, at
    the converted layer's current weights and running statistics; {"train": compare_outputs, "eval": ...}.

    Raises what the layers raise; `ddpdoctor.probe.arms.CollectiveInCheck` when the converted layer's own
    forward communicates (then the caller reports the check as not measurable)."""
    from ddpdoctor.probe.arms import local_stats, no_collectives, process_group_memo

    memo = process_group_memo(original, converted)
    results: dict[str, Any] = {}
    with torch.no_grad(), local_stats(), no_collectives():
        xs = x.detach()
        for mode in ("eval", "train"):  # eval first: a train forward moves the copies' running statistics
            p = copy.deepcopy(original, dict(memo))
            c = copy.deepcopy(converted, dict(memo))
            _load_common_state(p, converted)
            for attr in ("eps", "momentum"):
                if hasattr(p, attr):
                    setattr(c, attr, getattr(p, attr))
            p.train(mode == "train")
            c.train(mode == "train")
            results[mode] = compare_outputs(p(xs), c(xs))
    results["equal"] = all(results[m]["equal"] for m in ("train", "eval"))
    return results
