"""DD206 collective-on-subset: a hang whose stuck rank sits in a rank-conditional branch that reaches a collective.

What it does: when the probe timed out on a stall (DD901; not a slow run that ran out of time), reads each stuck
rank's main-thread stack (faulthandler dump) and walks its user frames from the innermost outwards. For each, it
parses that file's source (ast only; the copy kept in the run directory, see RunContext.source_text) and asks
whether the line lies inside the body or `else` of an `if` whose test depends on the rank (`rank == 0`,
`dist.get_rank() != 0`, `args.local_rank == 0`, `is_main_process()`, `os.environ["RANK"] == "0"`, ...; tests
that are the same on every rank, such as `local_rank != -1`, do not count). The finding needs both halves: such a
branch around a user frame, and, deeper in the same stack, a call that waits for the other ranks — a
torch.distributed collective, a forward through the DDP wrapper (its buffer broadcast), a SyncBatchNorm training
forward (its all_gather) or a backward (DDP's gradient all-reduce) — and at least one rank that is not inside
that branch (finished, still making progress, or stuck elsewhere). The reported line is the user frame inside
the branch, with the branch's condition and what blocked in evidence.

Measured at each collective static analysis suspected of running on a subset: every rank of a run that did not
hang called it (the probe records the first calls of each collective per call site), so the branch admitted all
ranks; a collective no rank reached stays, with a note. A forward through the DDP wrapper counts by the collective
it makes: DDP's broadcast of rank 0's buffers at its start is recorded at the user's forward line (issue 20: a
static DD206 on such a forward stayed, high, on every script whose ranks all ran it, because that broadcast is
none of the script's own torch.distributed calls).

When the ranks outside the branch were all ended by the probe's own --epochs/--steps limit, the hang is not the
script's (they would go on to a next step whose first collective may pair with the stuck one): medium, and the
message says so.
"""

from __future__ import annotations

import ast
import os
from functools import lru_cache
from typing import Any

from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.consequence import key as evidence_key
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.analyses.outcome import ended_by_probe_limit, is_user_path, main_stack, timeout_view
from ddpdoctor.findings import Confidence, Finding, Measures, Severity
from ddpdoctor.records import LaunchMode
from ddpdoctor.rules.dd206_collective_on_subset import CODE
from ddpdoctor.torchnames import env_tags, name_tags

MEASURES = Measures(
    scope="site",
    what="which ranks called each collective (first calls per call site), and where ranks stood when a run hung",
)

_RANK_FUNCTIONS = {"get_rank", "get_local_rank", "get_global_rank", "get_node_local_rank", "is_main_process",
                   "is_master", "is_rank_zero", "is_global_zero", "is_local_main_process"}
_UNIFORM = (-1, None)  # `local_rank != -1` / `rank is None`: the same answer on every rank

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the ranks measured outside the branch while the stuck rank waited in its collective",
    measure=evidence_key("other_ranks"))


def _measure_collectives(ctx: RunContext) -> None:
    """Static collective-on-subset lines every rank of a run that ended normally called."""
    sites = ctx.static_sites(CODE)
    if not sites or ctx.timed_out:
        return
    callers: dict[tuple, set[int]] = {}
    ops: dict[tuple, str] = {}
    for p in ctx.ranks.values():
        for e in p.of("collective"):
            key = ctx.where(e.get("site"))
            callers.setdefault(key, set()).add(p.rank)
            ops.setdefault(key, "DDP's buffer broadcast (broadcast_buffers: a collective at the forward)"
                           if e.get("implicit") == "ddp_buffers" else str(e.get("op")))
    ranks = set(ctx.ranks)
    for site in sites:
        key = (site["file"], site["line"])
        if key not in callers:
            if all(p.done is not None for p in ctx.ranks.values()):
                ctx.not_measured(CODE, site=site, reason=f"no rank called a collective at line {site['line']} "
                                 "during the probe")
            continue
        if callers[key] >= ranks and len(ranks) > 1:
            ctx.measured(CODE, site=site, reason=(
                f"every rank ({fmt_ranks(callers[key])}) called {ops[key]} at {site['file']}:{site['line']} and the "
                "run did not hang: the branch around it admitted all ranks"
            ))


def analyze(ctx: RunContext) -> list[Finding]:
    _measure_collectives(ctx)
    if not ctx.timed_out and ctx.mode is not LaunchMode.ATTACH:
        return []
    at_timeout = timeout_view(ctx)
    if at_timeout is not None and not at_timeout.stalled:
        return []  # the run ran out of time while still making progress: nothing hung
    stuck: list[dict[str, Any]] = []
    others: dict[int, str] = {}  # rank -> where it was instead
    cut = ended_by_probe_limit(ctx, [r for r, p in ctx.ranks.items() if p.done is not None])
    for rank, p in ctx.ranks.items():
        if p.done is not None:
            others[rank] = "had been ended by the probe's --epochs/--steps limit" if cut else "had finished"
            continue
        if at_timeout is not None and at_timeout.ranks[rank].state == "running":
            others[rank] = "was still making progress"
            continue
        view = main_stack(ctx, p)
        if view is None:
            continue
        hit = _branch_hit(ctx, view.frames)
        if hit is None:
            others[rank] = f"was blocked at {ctx.at(view.user_frame)}" if view.user_frame else "was blocked elsewhere"
            continue
        hit["rank"] = rank
        stuck.append(hit)
    if not stuck or not others:
        return []  # no rank outside the branch: not a subset
    in_branch = {(h["frame"]["file"], h["frame"]["line"]) for h in stuck}
    first = stuck[0]
    branch = first["branch"]
    where = f"`if {branch['test']}:`" if branch["part"] == "body" else f"the `else:` of `if {branch['test']}:`"
    elsewhere = "; ".join(f"rank {r} {what}" for r, what in sorted(others.items()))
    message = (
        f"{fmt_ranks([h['rank'] for h in stuck])} hung inside {where} (line {branch['line']}) at "
        f"{ctx.at(first['frame'])}, blocked in {first['blocked']['what']}, which waits for every rank, while "
        f"{elsewhere}"
    )
    severity, confidence = None, Confidence.CERTAIN
    if cut and all(what.startswith("had been ended") for what in others.values()):
        # the others did not leave the script: the probe stopped them before their next step, whose first
        # collective (the next training forward's buffer broadcast) may be what this call pairs with
        message += (
            ", not by the script: in the script's own run they go on to their next step, whose first collective "
            "may pair with this one (harmless when it is the same buffer broadcast), so this run does not show "
            "a hang; rerun with --epochs/--steps that stop the run outside that branch to see past it"
        )
        severity, confidence = Severity.MEDIUM, Confidence.POSSIBLE
    evidence = {
        "stuck": [
            {
                "rank": h["rank"],
                "file": ctx.path(h["frame"]["file"]),
                "line": h["frame"]["line"],
                "branch_line": h["branch"]["line"],
                "branch_test": h["branch"]["test"],
                "branch": h["branch"]["part"],
                "blocked_in": h["blocked"],
                "user_stack": [f"{ctx.path(f['file'])}:{f['line']} in {f['function']}" for f in h["user_frames"]],
            }
            for h in stuck
        ],
        "other_ranks": sorted(others),
        "other_ranks_were": {str(r): what for r, what in sorted(others.items())},
        "sites_in_branch": len(in_branch),
    }
    return [
        ctx.finding(CODE, message=message, site=first["frame"], severity=severity, confidence=confidence,
                    ranks=[h["rank"] for h in stuck], evidence=evidence, magnitude=float(len(stuck)))
    ]


def _branch_hit(ctx: RunContext, frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost user frame inside a rank-conditional branch with a blocking call deeper in the stack."""
    user_frames = [f for f in frames if is_user_path(ctx, f["file"])]
    for i, frame in enumerate(frames):
        if not is_user_path(ctx, frame["file"]):
            continue
        source = ctx.source_text(frame["file"])
        if source is None:
            continue
        branch = _enclosing_rank_branch(source, int(frame["line"]))
        if branch is None:
            continue
        blocked = _blocking_call(frames[:i])
        if blocked is None:
            return None
        return {"frame": frame, "branch": branch, "blocked": blocked, "user_frames": user_frames}
    return None


_DDP = "torch/nn/parallel/distributed.py"
_C10D = "torch/distributed/distributed_c10d.py"


def _path(frame: dict[str, Any]) -> str:
    return str(frame["file"]).replace(os.sep, "/")


def _blocking_call(inner: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the frames below the user frame (innermost first) were doing that waits for the other ranks; the
    outermost such frame is the call the user made."""
    what = None
    for f in reversed(inner):
        path, fn = _path(f), f["function"]
        if path.endswith(_DDP):
            broadcast = any(_path(g).endswith(_DDP) and g["function"] in ("_sync_buffers", "_sync_module_buffers")
                            for g in inner)
            what = {"kind": "ddp_forward", "function": fn,
                    "what": "a forward through the DDP wrapper" + (" (its buffer broadcast)" if broadcast else "")}
        elif _is_syncbn(path, fn, f, inner):
            what = {"kind": "syncbn_forward", "function": fn, "what": "a SyncBatchNorm training forward (all_gather)"}
        elif path.endswith(_C10D):
            what = {"kind": "collective", "function": fn, "what": f"dist.{fn}"}
        elif (path.endswith("torch/_tensor.py") and fn == "backward") or path.endswith("torch/autograd/__init__.py"):
            what = {"kind": "backward", "function": fn, "what": "backward (DDP's gradient all-reduce)"}
        if what is not None:
            break
    if what is not None and inner:
        innermost = inner[0]
        what["innermost"] = f"{os.path.basename(innermost['file'])}:{innermost['line']} in {innermost['function']}"
    return what


def _is_syncbn(path: str, fn: str, frame: dict[str, Any], inner: list[dict[str, Any]]) -> bool:
    if path.endswith("ddpdoctor/bn/syncbn.py"):
        return True
    if path.endswith("torch/nn/modules/_functions.py") and "SyncBatchNorm" in fn:
        return True
    below = inner[: inner.index(frame)]
    return path.endswith("torch/nn/modules/batchnorm.py") and fn == "forward" and any(
        "all_gather" in g["function"] for g in below
    )


@lru_cache(maxsize=32)
def _rank_branches(text: str) -> tuple[tuple[int, int, int, str, str], ...]:
    """(first line, last line, if line, test text, 'body'|'else') of every rank-conditional branch in a source."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not _rank_dependent(node.test):
            continue
        test = ast.get_source_segment(text, node.test) or ast.unparse(node.test)
        for part, stmts in (("body", node.body), ("else", node.orelse)):
            if stmts:
                out.append((stmts[0].lineno, max(getattr(s, "end_lineno", s.lineno) or s.lineno for s in stmts),
                            node.lineno, " ".join(test.split()), part))
    return tuple(out)


def _enclosing_rank_branch(source: str, line: int) -> dict[str, Any] | None:
    """The innermost rank-conditional branch of `source` (the file's text) around `line`, or None."""
    inside = [b for b in _rank_branches(source) if b[0] <= line <= b[1]]
    if not inside:
        return None
    first, last, if_line, test, part = max(inside, key=lambda b: b[0])  # the innermost branch
    return {"line": if_line, "test": test, "part": part, "span": [first, last]}


def _rank_dependent(test: ast.expr) -> bool:
    """Does the condition depend on which rank evaluates it?"""
    if isinstance(test, ast.Compare) and any(
        isinstance(c, ast.Constant) and (c.value in _UNIFORM if not isinstance(c.value, bool) else False)
        or (isinstance(c, ast.UnaryOp) and isinstance(c.op, ast.USub) and isinstance(c.operand, ast.Constant)
            and c.operand.value == 1)
        for c in test.comparators
    ):
        return False
    for node in ast.walk(test):
        ident = None
        if isinstance(node, ast.Name):
            ident = node.id
        elif isinstance(node, ast.Attribute):
            ident = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if env_tags(node.value) & {"rank", "local_rank"}:
                return True
            continue
        if ident is None:
            continue
        if ident in _RANK_FUNCTIONS or name_tags(ident) & {"rank", "local_rank", "rank_cond"}:
            return True
    return False
