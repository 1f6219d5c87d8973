"""DD104 hardcoded-rank: `init_process_group` with a rank (or world size) that cannot differ per process.

What it flags: `rank=` given as a literal other than -1 (or a name that only ever holds a literal, like
`RANK = 0`); `world_size=1`, which makes every process a group of one; another literal world size, at low
severity, when no `mp.spawn(nprocs=...)` of the same value pins it.

What stays silent: rank from the environment, from the spawn index, from `dist.get_rank()`, from arguments;
`rank=-1`/`world_size=-1` (the "read it from env://" defaults); a literal world size equal to the `nprocs` the
script spawns; `rank=0, world_size=1` inside a branch on the world size or the distributed switch (the
single-process path); a rank variable that holds a constant on one path to the call and each process's own
rank on another (a worker called directly with `rank=0` for one GPU and spawned otherwise).
"""

from __future__ import annotations

import ast
from typing import Iterator

from ddpdoctor.findings import Confidence, Finding, Severity
from ddpdoctor.rules.dd104_hardcoded_rank import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached
from ddpdoctor.static.semantic import constant_values, is_constant

_SINGLE_PROCESS_WORDS = ("world", "size", "distributed", "ddp", "nproc", "gpus", "multi")


def check(script: ScriptModel) -> Iterator[Finding]:
    spawned = [v for ev in script.of("spawn") for v in constant_values(ev.data.get("nprocs") or ())]
    # init calls that some path reaches with a rank of each process's own (the spawn index): a constant the same
    # call gets on another path comes from a single-process caller (StyleGAN2's `subprocess_fn(rank=0, ...)` when
    # one GPU is asked for, `mp.spawn(subprocess_fn, ...)` otherwise)
    per_process = {
        id(ev.node) for ev in script.of("init_pg") if (r := ev.data["params"].get("rank")) and not is_constant(r)
    }
    for ev in script.of("init_pg"):
        params, nodes = ev.data["params"], ev.data["nodes"]
        rank, world = params.get("rank"), params.get("world_size")
        rank_vals = constant_values(rank) if rank and is_constant(rank) else []
        world_vals = constant_values(world) if world and is_constant(world) else []
        bad_rank = [v for v in rank_vals if isinstance(v, int) and v != -1]
        world_literal = [v for v in world_vals if isinstance(v, int) and v != -1]
        single_path = any(
            c.kind == "cond" and any(w in str(c.info).lower() for w in _SINGLE_PROCESS_WORDS) for c in ev.ctx
        )
        evidence = {
            "init_line": ev.line,
            "rank": script.text(nodes.get("rank")) if rank else None,
            "world_size": script.text(nodes.get("world_size")) if world else None,
        }
        if single_path and world_literal == [1]:
            continue  # `else: init_process_group(rank=0, world_size=1)`: the single-process path
        if bad_rank and not _is_literal(nodes.get("rank")) and id(ev.node) in per_process:
            continue
        if bad_rank:
            literal = _is_literal(nodes.get("rank"))
            confidence = Confidence.CERTAIN if literal else Confidence.LIKELY
            text = script.text(nodes.get("rank"))
            how = f"rank={bad_rank[0]}" if literal else f"rank={text} (always {bad_rank[0]})"
            extra = f" and world_size={world_literal[0]}" if world_literal else ""
            yield script.finding(
                CODE,
                line=ev,
                message=f"init_process_group at line {ev.line} is called with {how}{extra}, so every process "
                f"claims the same rank instead of its own",
                confidence=cap_unreached(confidence, ev),
                evidence={**evidence, "literal_rank": bad_rank[0]},
            )
            continue
        if world_literal == [1]:
            yield script.finding(
                CODE,
                line=ev,
                message=f"init_process_group at line {ev.line} is called with world_size=1, so each process forms a "
                f"group of its own and DDP averages nothing across processes",
                confidence=cap_unreached(Confidence.LIKELY, ev),
                evidence={**evidence, "literal_world_size": 1},
            )
        elif world_literal and world_literal[0] not in spawned:
            yield script.finding(
                CODE,
                line=ev,
                message=f"init_process_group at line {ev.line} hard-codes world_size={world_literal[0]}, so the script "
                f"only runs with exactly that many processes whatever the launcher starts",
                confidence=cap_unreached(Confidence.POSSIBLE, ev),
                evidence={**evidence, "literal_world_size": world_literal[0]},
                severity=Severity.LOW,
            )


def _is_literal(node: object) -> bool:
    return isinstance(node, ast.Constant) or (
        isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant)
    )
