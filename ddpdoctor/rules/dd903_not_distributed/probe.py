"""DD903 not-distributed: the script ran to its end (or the probe's limit) without ever initialising a process
group, or initialised one but never built DDP and trained on at most one rank (several ranks training in a
process group with nothing averaging their gradients is DD110).

Silent where gradients were averaged another way — apex's DistributedDataParallel (a `ddp_init` with its
`wrapper`), Horovod's DistributedOptimizer (`grad_averaging`), FSDP, a hand-written all-reduce of the gradients —
and for a single-process DataParallel run, where DD106 measures what DataParallel did and gives the port to DDP."""

from __future__ import annotations

from ddpdoctor.analyses.context import RunContext
from ddpdoctor.analyses.outcome import failures
from ddpdoctor.findings import Finding
from ddpdoctor.records import LaunchMode
from ddpdoctor.rules.dd110_model_not_wrapped.probe import averaging_mechanisms
from ddpdoctor.rules.dd903_not_distributed import CODE


def analyze(ctx: RunContext) -> list[Finding]:
    procs = [p for p in ctx.run.processes if p.role in ("rank", "attached", "spawned", "main", "forked")]
    if ctx.timed_out or failures(ctx) or not procs or any(p.done is None for p in procs if p.role != "forked"):
        return []
    if ctx.mode is LaunchMode.SINGLE and any(True for _ in ctx.run.events("data_parallel_init")):
        return []  # DD106 speaks for a DataParallel script
    if any(True for _ in ctx.run.events("grad_averaging")):
        return []  # Horovod's DistributedOptimizer averages the gradients
    inits = list(ctx.run.events("pg_init"))
    ddps = [e for _, e in ctx.run.events("ddp_init") if e.get("ok")]
    steps = {p.pid: len(p.of("optimizer_step")) for p in procs}
    trained = sum(1 for n in steps.values() if n)
    if not any(e.get("ok") for _, e in inits):
        message = (
            "the script never initialised a process group: "
            + (f"{trained} process{'es' if trained != 1 else ''} trained independently"
               if trained else "no process trained")
            + f" ({max(steps.values(), default=0)} optimizer steps each) and nothing was synchronised"
        )
        variant = "no_process_group"
    elif averaging_mechanisms(ctx):
        return []  # FSDP, a gradient-averaging optimizer or hand-rolled all-reduces keep the replicas together
    elif trained > 1:
        return []  # ranks trained inside a process group with nothing averaging their gradients: DD110
    elif not ddps:
        message = (
            "the script initialised a process group but never built DistributedDataParallel: gradients were not "
            "averaged by DDP"
            + (f" during {max(steps.values(), default=0)} optimizer steps" if trained else "")
        )
        variant = "no_ddp"
    else:
        return []
    return [
        ctx.finding(
            CODE,
            message=message,
            fix_variant=variant,
            evidence={"processes": len(procs), "optimizer_steps": list(steps.values()), "process_group": bool(inits),
                      "ddp": len(ddps)},
        )
    ]
