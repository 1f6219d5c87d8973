"""DD207 eval-in-train-mode: an evaluation forward (gradients disabled) ran BatchNorm layers in training mode.

What it does: the batchnorm recorder notes every model forward whose BN layers are in training mode while
gradients are disabled (`torch.no_grad()` / `torch.inference_mode()`), with the user line that called the model.
The analysis reports the number of such forwards per site and rank, the BN layers involved, whether SyncBN
synchronised in them, and — from the recorded update sequence and the layer's momentum — how much of the final
running statistics those batches make up (each update's weight in the exponential moving average). Calls made
through a library helper that recalibrates BN on purpose (torch.optim.swa_utils.update_bn) are not reported, and
neither are forwards of a module whose parameters no optimizer trains (none held with requires_grad) made while
training goes on: a momentum / EMA / teacher encoder (MoCo's key encoder, BYOL's target network, DINO's teacher)
runs its BatchNorm in training mode without gradients by design; nor forwards whose BatchNorm layers have momentum
None (a cumulative average: a precise-BN recalibration of the running statistics). The report notes them and
drops a static DD207 at that call site.

A run whose ranks each took optimizer steps without forwarding a single BatchNorm layer measured that the models
hold none: a static DD207 (a source pattern) is dropped with that count — a BN-free network built where static
analysis cannot see it, an EMA / teacher encoder of LayerNorm blocks.

Measured at each forward static analysis suspected: no-grad forwards there that ran BatchNorm in eval mode (the
model was put in eval mode in a way the source did not show) drop the static finding with the count; a line where
no forward ran during the probe keeps it, with a note.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_ranks, pct
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd207_eval_in_train_mode import CODE

MEASURES = Measures(
    scope="site",
    what="the model forwards run without gradients, per call site: BatchNorm in training or in eval mode, and "
    "whether the module is one no optimizer trains (a momentum / EMA / teacher encoder)",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the forward sites measured running BN in training mode without gradients",
    measure=key("sites"))


def _measure_eval_sites(ctx: RunContext, train_mode: set[tuple[str, int]], by_design: set[tuple[str, int]]) -> None:
    """Static sites where the no-grad forwards ran BatchNorm in eval mode, or where no forward ran at all."""
    evals: dict[tuple, int] = {}
    recorded = False  # runs recorded before eval-mode sites were: nothing to say about lines that did not show up
    for p in ctx.ranks.values():
        for e in p.of("bn_final"):
            recorded = recorded or "eval_no_grad_sites" in e
            for s in e.get("eval_no_grad_sites") or ():
                key = ctx.where({"file": s.get("file"), "line": s.get("line")})
                evals[key] = evals.get(key, 0) + int(s.get("forwards") or 0)
    shown_train = {ctx.where({"file": f, "line": ln}) for f, ln in train_mode | by_design}
    for site in ctx.static_sites(CODE):
        key = (site["file"], site["line"])
        if key in shown_train:
            continue
        if key in evals:
            ctx.measured(CODE, site=site, reason=(
                f"the {evals[key]} no-grad forwards at {site['file']}:{site['line']} (all ranks) ran BatchNorm in eval "
                "mode: the model was put in eval mode before them"
            ))
        elif recorded:
            ctx.not_measured(CODE, site=site, reason=f"no forward ran at line {site['line']} during the probe")


def _no_batchnorm_ran(ctx: RunContext) -> int:
    """Optimizer steps of the rank that took fewest, when every rank took at least one and no rank forwarded a
    single BatchNorm layer (none announced): the models this run trained hold none, so an evaluation in training
    mode normalises nothing with its own statistics. 0 when that is not what the run measured."""
    if not ctx.ranks or any(p.of("bn_layer") for p in ctx.ranks.values()):
        return 0
    if any("batchnorm" in str(e.get("where", "")).lower() for p in ctx.ranks.values() for e in p.of("internal_error")):
        return 0  # the BatchNorm recorder failed: no layer announced is not a layer absent
    return min((ctx.steps_of(r) for r in ctx.ranks), default=0)


def analyze(ctx: RunContext) -> list[Finding]:
    steps = _no_batchnorm_ran(ctx)
    if steps:
        # a source pattern (a forward without gradients, no model.eval() seen) on a model without BatchNorm: an
        # EMA / teacher encoder of LayerNorm blocks, a BN-free network built where static analysis cannot see
        if ctx.static_sites(CODE):
            ctx.measured(CODE, run_wide=True, reason=(
                f"no BatchNorm layer ran in the {steps} training step{'s' if steps != 1 else ''} every rank took: the "
                "models this run trained hold none, so a forward in training mode without gradients normalises "
                "nothing with its own statistics"
            ))
        return []
    sites: dict[tuple[str, int], dict[str, Any]] = {}
    by_design: dict[tuple[str, int], dict[str, Any]] = {}
    for rank, p in ctx.ranks.items():
        counts = {}
        for e in p.of("bn_final"):
            for s in e.get("no_grad_sites") or ():
                counts[(str(s.get("file")), int(s.get("line") or 0))] = int(s.get("forwards") or 0)
        steps = ctx.steps_of(rank)
        for e in p.of("bn_train_no_grad"):
            if not e.get("direct", True):
                continue
            if e.get("cumulative_average"):
                # momentum None: the running statistics are being recomputed as an exact average over these
                # batches (precise BN), which is what train mode under no_grad is for here
                site = e.get("site") or {}
                by_design.setdefault((str(site.get("file")), int(site.get("line") or 0)), {"site": site,
                                                                                         "module": None})
                continue
            teacher = e.get("untrained_module")
            if teacher and int(e.get("step") or 0) < steps:
                # a module no optimizer trains, forwarded without grad inside training (steps followed): a
                # momentum / EMA / teacher encoder (MoCo, BYOL, DINO), whose train-mode BN is the method
                site = e.get("site") or {}
                by_design.setdefault((str(site.get("file")), int(site.get("line") or 0)), {"site": site,
                                                                                         "module": teacher})
                continue
            site = e.get("site") or {}
            key = (str(site.get("file")), int(site.get("line") or 0))
            entry = sites.setdefault(key, {"site": site, "ranks": {}, "event": e})
            entry["ranks"][rank] = counts.get(key, 1)
    _measure_eval_sites(ctx, set(sites), set(by_design))
    for entry in by_design.values():
        m = entry["module"]
        if m is None:
            reason = (
                f"the no-grad training-mode forwards at {ctx.at(entry['site'])} ran BatchNorm with momentum None (a "
                "cumulative average): a recalibration of the running statistics (precise BN), not an evaluation"
            )
        else:
            what = f"{m.get('cls')}{' (' + m['path'] + ')' if m.get('path') else ''}"
            reason = (
                f"the no-grad training-mode forward of {what} at {ctx.at(entry['site'])} runs a module whose "
                f"{m.get('params')} parameters no optimizer trains, inside training steps: a momentum / EMA / "
                "teacher encoder, whose train-mode BatchNorm is part of the method, not an evaluation"
            )
        ctx.clear(CODE, reason=reason, site=entry["site"])
        ctx.notes.append(f"DD207 not reported: {reason}")
    if not sites:
        return []
    bn = bc.bn_for(ctx)
    share, share_layer = _eval_share(bn)
    synced = 0
    if bn is not None:
        synced = sum(
            1 for layer in bn.layers for rl in layer.ranks.values() for f in rl.forwards if not f.grad and f.synced
        )
    first_key = min(sites, key=lambda k: sites[k]["event"].get("t", 0.0))
    first = sites[first_key]
    ev = first["event"]
    forwards = sum(sum(s["ranks"].values()) for s in sites.values())
    ranks = sorted({r for s in sites.values() for r in s["ranks"]})
    context = "torch.inference_mode()" if ev.get("inference_mode") else "torch.no_grad()"
    layers = int(ev.get("bn_layers_in_train_mode") or 0)
    per_rank = max(first["ranks"].values())
    message = (
        f"{per_rank} model forward{'s' if per_rank != 1 else ''} per rank under {context} at {ctx.at(first['site'])} "
        f"ran {layers} BatchNorm layer{'s' if layers != 1 else ''} in training mode ({fmt_ranks(first['ranks'])}): "
        "each evaluation batch was normalised with its own statistics"
    )
    if ev.get("tracks_running_stats", True):
        if share is not None and share > 0:
            message += (
                f" and updated the running statistics — {pct(share)} of the final running statistics of "
                f"{share_layer} come from those batches"
            )
        else:
            message += " and updated the running statistics with evaluation data"
    if synced or int(ev.get("syncbn_layers_in_train_mode") or 0):
        message += "; SyncBatchNorm synchronised in them (a hang if only some ranks evaluate, DD206)"
    evidence = {
        "sites": [
            {"file": ctx.path(s["site"].get("file")), "line": s["site"].get("line"),
             "forwards_per_rank": {str(r): n for r, n in s["ranks"].items()}}
            for s in sites.values()
        ],
        "inference_mode": bool(ev.get("inference_mode")),
        "bn_layers_in_train_mode": layers,
        "syncbn_layers_in_train_mode": int(ev.get("syncbn_layers_in_train_mode") or 0),
        "syncbn_synchronised_forwards": synced,
        "eval_share_of_running_stats": bc.finite(share),
        "eval_share_layer": share_layer,
        "syncbn_replay_rel_error": bc.replay_errors(ctx),
    }
    return [
        ctx.finding(CODE, message=message, site=first["site"], ranks=ranks,
                    evidence=evidence, magnitude=float(share or forwards))
    ]


def _eval_share(bn: bc.BNRun | None) -> tuple[float | None, str | None]:
    """The largest weight, over layers and ranks, that the no-grad training-mode updates have in the final
    running statistics (exponential moving average weights of the recorded update sequence)."""
    if bn is None:
        return None, None
    best: tuple[float | None, str | None] = (None, None)
    for layer in bn.layers:
        if not layer.info.get("track_running_stats", True):
            continue
        for rl in layer.ranks.values():
            if not any(not f.grad for f in rl.forwards):
                continue
            weights = bc.ema_weights(rl, layer.momentum)
            share = sum(w for w, f in zip(weights, rl.forwards) if not f.grad)
            if best[0] is None or share > best[0]:
                best = (share, layer.name)
    return best
