"""DD402 no-warmup: the lr is scaled up with the world size and nothing ramps it up.

What it flags (low): an lr (or the loss) multiplied by the world size or the global batch when the file has no
warmup: no LinearLR/OneCycleLR/ConstantLR scheduler, nothing named "warmup". Large scaled learning rates are
unstable in the first iterations; the linear scaling rule comes with a gradual warmup (Goyal et al., 2017).

What stays silent: any warmup scheduler or warmup logic; lr divided by the world size; unscaled lr (DD401).

Confidence: likely when the file has no scheduler at all; possible when a LambdaLR/SequentialLR or custom schedule
could ramp (we cannot tell from its code that it does not).
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor import torchnames as N
from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd402_no_warmup import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached


def check(script: ScriptModel) -> Iterator[Finding]:
    # `loss *= world_size` is left alone: it is a deliberate sum-not-mean choice, not an lr bump
    sites = [ev for ev in script.lr_scaled_up if ev.kind != "loss_scaled"]
    if not sites:
        return
    schedulers = [ev.data["obj"].props.get("cls") for ev in script.of("scheduler")]
    if any(cls in N.WARMUP_SCHEDULERS for cls in schedulers) or "warm" in script.words:
        return
    site = sites[0]
    confidence = Confidence.POSSIBLE if schedulers else Confidence.LIKELY
    if site.kind == "optimizer" and site.data["obj"].props.get("lr_node") is not None:
        what = f"lr={script.text(site.data['obj'].props['lr_node'])}"
    else:
        what = script.text(site.node)
    yield script.finding(
        CODE,
        line=site,
        message=f"`{what}` at line {site.line} scales the step size with the world size, but no warmup schedule ramps it "
        f"up, so the first iterations run at the full scaled lr (unstable from about 4 processes on)",
        confidence=cap_unreached(confidence, site),
        evidence={"scaling_line": site.line, "schedulers": [s for s in schedulers if s]},
    )
