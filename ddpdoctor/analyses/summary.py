"""The run-level parts of the report: environment, one-line notes, and the per-rank table."""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.context import RunContext, fmt_num, fmt_ranks
from ddpdoctor.analyses.files import add_file_notes
from ddpdoctor.analyses.outcome import failures, root_causes, timeout_view
from ddpdoctor.findings import Finding
from ddpdoctor.records import LaunchMode

EMULATION_WORDS = {
    "cuda_device": "cuda devices → cpu",
    "nccl_to_gloo": "nccl→gloo",
    "ddp_device_ids": "DDP device_ids dropped",
    "syncbn_ddp_check": None,
    "sync_batchnorm": "SyncBN exact over gloo",
    "autocast_cuda": "autocast(cuda) → CPU autocast",
    "grad_scaler": "GradScaler on CPU",
    "map_location": "torch.load onto CPU",
    "data_parallel": "DataParallel replicas run one after another",
    "flat_collective": "NCCL's flat all_gather_into_tensor/reduce_scatter_tensor buffers viewed as gloo takes them",
    "integer_histc": "histc of integer tensors counted in float64 (CUDA-only kernel)",
}


STANDIN_WORDS = {"horovod": "Horovod (horovod.torch)", "apex": "NVIDIA apex"}


def _dtype_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def autocast_precision(ctx: RunContext) -> str | None:
    """Which precision the emulated autocast computed in, as the note says it: CUDA autocast runs as CPU autocast,
    float16 as bfloat16 (CPU float16 kernels are 17-85x slower than float32, a ResNet-18 step 57 s instead of
    0.7 s; bfloat16 is as fast as float32 or faster), so what a rule measured under autocast came from bfloat16
    numerics: its 8-bit mantissa is coarser than float16's, but float16's range (65504) is not reproduced."""
    pairs = sorted({(_dtype_name(d.get("dtype")), _dtype_name(d.get("used")))
                    for _, e in ctx.run.events("emulation") if e.get("what") == "autocast_cuda"
                    for d in [e.get("detail") or {}] if d.get("used")})
    if not pairs:
        return None
    parts = [f"{asked} as CPU {used}" if asked != used else f"CPU {used}" for asked, used in pairs]
    text = "autocast(cuda) → " + ", ".join(parts)
    if any(asked == "float16" and used == "bfloat16" for asked, used in pairs):
        text += " (bfloat16 rounding; float16's overflow above 65504 not reproduced)"
    return text


def _standins(ctx: RunContext) -> dict[str, dict[str, Any]]:
    """package → the first `standin` event: which packages ddpdoctor stood in for in this run."""
    out: dict[str, dict[str, Any]] = {}
    for _, e in ctx.run.events("standin"):
        out.setdefault(str(e.get("package")), e)
    return out


def environment(ctx: RunContext) -> dict[str, Any]:
    ready = next((e for _, e in ctx.run.events("torch_ready")), {})
    start = next((p.start for p in ctx.run.processes if p.start), {})
    backend = next((e.get("backend") for _, e in ctx.run.events("pg_init") if e.get("ok")), None)
    nproc = ctx.run.meta.nproc or len(ctx.ranks) or ctx.settings.nproc
    if ctx.run.meta.mode is LaunchMode.SINGLE:
        nproc = 1  # one process drove every (emulated) GPU; the emulation note says how many
    env = {
        "torch": ready.get("torch"),
        "python": start.get("python") or ctx.run.meta.python,
        "nproc": nproc,
        "backend": backend,
        "device": ready.get("device") or ctx.run.meta.get("device"),
        "cuda_emulated": any(e.get("cuda_emulated") for _, e in ctx.run.events("torch_ready")),
    }
    nodes = ctx.nodes
    if len(nodes) > 1:  # a multi-node run (attach mode): how many nodes, and which ranks ran on each
        env["nodes"] = len(nodes)
        env["ranks_per_node"] = {node: ranks for node, ranks in nodes.items()}
    return env


# how a rank stood at the probe's timeout (outcome.RankAtTimeout.state) as the ranks table says it
_AT_TIMEOUT = {"running": "running at timeout", "busy": "busy at timeout", "waiting": "stuck", "silent": "stuck"}


def _rank_status(ctx: RunContext, p, fails, roots) -> str:  # noqa: ANN001
    if p.done is not None:
        return "finished" if p.last("exit") else "finished (no clean exit)"
    if any(f.pid == p.pid for f in roots):
        return "failed (root cause)"
    if any(f.pid == p.pid for f in fails):
        return "failed"
    view = timeout_view(ctx)
    if view is not None:
        state = next((r.state for r in view.ranks.values() if r.pid == p.pid), "waiting")
        return _AT_TIMEOUT.get(state, "stuck")
    return "stopped"


def _epochs(p) -> int:  # noqa: ANN001
    """Training epochs a rank observed: its own count when it finished, else the training loader passes that
    ended (a run stopped by the timeout never recorded `done`)."""
    if p.done is not None and p.done.get("epochs") is not None:
        return int(p.done["epochs"])
    return sum(1 for e in p.of("loader_iter_end") if e.get("training"))


def add_notes_and_tables(ctx: RunContext, findings: list[Finding]) -> None:
    meta = ctx.run.meta
    mode = meta.mode
    fails = failures(ctx)
    roots = root_causes(fails)
    emulated = sorted({e.get("what") for _, e in ctx.run.events("emulation") if e.get("what")})
    if emulated:
        words = [w for w in (EMULATION_WORDS.get(x, x) for x in emulated) if w]
        amp = autocast_precision(ctx)
        if amp:
            words = [amp if w == EMULATION_WORDS["autocast_cuda"] else w for w in words]
        n = meta.get("nproc") or len(ctx.ranks)
        counts = {e.get("device_count") for _, e in ctx.run.events("torch_ready") if e.get("cuda_emulated")}
        nodes = len(ctx.nodes)
        if len(counts) == 1 and isinstance(next(iter(counts)), int):  # as the ranks' torch.cuda saw it
            n = next(iter(counts))
        devices = f"{n} virtual device{'s' if n != 1 else ''}" + (f" on each of {nodes} nodes" if nodes > 1 else "")
        ctx.notes.insert(0, f"CUDA was emulated on CPU: {devices}" + (", " + ", ".join(words) if words else ""))
    dropped = sorted({str(e.get("distributed_debug_dropped")) for _, e in ctx.run.events("torch_ready")
                      if e.get("distributed_debug_dropped")})
    if dropped:
        ctx.notes.insert(0, f"TORCH_DISTRIBUTED_DEBUG={dropped[0]} is set: it makes DDP segfault on CPU torch (a torch "
                            "bug), so the emulated ranks ran without it")
    plan = meta.get("plan") or {}
    if mode is LaunchMode.SPAWN:
        line = plan.get("spawn_line")
        children = [p for p in ctx.run.processes if p.role in ("spawned", "forked") and p.is_rank_process]
        decided = next((e for _, e in ctx.run.events("launch_decision")
                        if LaunchMode.of(e.get("mode")) is LaunchMode.SPAWN), None)
        if plan.get("decided_at_runtime") and decided:
            why = f"{decided.get('reason')} at {ctx.at(decided.get('site'))}"
        else:
            why = plan.get("reason") or f"line {line}"
        ctx.notes.append(
            f"the script starts its own ranks ({why}): the probe started it once and instrumented its "
            f"{len(children)} child process{'es' if len(children) != 1 else ''}"
        )
    if mode is LaunchMode.SINGLE:
        ctx.notes.append(f"{plan.get('reason') or 'the script runs in one process'} (one process, "
                         f"{meta.get('nproc')} GPUs)")
    if plan.get("launcher") == "horovodrun" and any(True for _ in ctx.run.events("launch_env")):
        ctx.notes.append(
            f"the script imports Horovod, so it was launched as `horovodrun -np {meta.get('nproc')}` launches it: one "
            "process per slot, with HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK... and no torchrun variables"
        )
    if plan.get("launcher") == "fabric-run" and any(True for _ in ctx.run.events("launch_env")):
        ctx.notes.append(f"{plan.get('reason')}: the ranks got that environment")
    for package, event in _standins(ctx).items():
        ctx.notes.append(
            f"{STANDIN_WORDS.get(package, package)} is {event.get('reason') or 'not installed'}: ddpdoctor's stand-in "
            "ran the script on torch.distributed (what it does not reproduce: "
            + "; ".join(event.get("differences") or []) + ")"
        )
    uses = {(e.get("site") or {}).get("line"): e.get("site") for _, e in ctx.run.events("hvd_torch_distributed")}
    if uses:
        where = ", ".join(ctx.at(site) for site in list(uses.values())[:3])
        ctx.notes.append(
            f"under horovodrun, {where} would raise \"Default process group has not been initialized\": the code "
            "there uses torch.distributed's default process group (DistributedSampler without num_replicas/rank, "
            "dist.get_rank(), a dist collective), which Horovod never creates; ddpdoctor's stand-in did, so the "
            "probe went on — pass num_replicas=hvd.size(), rank=hvd.rank(), or use hvd's own calls"
        )
    runtime = plan.get("runtime_decision") or {}
    if LaunchMode.of(runtime.get("mode")) is LaunchMode.TORCHRUN:
        ctx.notes.append(
            f"the script may spawn its own ranks ({plan.get('reason') or 'line ' + str(plan.get('spawn_line'))}), "
            f"so the probe started it once: {runtime.get('reason')} (at {ctx.at(runtime.get('site'))}), so it was "
            "relaunched under torchrun"
        )
    elif mode is LaunchMode.TORCHRUN and plan.get("spawn_line") and plan.get("reason"):
        ctx.notes.append(f"launched under torchrun: {plan['reason']}")
    if mode is LaunchMode.TORCHRUN:
        nested = [p for p in ctx.run.processes if p.role in ("spawned", "forked") and p.is_rank_process]
        if nested:
            ctx.notes.append(
                f"the ranks torchrun started spawned {len(nested)} more process{'es' if len(nested) != 1 else ''} "
                "that joined a process group: with these arguments the script starts its own ranks, so under "
                "torchrun every rank started a set of its own; hangs and rank clashes in this report can come "
                "from that double launch"
            )
    moved = {(r.get("given"), r.get("used")) for _, e in ctx.run.events("pg_init_begin") if (r := e.get("rendezvous"))}
    for given, used in sorted(moved, key=str):
        ctx.notes.append(
            f"the script's own rendezvous {given} was moved to {used} for the probe: a fixed address could collide "
            "with another job on this machine, or be out of reach of a one-machine run"
        )
    if meta.get("legacy_local_rank_arg"):
        ctx.notes.append(
            f"the script requires {meta['legacy_local_rank_arg']}: each rank got it, as torch.distributed.launch "
            "passed it (torchrun does not)"
        )
    steps = {r: len(p.of("optimizer_step")) for r, p in ctx.ranks.items()}
    if steps:
        epochs = max(_epochs(p) for p in ctx.ranks.values())
        wall = ctx.launcher.get("wall_seconds")
        lim = f"limit {meta.get('epochs')} epochs × {meta.get('steps')} steps; " if meta.get("epochs") else ""
        on_nodes = f" on {len(ctx.nodes)} nodes" if len(ctx.nodes) > 1 else ""
        ctx.notes.append(
            f"probe: {len(ctx.ranks)} rank{'s' if len(ctx.ranks) != 1 else ''}{on_nodes} ({mode}), {lim}observed "
            f"{epochs} epoch{'s' if epochs != 1 else ''}, {max(steps.values())} optimizer steps per rank"
            + (f", {fmt_num(round(float(wall), 1))} s" if wall else "")
        )
    world = ctx.world_size
    if mode is LaunchMode.ATTACH and ctx.ranks and len(ctx.ranks) < world:
        ctx.notes.append(
            f"the run had {world} ranks but these directories hold the events of {len(ctx.ranks)} "
            f"({fmt_ranks(ctx.ranks)}): with one directory per node, give `ddpdoctor report` all of them (or their "
            "parent directory), so that what differs between nodes is measured"
        )
    add_file_notes(ctx)
    errors = [e for _, e in ctx.run.events("internal_error")]
    if errors:
        where = sorted({str(e.get("where")) for e in errors})
        ctx.notes.append(
            f"the probe's recorder failed {len(errors)} time(s) ({', '.join(where)[:200]}); "
            "measurements there are missing"
        )
    missing_emulation = [e.get("emulation_error") for _, e in ctx.run.events("torch_ready") if e.get("emulation_error")]
    if missing_emulation:
        ctx.notes.append(missing_emulation[0])
    rows = []
    several_nodes = len(ctx.nodes) > 1
    for r, p in ctx.ranks.items():
        last = p.events[-1] if p.events else {}
        rows.append(
            [
                r,
                *([ctx.node_of(p)] if several_nodes else []),
                p.pid,
                _rank_status(ctx, p, fails, roots),
                len(p.of("optimizer_step")),
                _epochs(p),
                sum(int(e.get("train_batches") or 0) for e in p.of("optimizer_step")),
                last.get("kind"),
            ]
        )
    if rows:
        ctx.tables["ranks"] = {
            "title": "Ranks",
            "columns": ["rank", *(["node"] if several_nodes else []), "pid", "status", "steps", "epochs",
                        "train batches", "last event"],
            "rows": rows,
        }
