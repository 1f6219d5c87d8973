"""DD105 device-not-bound: CUDA DDP where nothing gives each process its own GPU.

What it flags: a DDP wrap in a script that trains on CUDA (nccl backend, `.cuda()`, `"cuda"` devices) when no
statement binds the device to the process: no `torch.cuda.set_device(<per-process value>)`, no
`device_ids=[<per-process value>]`, no move of the model to a per-process device (`.to(local_rank)`,
`.cuda(args.gpu)`, `torch.device("cuda", local_rank)`), no `CUDA_VISIBLE_DEVICES` set per process. A literal
`device_ids=[0]` or `set_device(0)` is flagged even when something else looks per-process — unless each process
sets CUDA_VISIBLE_DEVICES to a value of its own first (then its device 0 is its own GPU). An index-less
`device_ids=[torch.device("cuda")]` names the current device (the one set_device chose), not a fixed GPU.

What stays silent: any per-process binding (values from LOCAL_RANK, the spawn index, `args.gpu`, or anything the
walk cannot prove constant); a constant a call gets on one path when another path reaches the same call with a
per-process value (a worker called with rank=0 for one GPU and spawned otherwise); CPU/gloo scripts.

Confidence: certain for a literal device 0 handed to every process; likely when CUDA is used and nothing binds;
possible when CUDA use is only inferred from strings.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd105_device_not_bound import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import Event, Obj, Value, constant_values, is_constant


def _cuda_text(value: Value) -> bool:
    for o in value:
        text = o.value if o.kind in ("const", "device") else o.props.get("text")
        if isinstance(text, str) and text.startswith("cuda"):
            return True
    return False


def _current_device(o: Obj) -> bool:
    """"cuda" or `torch.device("cuda")` with no index: the process's current CUDA device."""
    return o.kind in ("const", "device") and o.const and o.value == "cuda"


def _flatten(value: Value) -> list[Obj]:
    """The items of a list/tuple literal (`device_ids=[local_rank]`), or the objects themselves."""
    out: list[Obj] = []
    for o in value:
        if o.kind == "tuple":
            for v in o.items if o.items is not None else (o.props.get("elem", ()),):
                out.extend(v)
        else:
            out.append(o)
    return out


def check(script: ScriptModel) -> Iterator[Finding]:
    wraps = script.ddp_wraps
    if not wraps:
        return
    backends = [v for ev in script.of("init_pg") for v in constant_values(ev.data["params"].get("backend") or ())]
    moves = script.of("move")
    cuda_evidence: list[str] = []
    if "nccl" in backends:
        cuda_evidence.append("nccl backend")
    if any(m.data["method"] == "cuda" for m in moves):
        cuda_evidence.append(".cuda()")
    if any(_cuda_text(v) for m in moves for v in m.data["args"].pos + list(m.data["args"].kw.values())):
        cuda_evidence.append("a cuda device")
    if not cuda_evidence and backends and all(b == "gloo" for b in backends):
        return
    inferred_only = False
    if not cuda_evidence:
        if not any(s == "cuda" or s.startswith("cuda:") for s in script.string_constants):
            return
        cuda_evidence.append("'cuda' strings")
        inferred_only = True

    literal_zero: list[tuple[Event, str]] = []
    bound: list[int] = []
    per_process: set[int] = set()  # call sites some path reaches with a per-process device
    for ev in script.of("set_device"):
        arg = ev.data["arg"]
        if arg and is_constant(arg):
            literal_zero.append((ev, f"torch.cuda.set_device({script.text(ev.data['arg_node'])})"))
        else:
            bound.append(ev.line)
            per_process.add(id(ev.node))
    for ev in wraps:
        ids = ev.data["args"].get(1, "device_ids")
        if not ids:
            continue
        # `device_ids=[torch.device("cuda")]` names the current device, whatever set_device made it: neither a
        # fixed GPU nor a binding of its own
        items = [o for o in _flatten(ids) if not (o.kind == "const" and o.value is None) and not _current_device(o)]
        if items and all(o.const for o in items):
            literal_zero.append((ev, f"device_ids={script.text(ev.data['args'].node(1, 'device_ids'))}"))
        elif items:
            bound.append(ev.line)
            per_process.add(id(ev.node))
    # a constant that the same call gets on another path comes from a single-process caller (a worker called with
    # rank=0 for one GPU and spawned otherwise): the source does not name one GPU for every process
    literal_zero = [(ev, what) for ev, what in literal_zero if id(ev.node) not in per_process]
    for ev in moves:
        if not any(o.family is not None for o in ev.data["target"]):
            continue
        values = ev.data["args"].pos + [v for k, v in ev.data["args"].kw.items() if k == "device"]
        for v in values:
            if v and not is_constant(v):
                bound.append(ev.line)
    for ev in script.of("init_pg"):
        dev = ev.data["params"].get("device_id")
        if dev and not is_constant(dev):
            bound.append(ev.line)
    visible = [ev for ev in script.of("env_write") if ev.data.get("var") == "CUDA_VISIBLE_DEVICES"]
    if visible:
        bound.append(0)
    if any(ev.data.get("value") and not is_constant(ev.data["value"]) for ev in visible):
        # each process sets CUDA_VISIBLE_DEVICES to its own GPU (a worker's rank, say): its cuda:0 — a literal
        # device 0 included — is that GPU, so no literal names one device for every process
        literal_zero = []

    wrap = wraps[0]
    if literal_zero:
        site, what = literal_zero[0]
        yield script.finding(
            CODE,
            line=site,
            message=f"{what} at line {site.line} names the same GPU in every process, so all ranks of a node share "
            "one device",
            confidence=cap_unreached(Confidence.CERTAIN if not bound else Confidence.LIKELY, wrap),
            evidence={"literal_device": what, "line": site.line, "cuda": cuda_evidence},
        )
        return
    if bound:
        return
    confidence = Confidence.POSSIBLE if inferred_only else Confidence.LIKELY
    yield script.finding(
        CODE,
        line=wrap,
        message=f"DDP at line {wrap.line} runs on CUDA ({', '.join(cuda_evidence)}) but nothing binds each process "
        f"to its own GPU (no torch.cuda.set_device(local_rank), no device_ids=[local_rank]), so every rank uses cuda:0",
        confidence=cap_unreached(confidence, wrap),
        evidence={"wrap_line": wrap.line, "cuda": cuda_evidence},
    )
