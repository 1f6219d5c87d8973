"""DD101 sync-bn-after-ddp: convert_sync_batchnorm applied to a model DDP had already wrapped.

What it does: finds the conversion (called on the DDP object, or on a module whose parameters a DDP already
owned, or SyncBatchNorm layers registered under a DDP-owned module), then reports what it measured on this torch
at the first optimizer step: are the layers SyncBatchNorm when the forward runs, are their parameters the ones DDP
reduces and the optimizer updates, is DDP's mixed precision in use, and do the BN running statistics agree across
ranks at the end. Ranks itself by that measurement: convert-after-wrap keeps the same Parameter objects in
torch >= 1.8, so when everything checks out it is `low` (fragile, skips DDP's SyncBN checks), not a bug.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.context import RunContext, pct
from ddpdoctor.findings import Finding, Measures, Severity
from ddpdoctor.rules.dd101_sync_bn_after_ddp import CODE

MEASURES = Measures(
    scope="site",
    what="each convert_sync_batchnorm call that ran: whether a DDP already held the model it converted",
)


def _layers(n: object) -> str:
    return f"{n} SyncBatchNorm layer runs" if n == 1 else f"{n} SyncBatchNorm layers run"


def _measure_conversions(ctx: RunContext) -> None:
    """Conversions that ran on a model no DDP held yet: the documented order, measured at their call site."""
    wraps = [e for _, e in ctx.run.events("ddp_init") if e.get("ok")]
    done: set[tuple] = set()
    for _, e in ctx.run.events("sync_bn_convert"):
        key = ctx.where(e.get("site"))
        if e.get("arg_is_ddp") or e.get("owned_by_ddp") or key in done:
            continue
        done.add(key)
        after = f"; DDP wrapped it afterwards at {ctx.at(wraps[0].get('site'))}" if wraps else ""
        ctx.measured(CODE, site=e.get("site"), reason=(
            f"convert_sync_batchnorm at {ctx.at(e.get('site'))} ran on a {e.get('arg_class')} that no DDP held yet "
            f"({e.get('converted')} BatchNorm layers converted){after}"
        ))


def analyze(ctx: RunContext) -> list[Finding]:
    _measure_conversions(ctx)
    converts = [(p, e) for p, e in ctx.run.events("sync_bn_convert") if e.get("arg_is_ddp") or e.get("owned_by_ddp")]
    registered = list(ctx.run.events("syncbn_registered_in_ddp"))
    if not converts and not registered:
        return []
    site = converts[0][1].get("site") if converts else registered[0][1].get("site")
    checks = [e for _, e in ctx.run.events("model_check")]
    torch_version = next((e.get("torch") for _, e in ctx.run.events("torch_ready")), None)
    problems: list[str] = []
    severity = Severity.LOW
    measured: dict[str, Any] = {"model_checks": len(checks)}
    if checks:
        c = checks[0]
        sb = int(c.get("syncbn_layers") or 0)
        plain = sum(n for k, n in (c.get("norm_layers") or {}).items() if k.startswith("BatchNorm"))
        in_opt = c.get("syncbn_params_in_optimizer")
        in_ddp = c.get("syncbn_params_in_ddp")
        measured.update(syncbn_layers=sb, plain_bn_layers=plain, syncbn_params_in_optimizer=in_opt,
                        syncbn_params_in_ddp=in_ddp, mixed_precision=c.get("mixed_precision"),
                        step=c.get("step"))
        if sb == 0:
            problems.append(f"the forward still runs {plain} plain BatchNorm layers (the conversion did not reach the DDP model)")
            severity = Severity.HIGH
        if in_opt is not None and in_opt < 1.0:
            problems.append(f"the optimizer holds only {pct(in_opt)} of the SyncBatchNorm parameters")
            severity = Severity.HIGH
        if in_ddp is not None and in_ddp < 1.0:
            problems.append(f"DDP reduces only {pct(in_ddp)} of the SyncBatchNorm parameters")
            severity = Severity.HIGH
        if c.get("mixed_precision"):
            problems.append("DDP's mixed_precision cast hooks were installed before the conversion and miss the new layers")
            severity = max(severity, Severity.MEDIUM)
    else:
        problems.append("no optimizer step ran, so the probe could not check the converted model")
        severity = Severity.MEDIUM
    # running statistics at the end: SyncBN layers see the global batch, so they agree across ranks
    finals = {r: p.last("params_final") for r, p in ctx.ranks.items()}
    finals = {r: e for r, e in finals.items() if e and e.get("buffers")}
    if len(finals) >= 2:
        ref = next(iter(finals.values()))["buffers"]
        disagree = sorted({name for e in finals.values() for name, d in e["buffers"].items() if ref.get(name) != d})
        measured["bn_buffers_disagreeing"] = disagree
        measured["bn_buffers_compared"] = len(ref)
    on = f"torch {torch_version}" if torch_version else "this torch"
    if problems:
        message = f"convert_sync_batchnorm runs after DDP wrapping at {ctx.at(site)}, and on {on} " + "; ".join(problems)
    else:
        stats = ""
        if "bn_buffers_compared" in measured:
            n, bad = measured["bn_buffers_compared"], measured["bn_buffers_disagreeing"]
            stats = f", and running statistics agree across ranks at the end ({n - len(bad)} of {n} layers)"
        message = (
            f"convert_sync_batchnorm runs after DDP wrapping at {ctx.at(site)}; measured harmless on {on}: "
            f"{_layers(measured.get('syncbn_layers'))} in the forward, DDP reduces and the optimizer "
            f"updates their parameters{stats} — but it skips DDP's SyncBatchNorm checks and breaks with DDP mixed "
            "precision and older PyTorch / apex"
        )
    measured["calls"] = [{"site": ctx.at(e.get("site")), "arg_class": e.get("arg_class"), "arg_is_ddp": e.get("arg_is_ddp"),
                          "converted": e.get("converted")} for _, e in converts][:4]
    return [
        ctx.finding(
            CODE,
            message=message,
            fix_variant="probe",
            severity=severity,
            site=site,
            ranks=sorted(ctx.ranks),
            evidence=measured,
            magnitude=float(len(problems)),
        )
    ]


