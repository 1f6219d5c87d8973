"""DD110 model-not-wrapped: a process group and optimizer steps, but no DDP/FSDP and no gradient averaging.

What it flags:
- a script that initialises a process group and steps an optimizer but never wraps a model in DDP (torch's or
  apex's), FSDP or fully_shard, never wraps an optimizer in Horovod's DistributedOptimizer and never reduces
  gradients by hand: each rank trains its own model (`likely`: a wrap may hide behind a helper the walk does not
  follow);
- a script whose DDP wraps of the trained model all sit in a branch on the device (`if device.type == "cuda":`,
  `if use_accel:`) that neither the process group nor the optimizer is inside: on the other path (CPU, `--no-accel`)
  the ranks still share a process group and step unwrapped models (`possible`, and low: a launch configuration
  the user may never run; the probe run on that path makes it critical and certain).

What stays silent: any unconditional wrap; wraps whose condition the process group shares (`if args.distributed:`
around both, or the same test written again around each); hand-written gradient averaging
(`dist.all_reduce(p.grad)`); FSDP, Horovod, DeepSpeed and Accelerate scripts (their engines average gradients);
scripts with no optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.rules.dd110_model_not_wrapped import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import Event, Obj, Value

# Engines that average gradients without torch's DDP class, recognised by name (lower-cased identifiers) or by
# the modules the script imports (HF Accelerate by its module: `torch.accelerator` is not it).
OTHER_ENGINES = (
    "fullyshardeddataparallel", "fully_shard", "distributedoptimizer", "deepspeed", "horovod",
    "zeroredundancyoptimizer",
)
OTHER_MODULES = ("torch.distributed.fsdp", "horovod", "deepspeed", "accelerate", "apex.parallel")
DEVICE_WORDS = ("cuda", "gpu", "accel", "device", "xpu", "mps")


def _grads(value: Value, depth: int = 0) -> bool:
    for o in value:
        if o.kind == "grad" or "grad" in o.tags or ".grad" in str(o.label or ""):
            return True
        if o.kind == "tuple" and depth < 3:
            items = o.items if o.items is not None else (o.props.get("elem", ()),)
            if any(_grads(v, depth + 1) for v in items):
                return True
    return False


def _averages_by_hand(script: ScriptModel) -> bool:
    for ev in script.of("collective"):
        args = ev.data["args"]
        if _grads(args.get(0, "tensor") or args.get(0, "tensors") or ()):
            return True
    return False


def _device_branch(script: ScriptModel, wraps: list[Event], around: list[Event]) -> str | None:
    """The device condition every wrap of the trained model sits under and none of `around` (the process group,
    the optimizer) does; None when some wrap is on every path they are on."""
    shared = {id(c.node) for ev in around for c in ev.ctx if c.kind == "cond"}
    # a branch with a wrap on each side (`if args.gpu is not None: DDP(..., device_ids=[gpu]) else: DDP(...)`)
    # restricts nothing
    sides: dict[int, set[int]] = {}
    for w in wraps:
        for c in w.ctx:
            if c.kind == "cond":
                sides.setdefault(id(c.node), set()).add(c.branch)
    shared |= {node for node, branches in sides.items() if len(branches) > 1}
    # the same test written again where the process group is formed (`if num_gpus > 1: init_process_group(...)`,
    # later `if num_gpus > 1: model = DDP(model)`) selects the same runs
    init_tests = {(str(c.info), c.branch) for c in around[0].ctx if c.kind == "cond"} if around else set()
    found: str | None = None
    for w in wraps:
        conds = [
            c for c in w.ctx
            if c.kind == "cond" and id(c.node) not in shared and (str(c.info), c.branch) not in init_tests
        ]
        device = [c for c in conds if any(word in str(c.info).lower() for word in DEVICE_WORDS)]
        if not device:
            return None
        found = found or str(device[0].info)
    while found is not None and found.startswith("not not "):
        found = found[len("not not "):]
    return found


def check(script: ScriptModel) -> Iterator[Finding]:
    inits = [ev for ev in script.of("init_pg") if ev.reached]
    steps = [ev for ev in script.of("opt_step") if ev.reached]
    if not inits or not steps:
        return
    if any(word in script.words for word in OTHER_ENGINES) or _averages_by_hand(script):
        return
    if any(m == mod or m.startswith(mod + ".") for m in script.imported for mod in OTHER_MODULES):
        return
    optimizers = script.of("optimizer")
    opt_ev = optimizers[0] if optimizers else steps[0]
    wraps = script.ddp_wraps
    if not wraps:
        if script.of("wrap"):
            return  # DataParallel inside a process group: DD106's case
        yield script.finding(
            CODE,
            line=opt_ev,
            message=f"the script initialises a process group ({script.place(inits[0], opt_ev)}) and steps an "
            f"optimizer ({script.place(steps[0], opt_ev)}), but never wraps the model in DistributedDataParallel or "
            "FSDP and never averages gradients: each rank trains its own model",
            confidence=cap_unreached(Confidence.LIKELY, opt_ev),
            evidence={"init_line": inits[0].line, "optimizer_line": opt_ev.line, "step_line": steps[0].line,
                      "wraps": 0},
        )
        return
    trained: list[Obj] = []
    for ev in optimizers:
        trained.extend(script.param_owners(ev.data["obj"].props.get("params") or ()))
    families = {id(o.family) for o in trained if o.family is not None}
    mine = [w for w in wraps if w.data["wrapper"].family is not None and id(w.data["wrapper"].family) in families]
    branch = _device_branch(script, mine or wraps, [inits[0], opt_ev])
    if branch is None:
        return
    wrap_lines = sorted({w.line for w in (mine or wraps)})
    places = list(dict.fromkeys(script.place(w, opt_ev) for w in sorted(mine or wraps, key=lambda w: w.line)))
    here = [p.removeprefix("line ") for p in places if p.startswith("line ")]
    wrap_places = ([f"line{'s' if len(here) > 1 else ''} {', '.join(here)}"] if here else []) + [
        p for p in places if not p.startswith("line ")
    ]
    yield script.finding(
        CODE,
        line=opt_ev,
        message=f"DDP wraps the model only when `{branch}` ({', '.join(wrap_places)}), while the process group "
        f"({script.place(inits[0], opt_ev)}) and the optimizer ({script.place(opt_ev, opt_ev)}) are set up on every "
        "path: launched on the other path, each rank trains its own model",
        confidence=cap_unreached(Confidence.POSSIBLE, opt_ev),
        severity=Severity.LOW,
        evidence={"init_line": inits[0].line, "optimizer_line": opt_ev.line, "wrap_lines": wrap_lines,
                  "wrapped_only_when": branch},
    )
