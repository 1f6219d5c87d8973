"""DD904 nothing-observed: the run ended without any optimizer step, and no failure or hang explains it.

What it does: counts the optimizer steps of every process of the run. None at all, while the run did not fail
(DD902): the script did not train under the probe. A run the probe's timeout ended is DD901's when it stalled; when
it was only slow (still starting, or still computing its first step) and took no step, it measured nothing that
needs training, and this says so (the DD901 note gives the pace). The reason is the most specific one the
events show, in this order: it loaded a checkpoint the user had before the probe (`checkpoint_load` with
`users_file`: it resumed, and had nothing left to train); a training loader iterated and yielded no batch; it drew
batches but never stepped an optimizer; it never built one; it exited (sys.exit) or returned early. A run where no
process recorded anything at all is reported as such.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.context import RunContext, fmt_num, fmt_ranks
from ddpdoctor.analyses.outcome import failures, timeout_view
from ddpdoctor.findings import Finding, Measures, Severity
from ddpdoctor.records import LaunchEnd
from ddpdoctor.rules.dd904_nothing_observed import CODE

MEASURES = Measures(
    scope="run",
    what="whether the ranks took optimizer steps: a run that trained through an engine static analysis does not "
    "model measured its training, and drops the static \"not analysed\" note",
)

_TRAINING_ROLES = ("rank", "attached", "spawned", "main", "forked")


def analyze(ctx: RunContext) -> list[Finding]:
    if failures(ctx) or ctx.end is LaunchEnd.INTERRUPTED:
        return []  # DD902 says why the run is short; an interrupted run is not reported
    procs = [p for p in ctx.run.processes if p.role in _TRAINING_ROLES]
    steps = sum(_steps_seen(p) for p in procs)
    if ctx.timed_out:
        return _cut_short(ctx, steps)
    if steps:
        ctx.measured(CODE, run_wide=True,
                     reason=f"the probe observed {steps} optimizer step{'s' if steps != 1 else ''} on the ranks")
        return []
    if not procs:
        return [ctx.finding(
            CODE,
            message="no process of the script recorded anything under the probe: nothing was measured",
            fix_variant="no_process",
            evidence={"processes": len(ctx.run.processes), "launcher_returncode": ctx.launcher.get("returncode")},
        )]
    why, variant, site, evidence = _reason(ctx, procs)
    ranks = sorted(r for r in ctx.ranks)
    who = f"{fmt_ranks(ranks)} took" if ranks else "the script took"
    message = f"{who} no optimizer step, so nothing that needs training was measured: {why}"
    return [ctx.finding(
        CODE,
        message=message,
        fix_variant=variant,
        # a script that trains without torch.optim is not broken: say what was not measured, without failing CI
        **({"severity": Severity.LOW} if variant == "manual_update" else {}),
        site=site,
        ranks=ranks,
        evidence={"optimizer_steps": 0, "processes": len(procs), **evidence},
    )]


def _cut_short(ctx: RunContext, steps: int) -> list[Finding]:
    """The probe's timeout ended the run. A stall is DD901's; a slow run that still took a step measured something
    (the note says how much). A slow run that took none measured nothing that needs training: said as a finding, so
    that the report never reads "No findings" (and CI never passes) on a run that checked nothing."""
    view = timeout_view(ctx)
    if steps or view is None or (view.ranks and not view.out_of_time):
        return []
    ranks = sorted(ctx.ranks)
    if not view.ranks:
        where = "before any rank had started the script (interpreter start-up and imports)"
    else:
        where = f"while {fmt_ranks(ranks) if ranks else 'the ranks'} still worked towards the first step"
    return [ctx.finding(
        CODE,
        message=(
            f"the probe's {fmt_num(view.timeout)} s timeout ended the run {where}: no optimizer step was observed, "
            "so nothing that needs training was measured — a slow run, not a hang"
        ),
        fix_variant="timeout",
        ranks=ranks,
        evidence={"optimizer_steps": 0, "timeout_s": view.timeout, "ranks_started": sorted(view.ranks)},
    )]


def _steps_seen(p: Any) -> int:
    """Optimizer steps a process recorded, by any record of them: its step events, the steps counted during its
    loader iterations, the count it gave when it finished."""
    done = p.done or {}
    return max(
        len(p.of("optimizer_step")),
        sum(int(e.get("steps") or 0) for e in p.of("loader_iter_end")),
        int(done.get("steps") or 0),
    )


def _reason(ctx: RunContext, procs: list[Any]) -> tuple[str, str | None, dict[str, Any] | None, dict[str, Any]]:
    """(why, fix variant, user site, evidence) — the most specific reason the run shows."""
    # a file the user had, holding training counters: a resume (a bare state dict is as likely pretrained weights)
    resumed = [e for _, e in ctx.run.events("checkpoint_load") if e.get("users_file") and e.get("counters")]
    iterations = [e for _, e in ctx.run.events("loader_iter_end")]
    batches = sum(int(e.get("batches") or 0) for e in iterations)
    optimizers = [e for _, e in ctx.run.events("optimizer_init")]
    ends = [p.done for p in procs if p.done is not None]
    exits = [d for d in ends if d.get("reason") == "sys.exit(0)"]
    evidence: dict[str, Any] = {
        "optimizers": len(optimizers),
        "loader_iterations": len(iterations),
        "batches": batches,
        "ended": sorted({str(d.get("reason")) for d in ends}),
    }
    if resumed:
        e = resumed[0]
        counters = e.get("counters") or {}
        state = ", ".join(f"{k}={v}" for k, v in list(counters.items())[:4])
        evidence["resumed_from"] = [
            {"path": ctx.path(r.get("abspath")), "counters": r.get("counters")} for r in resumed
        ]
        why = (
            f"it loaded {ctx.path(e.get('abspath')) or e.get('path')}{f' ({state})' if state else ''}, a checkpoint "
            "that was there before the probe, and then trained no step: it resumed where an earlier run ended, "
            "with nothing left to train"
        )
        return why, "resumed", e.get("site"), evidence
    empty = [e for e in iterations if not e.get("batches")]
    if iterations and batches == 0:
        created = {e.get("loader"): e for _, e in ctx.run.events("loader_created")}
        first = created.get(empty[0].get("loader")) or {}
        size = first.get("dataset_len")
        shape = []
        if size is not None:
            shape.append(f"a dataset of {size} sample{'s' if size != 1 else ''}")
        if first.get("batch_size") is not None:
            shape.append(f"batch size {first['batch_size']}" + (", drop_last" if first.get("drop_last") else ""))
        evidence["empty_loader"] = {"dataset_len": size, "batch_size": first.get("batch_size"),
                                    "drop_last": first.get("drop_last"), "site": first.get("site")}
        described = f" ({', '.join(shape)})" if shape else ""
        return (
            f"its data loader yielded no batch{described}",
            "empty_loader", first.get("site"), evidence,
        )
    if batches and optimizers:
        why = (
            f"it drew {batches} batch{'es' if batches != 1 else ''} but never called optimizer.step() "
            "(an evaluation-only run, or a loop that returns before stepping)"
        )
        return why, None, optimizers[0].get("site"), evidence
    backwards = sum(int((p.done or {}).get("backwards") or 0) for p in procs)
    evidence["backward_passes"] = backwards
    if not optimizers and backwards:
        return (
            f"it ran {backwards} backward pass{'es' if backwards != 1 else ''} but never built a torch.optim "
            "optimizer: it updates the parameters by hand (p.data -= lr * p.grad), which the probe does not observe "
            "as training steps",
            "manual_update", None, evidence,
        )
    if not optimizers:
        return (
            "it never built an optimizer (an evaluation or export mode of the script, or arguments that skip "
            "training)" + (f"; it drew {batches} batch{'es' if batches != 1 else ''}" if batches else ""),
            "no_optimizer", None, evidence,
        )
    if exits:
        site = exits[0].get("site")
        where = f" at {ctx.at(site)}" if site else ""
        return f"it exited with sys.exit(0){where} before its training loop", None, site, evidence
    return "it returned before its training loop ran (no batch was drawn)", None, None, evidence
