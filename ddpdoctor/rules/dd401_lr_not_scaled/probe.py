"""DD401 lr-not-scaled: the learning rate does not follow the global batch relative to the reference recipe.

What it does: measures the global batch the ranks trained on — per-rank batch (the most common batch size of the
training loader) × world size × micro-batches per optimizer step (gradient accumulation: batches from
grad-enabled loaders, capped by the step's backward passes) — and compares the
optimizer's lr with the reference recipe (--base-lr / --base-batch) scaled by the rule for its family: linear
for SGD-like optimizers, square root for Adam-family / LAMB / Adagrad / RMSprop (--lr-scaling auto). Without a
reference recipe it only notes the global batch (and a static suspicion stays, with a note saying the probe could
not settle it without one).

What it measures of the static suspicions: an optimizer constructor static analysis flagged that never ran while
the ranks trained (an `elif args.optimizer == "sgd":` branch of a script run with another `--optimizer`) is
dropped, naming the optimizer the ranks stepped; so is one whose constructed lr no step used (the script sets the
lr itself), and one whose lr matches the scaled reference.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any

from ddpdoctor.analyses.context import RunContext, fmt_num, pct
from ddpdoctor.findings import Confidence, Finding, Measures
from ddpdoctor.levels import Severity
from ddpdoctor.rules.dd401_lr_not_scaled import CLEAR_WITHIN, CODE, TOLERANCE
from ddpdoctor.rundata import rle_expand

MEASURES = Measures(
    scope="site",
    what="which optimizer constructors ran and the lr each step used, against the measured global batch and the "
    "reference recipe (--base-lr/--base-batch)",
)

SQRT_FAMILY = ("adam", "lamb", "adagrad", "rmsprop", "adafactor", "adadelta")


def scaling_rule(optimizer_cls: str, lr_scaling: str) -> str:
    if lr_scaling in ("linear", "sqrt", "none"):
        return lr_scaling
    return "sqrt" if any(k in optimizer_cls.lower() for k in SQRT_FAMILY) else "linear"


def micro_batches_per_step(train_steps: list[dict[str, Any]], opt_steps: list[dict[str, Any]]) -> list[int]:
    """Micro-batches each optimizer step accumulated: the batches drawn from grad-enabled loaders since the previous
    step, but never more than the backward passes of that step. Either count alone over-counts: a batch fetched with
    grad enabled but never trained on (an evaluation loop that disables grad only inside its step function, a
    `next(iter(loader))` peek) is not a micro-batch, and two losses backpropagated for one batch are not two.
    Steps are matched on (optimizer, step)."""
    backwards = {(e.get("opt"), e.get("step")): int(e.get("backwards") or 0) for e in train_steps}
    out: list[int] = []
    for e in opt_steps:
        batches = int(e.get("train_batches") or 0)
        b = backwards.get((e.get("opt"), e.get("step")))
        if b:
            batches = min(batches, b) if batches else b
        if batches:
            out.append(batches)
    return out


def measured_batch(ctx: RunContext) -> dict[str, Any] | None:
    """Per-rank batch, accumulation, world size and global batch, from the training loaders and steps."""
    sizes: list[int] = []
    micro: list[int] = []
    steps = 0
    for p in ctx.ranks.values():
        for e in p.of("loader_iter_end"):
            if e.get("training"):
                s = [x for x in rle_expand(e.get("sizes")) if x > 0]
                if e.get("reason") == "exhausted" and len(s) > 1:
                    s = s[:-1]  # the last batch of an epoch may be partial
                sizes.extend(s)
        st = p.of("optimizer_step")
        steps += len(st)
        micro.extend(micro_batches_per_step(p.of("train_step"), st))
    if not sizes or not steps:
        return None
    per_rank = Counter(sizes).most_common(1)[0][0]
    accumulation = max(1, round(statistics.median(micro))) if micro else 1
    world = ctx.world_size
    return {"per_rank_batch": per_rank, "world_size": world, "accumulation": accumulation,
            "global_batch": per_rank * world * accumulation}


def main_optimizer(ctx: RunContext) -> dict[str, Any] | None:
    """The optimizer that stepped most on the lowest rank, with the lr of its largest param group."""
    for p in ctx.ranks.values():
        inits = {e["opt"]: e for e in p.of("optimizer_init")}
        counts = Counter(e.get("opt") for e in p.of("optimizer_step"))
        if not counts:
            continue
        opt_id = counts.most_common(1)[0][0]
        opt = inits.get(opt_id)
        if not opt or not opt.get("groups"):
            continue
        gi = max(range(len(opt["groups"])), key=lambda i: opt["groups"][i].get("numel") or 0)
        group = opt["groups"][gi]
        lr = group.get("initial_lr", group.get("lr"))
        used = []
        for e in p.of("optimizer_step"):
            lrs = e.get("lrs") or []
            if e.get("opt") == opt_id and gi < len(lrs) and isinstance(lrs[gi], (int, float)):
                used.append(float(lrs[gi]))
        scheduled = [
            (e.get("initial_lrs") or [])[gi] for e in p.of("train_step")
            if e.get("opt") == opt_id and gi < len(e.get("initial_lrs") or [])
        ]
        if isinstance(lr, (int, float)):
            return {"cls": opt.get("cls"), "lr": float(lr), "site": opt.get("site"), "groups": len(opt["groups"]),
                    "constructed_lr": group.get("lr"), "used": used,
                    "scheduler_base": next((x for x in scheduled if isinstance(x, (int, float))), None)}
    return None


def used_lr_text(opt: dict[str, Any]) -> str:
    """The lr the ranks actually stepped with: one value, or the first and last of a schedule."""
    used = opt.get("used") or []
    if not used:
        return f"lr {fmt_num(opt['lr'])}"
    if max(used) - min(used) <= 1e-12 * max(1.0, abs(max(used))):
        return f"lr {fmt_num(used[0])} at every observed step"
    return f"lr {fmt_num(used[0])} → {fmt_num(used[-1])} over {len(used)} observed steps (peak {fmt_num(max(used))})"


def _set_at_run_time(opt: dict[str, Any]) -> bool:
    """No observed step used the lr the optimizer was constructed with: the script sets it itself (a per-iteration
    schedule written in the loop, a scaling applied after construction)."""
    built = opt.get("constructed_lr")
    used = opt.get("used") or []
    base = opt.get("scheduler_base")
    if (
        isinstance(base, (int, float))
        and isinstance(built, (int, float))
        and abs(base - built) <= 1e-9 * max(1.0, abs(built))
    ):
        return False  # a torch scheduler (warmup, decay) multiplies the constructed lr: that lr is the recipe's
    return isinstance(built, (int, float)) and bool(used) and all(
        abs(u - built) > 1e-9 * max(1.0, abs(built)) for u in used
    )


def _constructors_not_run(ctx: RunContext, opt: dict[str, Any] | None) -> None:
    """Static suspicions on optimizer constructors no rank executed while the ranks trained: a branch for another
    option value (`elif args.optimizer == "sgd":`). Optimizers are built before training, so one not built by
    then was not this run's."""
    built = [e.get("site") for _, e in ctx.run.events("optimizer_init")]
    stepped = {r: ctx.steps_of(r) for r in ctx.ranks}
    for site in ctx.static_sites(CODE):
        line = site["evidence"].get("optimizer_line") or site["line"]
        where = {"file": site["file"], "line": line}
        if ctx.ran_at(where, built):
            continue
        if not any(stepped.values()):
            ctx.not_measured(CODE, site=site, reason="no optimizer step was observed, so the optimizer the ranks "
                             "train with is unknown")
            continue
        took = (f"the ranks stepped the {opt['cls']} built at {ctx.at(opt['site'])} "
                f"({min(n for n in stepped.values() if n)} steps each)") if opt else "the ranks stepped another one"
        ctx.measured(CODE, site=site, reason=(
            f"the {site['evidence'].get('optimizer') or 'optimizer'} constructor at {site['file']}:{line} never ran "
            f"while the ranks trained — {took}: a branch this run did not take"
        ))


def _default_quoted_under_schedule(ctx: RunContext, opt: dict[str, Any]) -> list[Finding]:
    """A static suspicion that quotes the optimizer's default lr where a schedule drives the lr the ranks stepped
    with: the default is not the lr the run used, the measurement is. The static finding is replaced by the same
    low suspicion, quoting the measured lr (still not judged without --base-lr/--base-batch)."""
    used = opt.get("used") or []
    if len(used) < 2 or max(used) - min(used) <= 1e-12 * max(1.0, abs(max(used))):
        return []
    file, line = ctx.where(opt["site"])
    quoted = [site for site in ctx.static_sites(CODE) if site["evidence"].get("lr_source") == "default"
              and site["file"] == file and (site["evidence"].get("optimizer_line") or site["line"]) == line]
    if not quoted:
        return []
    for site in quoted:
        ctx.clear(CODE, site=site, reason=(
            f"the {opt['cls']} default lr it quotes is not what the ranks stepped with: a schedule drives the lr "
            f"({used_lr_text(opt)})"
        ))
    message = (
        f"{opt['cls']} at {ctx.at(opt['site'])} steps with {used_lr_text(opt)} (a schedule drives it; the "
        f"optimizer's default lr {fmt_num(opt['constructed_lr'])} is what it was built with) and nothing scales "
        "it by world_size, while DDP averages gradients over world_size × the per-process batch: if the schedule "
        "is the single-GPU one, the global batch is world_size times the one it was tuned for (pass "
        "--base-lr/--base-batch to measure it)"
    )
    return [ctx.finding(CODE, message=message, severity=Severity.LOW, confidence=Confidence.POSSIBLE,
                        site=opt["site"], ranks=sorted(ctx.ranks),
                        evidence={"optimizer": opt["cls"], "constructed_lr": opt["constructed_lr"],
                                  "used_lr": used[:20], "lr_source": "measured"})]


def analyze(ctx: RunContext) -> list[Finding]:
    batch = measured_batch(ctx)
    opt = main_optimizer(ctx)
    _constructors_not_run(ctx, opt)
    if batch is None or opt is None:
        return []
    breakdown = (
        f"{batch['per_rank_batch']} per rank × {batch['world_size']} rank{'s' if batch['world_size'] != 1 else ''}"
        f" × {batch['accumulation']} accumulation step{'s' if batch['accumulation'] != 1 else ''}"
    )
    s = ctx.settings
    if _set_at_run_time(opt):
        ctx.measured(
            CODE,
            site=opt["site"],
            reason=(
                f"the script sets the lr itself at run time: the ranks stepped with {used_lr_text(opt)}, never the "
                f"{fmt_num(opt['constructed_lr'])} the optimizer was constructed with"
            ),
            evidence={"constructed_lr": opt["constructed_lr"], "used_lr": opt["used"][:20]},
        )
    if s.base_lr is None or s.base_batch is None:
        ctx.notes.append(
            f"global batch {batch['global_batch']} ({breakdown}); {opt['cls']} {used_lr_text(opt)} — pass "
            "--base-lr/--base-batch (the single-process recipe) to check lr scaling"
        )
        scheduled = [] if _set_at_run_time(opt) else _default_quoted_under_schedule(ctx, opt)
        if scheduled:
            return scheduled
        if not _set_at_run_time(opt):
            ctx.not_measured(CODE, site=opt["site"], reason=(
                "it needs --base-lr/--base-batch (the single-process recipe) to judge the lr the ranks stepped with"
            ))
        return []
    rule = scaling_rule(opt["cls"] or "", s.lr_scaling)
    factor = batch["global_batch"] / float(s.base_batch)
    expected = s.base_lr * (factor if rule == "linear" else math.sqrt(factor) if rule == "sqrt" else 1.0)
    ratio = opt["lr"] / expected if expected else float("inf")
    if 1 / CLEAR_WITHIN <= ratio <= CLEAR_WITHIN:
        how = {"linear": "linearly scaled", "sqrt": "square-root scaled", "none": "unscaled"}[rule]
        ctx.measured(
            CODE,
            site=opt["site"],
            reason=(
                f"{opt['cls']} lr {fmt_num(opt['lr'])} "
                + ("matches" if abs(ratio - 1) < 0.005 else f"is within {pct(abs(ratio - 1))} of")
                + f" the {how} reference lr {fmt_num(expected)} ({fmt_num(s.base_lr)} at batch {s.base_batch}; "
                f"measured global batch "
                f"{batch['global_batch']} = {breakdown})"
            ),
            evidence={**batch, "lr": opt["lr"], "expected_lr": expected, "ratio": ratio, "rule": rule},
        )
        return []
    if 1 / TOLERANCE <= ratio <= TOLERANCE:
        return []
    rule_text = {"linear": "the linear scaling rule", "sqrt": "the square-root scaling rule (Adam family)",
                 "none": "no scaling (--lr-scaling none)"}[rule]
    if abs(opt["lr"] - s.base_lr) <= 1e-12 * max(1.0, abs(s.base_lr)):
        what = "is the single-process value"
    else:
        what = f"is {fmt_num(ratio)}× the expected value"
    message = (
        f"{opt['cls']} lr {fmt_num(opt['lr'])} at {ctx.at(opt['site'])} {what}, but the global batch is "
        f"{batch['global_batch']} ({breakdown}) vs the reference {s.base_batch} at lr {fmt_num(s.base_lr)}: "
        f"{rule_text} expects lr {fmt_num(expected)}"
    )
    return [
        ctx.finding(
            CODE,
            message=message,
            fix_variant="probe",
            fix_args={
                "base_lr": fmt_num(s.base_lr),
                "ratio": f"(global_batch / {s.base_batch})^0.5" if rule == "sqrt" else f"global_batch / {s.base_batch}",
                "expected": fmt_num(expected),
            },
            site=opt["site"],
            ranks=sorted(ctx.ranks),
            evidence={**batch, "optimizer": opt["cls"], "lr": opt["lr"], "base_lr": s.base_lr,
                      "base_batch": s.base_batch, "rule": rule, "expected_lr": expected, "ratio": ratio},
            magnitude=abs(math.log2(ratio)) if ratio > 0 else 0.0,
        )
    ]
