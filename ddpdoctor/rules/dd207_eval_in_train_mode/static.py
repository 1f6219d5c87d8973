"""DD207 eval-in-train-mode: an evaluation forward under no_grad while the model is still in training mode.

What it flags: a forward of a trained model (wrapped in DDP, or optimised) inside `torch.no_grad()` /
`torch.inference_mode()` (or a function decorated with them) when, at that point of the run, the last mode call
on that model was `.train()` or there was none: BatchNorm then normalises with the evaluation batch's own
statistics and overwrites its running statistics with evaluation data — and SyncBN all-reduces them.

What stays silent: `model.eval()` (or `model.module.eval()`, or `model.train(False)`) before the evaluation, at
any distance (another function, a loop iteration before); no_grad forwards of other models (EMA, teachers);
models defined in the file without BatchNorm; forwards that recompute BatchNorm statistics on purpose — after
`reset_running_stats()`, `m.momentum = None` or `m.momentum = 1.0` in the same call or one around it (precise
BN).

Confidence: likely when the model has BatchNorm (torchvision CNNs, classes of the file with BN, SyncBN
conversion); possible when that is unknown (timm/hub models).
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd207_eval_in_train_mode import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached


def check(script: ScriptModel) -> Iterator[Finding]:
    trained = script.trained_families
    resets = script.of("bn_stats_reset")
    for fw in script.of("forward"):
        if fw.data["inside_forward"] or fw.grad_off is not True:
            continue
        if any(r.seq < fw.seq and fw.frames[: len(r.frames)] == r.frames for r in resets):
            continue  # statistics reset first, in this call or one around it: recomputing them is the point
        if tuple(fw.data["modes"]) != ("train",):
            continue
        fams = [t.family for t in fw.data["target"] if t.family is not None]
        fam = next((f for f in fams if f in trained), None)
        if fam is None or fam.has_bn is False:
            continue
        confidence = Confidence.LIKELY if fam.has_bn else Confidence.POSSIBLE
        callee = script.text(getattr(fw.node, "func", fw.node))
        syncbn = " and SyncBN all-reduces them across ranks" if fam.syncbn_line else ""
        yield script.finding(
            CODE,
            line=fw,
            message=f"`{callee}` runs an evaluation forward under no_grad at line {fw.line} while the model is in "
            f"training mode (no .eval() before it), so BatchNorm normalises with evaluation-batch statistics and "
            f"folds them into its running stats{syncbn}",
            confidence=cap_unreached(confidence, fw),
            evidence={"line": fw.line, "callee": callee, "has_batchnorm": fam.has_bn, "syncbn": bool(fam.syncbn_line)},
        )
