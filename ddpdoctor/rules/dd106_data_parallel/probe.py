"""DD106 data-parallel, measured: what nn.DataParallel did to BatchNorm in this run.

What it does: reads every DataParallel (data_parallel_init), how its training forwards split the batch
(data_parallel_forward), and its BatchNorm layers' forwards (bn_step): in a DataParallel step each layer runs once
per replica, in replica order. From the per-chunk moments it rebuilds the whole batch's statistics (count-weighted,
Chan's formula) and measures how far replica 0's chunk — the only one whose statistics reach the running
mean/variance — is from them: the mean in units of the batch's standard deviation (RMS over channels), the
variance as a relative error, averaged over the recorded steps.

Measured at each nn.DataParallel line static analysis flagged: a wrap no process built while the ranks trained (the
non-distributed branch of a script launched distributed) is dropped, naming what the ranks trained instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpdoctor.analyses import bn_common as bc
from ddpdoctor.analyses.context import RunContext, fmt_num, pct
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.levels import Severity
from ddpdoctor.rules.dd106_data_parallel import CODE
from ddpdoctor.rules.dd202_small_bn_batch import SMALL_BN_BATCH

MEASURES = Measures(
    scope="site",
    what="every nn.DataParallel the ranks built: its replicas, chunks and BatchNorm statistics",
)


def _measure_not_built(ctx: RunContext) -> None:
    """Static DataParallel lines that no process executed while the ranks trained."""
    built = [e.get("site") for _, e in ctx.run.events("data_parallel_init")]
    steps = {r: ctx.steps_of(r) for r in ctx.ranks}
    ddp = next((e for _, e in ctx.run.events("ddp_init") if e.get("ok")), None)
    for site in ctx.static_sites(CODE):
        if ctx.ran_at(site, built):
            continue
        if not any(steps.values()):
            ctx.not_measured(CODE, site=site, reason="no optimizer step was observed")
            continue
        instead = (f"through DistributedDataParallel ({ctx.at(ddp.get('site'))})" if ddp
                   else "without it")
        ctx.measured(CODE, site=site, reason=(
            f"the nn.DataParallel at {site['file']}:{site['line']} never ran: the {len(ctx.ranks)} ranks trained "
            f"{max(steps.values())} optimizer steps {instead}, a path this launch took instead"
        ))


def _chunk0_gap(layer: bc.LayerRun, rank: int, replicas: int) -> dict[str, float] | None:
    """Mean over steps of replica 0's chunk statistics against the whole batch's (the step's training forwards of
    this layer, one per replica)."""
    rl = layer.ranks.get(rank)
    if rl is None:
        return None
    by_step: dict[int, list[bc.Forward]] = {}
    for f in rl.train_forwards:
        by_step.setdefault(f.step, []).append(f)
    mean_gaps, var_errs = [], []
    for forwards in by_step.values():
        if len(forwards) != replicas:
            continue
        counts = np.array([f.count for f in forwards], dtype=np.float64)
        means = np.stack([f.mean for f in forwards])
        variances = np.stack([f.var for f in forwards])
        total = counts.sum()
        if total <= 1:
            continue
        mean = (counts[:, None] * means).sum(0) / total
        var = ((counts[:, None] * (variances + (means - mean) ** 2)).sum(0)) / total
        mean_gaps.append(bc.mean_gap(means[0], mean, var))
        var_errs.append(float(np.sqrt(np.mean(((variances[0] - var) / np.maximum(var, 1e-12)) ** 2))))
    if not mean_gaps:
        return None
    return {"mean_std": float(np.mean(mean_gaps)), "var_rel": float(np.mean(var_errs)), "steps": len(mean_gaps)}


def analyze(ctx: RunContext) -> list[Finding]:
    _measure_not_built(ctx)
    inits = [(p, e) for p, e in ctx.run.events("data_parallel_init")]
    if not inits:
        return []
    proc, init = inits[0]
    rank = proc.rank if proc.rank is not None else 0
    forwards = [e for _, e in ctx.run.events("data_parallel_forward") if e.get("dp") == init.get("dp")]
    training = [e for e in forwards if e.get("training") and e.get("grad")] or forwards
    devices = list(init.get("device_ids") or [])
    replicas = max((int(e.get("replicas") or 1) for e in training), default=None)
    chunks = next((list(e.get("chunk_sizes") or []) for e in training if int(e.get("replicas") or 1) == replicas),
                  [])
    bn_layers = int(init.get("bn_layers") or 0)
    site = init.get("site")
    evidence: dict[str, Any] = {
        "device_ids": devices,
        "replicas": replicas,
        "chunk_sizes": chunks,
        "batch": training[0].get("batch") if training else None,
        "bn_layers": bn_layers,
        "forwards_recorded": len(forwards),
    }
    where = f"nn.DataParallel at {ctx.at(site)}"
    if not training:
        message = f"{where} was built but never ran a forward during the probe"
        return [ctx.finding(CODE, message=message, severity=Severity.LOW, site=site, evidence=evidence)]
    if not replicas or replicas < 2:
        why = "it had no GPU" if not devices else "it had one device" if len(devices) == 1 else "its batch was tiny"
        message = (
            f"{where} never split a batch ({why}): the module ran as it is in one process, so DataParallel only "
            "adds overhead here; with more GPUs it would split every batch"
        )
        return [ctx.finding(CODE, message=message, severity=Severity.LOW, site=site, evidence=evidence)]
    split = f"split every batch of {evidence['batch']} into {replicas} replicas of {'/'.join(map(str, chunks))}"
    if bn_layers == 0:
        message = (
            f"{where} {split} in one process; the model has no BatchNorm, so no statistics depend on the split: "
            "only speed is lost (one Python process replicates, scatters and gathers every step)"
        )
        return [ctx.finding(CODE, message=message, severity=Severity.LOW, site=site, evidence=evidence)]
    bn = bc.bn_for(ctx)
    gaps: dict[str, dict[str, float]] = {}
    per_replica: list[int] = []
    if bn is not None:
        for layer in bn.layers:
            rl = layer.ranks.get(rank)
            if rl is None or not rl.train_forwards:
                continue
            per_replica.extend(f.samples for f in rl.train_forwards)
            gap = _chunk0_gap(layer, rank, replicas)
            if gap is not None:
                gaps[layer.name] = gap
    smallest = min(per_replica) if per_replica else min(chunks)
    evidence["bn_samples_per_replica"] = smallest
    evidence["replica0_vs_batch"] = {k: {kk: bc.finite(vv) for kk, vv in v.items()} for k, v in gaps.items()}
    worst = max(gaps.items(), key=lambda kv: kv[1]["mean_std"], default=None)
    measured = ""
    if worst is not None:
        name, g = worst
        measured = (
            f"; replica 0's chunk statistics were {fmt_num(round(g['mean_std'], 3))} std (mean) and "
            f"{pct(g['var_rel'])} (variance) from the whole batch's ({name}, mean over {g['steps']} steps)"
        )
    small = smallest < SMALL_BN_BATCH
    message = (
        f"{where} {split} in one process: each replica's BatchNorm normalised only its own {smallest} samples and "
        f"only replica 0's chunk updated the running statistics{measured}"
    )
    if not small:
        message += f"; with {smallest} samples per replica the per-chunk statistics are usable"
    return [
        ctx.finding(
            CODE,
            message=message,
            severity=Severity.MEDIUM if small else Severity.LOW,
            site=site,
            evidence=evidence,
            magnitude=worst[1]["mean_std"] if worst is not None else 0.0,
            fix_detail=_port(ctx, site, replicas, chunks, evidence.get("batch")),
        )
    ]


def _port(ctx: RunContext, site: dict[str, Any] | None, replicas: int, chunks: list[int], batch: Any) -> str:
    """The DDP port of this script, with its own lines and numbers."""
    loader = next((e for _, e in ctx.run.events("loader_created") if e.get("batch_size") == batch), None)
    per_gpu = chunks[0] if chunks else "batch / N"
    at_loader = f" at {ctx.at(loader.get('site'))}" if loader and loader.get("site") else ""
    return (
        f"Port: run `torchrun --nproc_per_node={replicas} {ctx.script}`; in the script init_process_group('nccl'), "
        "local_rank = int(os.environ['LOCAL_RANK']), torch.cuda.set_device(local_rank), and "
        f"DDP(model.cuda(local_rank), device_ids=[local_rank]) instead of the DataParallel at {ctx.at(site)}; give "
        f"the DataLoader{at_loader} a DistributedSampler and batch_size={per_gpu} per process (the same global "
        f"batch of {batch}), call sampler.set_epoch(epoch) every epoch, save model.module.state_dict() on rank 0."
    )
