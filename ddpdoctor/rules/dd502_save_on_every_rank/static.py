"""DD502 save-on-every-rank: `torch.save` reached by every process, or by local rank 0 of every node.

What it flags (low): a `torch.save` in a distributed script that no rank condition guards: every rank writes the
same file at the same time (wasted I/O, torn files on shared filesystems).

What it flags (info): a save guarded by a *node-local* rank — `if local_rank == 0`, `self.gpu_id == 0` with
`gpu_id = int(os.environ["LOCAL_RANK"])` (pytorch/examples' ddp-tutorial-series), `args.local_rank in [-1, 0]`,
`args.rank % ngpus_per_node == 0` (the ImageNet example), `accelerator.is_local_main_process`. Correct on one
node; on N nodes, N processes write the same file (on a shared filesystem, at the same time). Lower than an
unguarded save because it only bites multi-node runs; the message says why it fires.

What stays silent: saves inside `if rank == 0`, `if dist.get_rank() == 0`, `if is_main_process()`, after
`if rank != 0: return`, in a `save_on_master()`-style helper that checks the rank, in `@rank_zero_only`
functions, under both a local and a global rank-0 test; per-rank files (a path built from the rank); saves into
an in-memory buffer (`buf = io.BytesIO(); torch.save(sd, buf)`, `with BytesIO() as buf:`) or a private temporary
file (`tempfile.TemporaryFile()`): nothing shared is written there — pytorch/examples' minGPT serialises its
snapshot to memory and uploads it to S3 under a rank guard.

Confidence: certain when the save is unconditional; likely when it sits under conditions that do not depend on
the rank. Per-node saves: likely when the guard reads the local rank from its source (LOCAL_RANK, the spawn
index, `% gpus_per_node`), possible when only a name says it is one (`args.local_rank` with no visible origin).
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.rules.dd502_save_on_every_rank import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import PER_RANK_TAGS, Ctx, Event

# File-like objects that belong to one process: bytes in memory, or a temporary file with a name of its own.
PRIVATE_TARGETS = frozenset(
    {
        "io.BytesIO",
        "tempfile.TemporaryFile",
        "tempfile.NamedTemporaryFile",
        "tempfile.SpooledTemporaryFile",
    }
)


def check(script: ScriptModel) -> Iterator[Finding]:
    if not script.distributed:
        return
    private = _private_target_nodes(script)
    for ev in script.of("save"):
        path = ev.data.get("path") or ()
        if path and all(id(o.node) in private or o.props.get("qual") in PRIVATE_TARGETS for o in path):
            continue
        if any(o.tags & (PER_RANK_TAGS | {"rank_dep"}) for o in path) or "rank" in script.text(ev.data.get("path_node")).lower():
            continue
        if ev.rank_ctx:
            guard = _per_node_guard(ev)
            if guard is not None:
                yield _per_node_finding(script, ev, guard)
            continue
        conditional = any(c.kind in ("cond", "try") for c in ev.ctx)
        confidence = Confidence.LIKELY if conditional else Confidence.CERTAIN
        yield script.finding(
            CODE,
            line=ev,
            message=f"torch.save at line {ev.line} runs on every rank (no rank check guards it), so all processes write "
            f"the same checkpoint at once",
            confidence=cap_unreached(confidence, ev),
            evidence={"save_line": ev.line, "path": script.text(ev.data.get("path_node")), "unguarded": True},
        )


def _private_target_nodes(script: ScriptModel) -> set[int]:
    """ids of the `as` targets of `with io.BytesIO() as buf:`-style blocks: the interpreter binds a with-target to an
    opaque value, so the buffer is recognised from the call that made it."""
    calls = {id(ev.node) for ev in script.of("call") if ev.data.get("qual") in PRIVATE_TARGETS}
    out: set[int] = set()
    for item in script.with_items:
        if item.optional_vars is not None and id(item.context_expr) in calls:
            out.add(id(item.optional_vars))
    return out


def _per_node_guard(ev: Event) -> Ctx | None:
    """The rank test that admits local rank 0 of every node, when that is the only rank test around the save: a
    global rank test anywhere around it (or a branch for ranks other than 0) leaves one writer or a deliberate
    subset."""
    guards = ev.rank_ctx
    if all(c.info == "main" and c.scope in ("local", "local_by_name") for c in guards):
        return guards[-1]
    return None


def _per_node_finding(script: ScriptModel, ev: Event, guard: Ctx) -> Finding:
    test = getattr(guard.node, "test", None)
    if test is not None:
        how = f"`{script.text(test)}` ({script.place(guard, ev)})"
        if guard.branch == 1:
            how = f"the early exit on {how}"
    else:  # a decorated or otherwise implicit guard
        how = f"the guard at {script.place(guard, ev)}"
    confidence = Confidence.LIKELY if guard.scope == "local" else Confidence.POSSIBLE
    return script.finding(
        CODE,
        line=ev,
        message=f"torch.save at line {ev.line} is guarded by {how}, a node-local rank test: it runs on local rank 0 of "
        f"every node, so on a multi-node run each node writes the same checkpoint (correct on one node only)",
        confidence=cap_unreached(confidence, ev),
        evidence={
            "save_line": ev.line,
            "path": script.text(ev.data.get("path_node")),
            "guard_line": getattr(guard.node, "lineno", None),
            "guard": script.text(test) if test is not None else None,
            "writers": "local rank 0 of every node",
        },
        severity=Severity.INFO,
    )
