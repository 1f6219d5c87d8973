"""What values mean about ranks: which tests hold on a subset of processes, which node-local, and what names say.

A branch whose test reads a rank (`if rank == 0`, `if dist.get_rank() != 0: return`, `if is_main_process():`)
runs on a subset of ranks: its context is `rank` with a polarity ("main" | "nonmain" | "other") and a scope
("global" | "local" | "local_by_name", see `semantic.Ctx`). Values carry tags that say where a number came from
(`rank`, `local_rank`, `world_size`, `device_count`, `env`, `spawn`); `rank_direct` marks a value that *is* a rank
(`rank`, `int(os.environ["RANK"])`) as opposed to one computed from it (`rank * 2`, a device built from it).
"""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor import torchnames as N
from ddpdoctor.plain import LazyPattern
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.expressions import CMP_OPS
from ddpdoctor.static.semantic import PER_RANK_TAGS, WORLD_TAGS, Obj, Value, tags_of, union

# tags that do not survive a function call on the value (a device built from local_rank is not itself a rank)
CALL_DROPS = frozenset({"rank_cond", "rank", "local_rank", "named"})



def flip(polarity: str) -> str:
    return {"main": "nonmain", "nonmain": "main"}.get(polarity, "other")


def depends(value: Value) -> frozenset[str]:
    """Tags a value derived from `value` keeps: world size and grads as they are, a rank as "depends on the rank"."""
    tags = tags_of(value)
    out = tags - CALL_DROPS
    if tags & PER_RANK_TAGS or "rank_dep" in tags:
        out |= {"rank_dep"}
    return frozenset(out)


def is_rank_value(value: Value) -> bool:
    return any(
        (o.tags & PER_RANK_TAGS) and (o.props.get("rank_direct") or o.kind in ("value", "unknown")) and not o.const
        for o in value
    )


def rank_condition(value: Value) -> str | None:
    """ "main" | "nonmain" | "other" when a test is true on a subset of ranks; None when it is uniform."""
    polarities = [o.props.get("polarity", "main") for o in value if "rank_cond" in o.tags]
    if polarities:
        return polarities[0] if all(p == polarities[0] for p in polarities) else "other"
    if any((o.tags & PER_RANK_TAGS) and o.props.get("rank_direct") and not o.const for o in value):
        return "nonmain"  # `if rank:` is true on every rank but 0
    if made_on_main(value):
        return "main"  # `if writer:` where writer is None except on the main rank
    return None


def mark_made_on(state: TorchState, obj: Obj) -> None:
    """An object made inside a test for the main rank exists only there (`saver = Saver()` under
    `if is_primary():`): recorded so a later `if saver is not None:` reads as the same test."""
    for c in reversed(state.ctx):
        if c.kind == "rank":
            if c.info == "main":
                obj.props["made_on"] = c.scope or "global"
            return


def made_on_main(value: Value) -> bool:
    """A variable that holds None (or False) except on the main rank, where it holds an object made only there
    (`saver = None` ... `if is_primary(): saver = Saver()`)."""
    made = [o for o in value if o.props.get("made_on")]
    unset = [o for o in value if o.kind == "const" and not o.value]
    return bool(made) and bool(unset) and len(made) + len(unset) == len(value)


def rank_scope(value: Value) -> str:
    """Which rank a rank condition reads (see `Ctx.scope`): "global" unless every way the test can be computed
    reads a node-local rank."""
    conds = [o for o in value if "rank_cond" in o.tags]
    if conds:
        return combine_scopes([o.props.get("scope") or N.main_predicate_scope(o.label) for o in conds])
    made = [o.props["made_on"] for o in value if o.props.get("made_on")]
    if made and not any(o.tags & PER_RANK_TAGS for o in value):
        return combine_scopes(made)
    return value_scope(value)


def classify_branch(state: TorchState, test: Value, node: ast.expr) -> tuple[str, Any, Any, str | None]:
    polarity = rank_condition(test)
    if polarity is not None:
        return "rank", polarity, flip(polarity), rank_scope(test)
    text = state.text(node)
    return "cond", text, "not " + text, None


def negation(state: TorchState, node: ast.UnaryOp, operand: Value) -> Value | None:
    polarity = rank_condition(operand)
    if polarity is None:
        return None
    props = {"polarity": flip(polarity), "scope": rank_scope(operand)}
    return (state.new("value", node, tags=frozenset({"rank_cond"}), props=props),)


def boolop(state: TorchState, node: ast.BoolOp, values: list[Value]) -> Value | None:
    polarities = [rank_condition(v) for v in values]
    present = [p for p in polarities if p is not None]
    if not present:
        return None
    scopes = [rank_scope(v) for v, p in zip(values, polarities, strict=True) if p is not None]
    props: dict[str, Any] = {}
    if isinstance(node.op, ast.And):
        polarity = "main" if "main" in present else ("nonmain" if "nonmain" in present else "other")
        # `local_rank == 0 and rank == 0` holds on the global main process only
        main_scopes = [s for s, p in zip(scopes, present, strict=True) if p == polarity] or scopes
        scope = "global" if "global" in main_scopes else narrowest_local(main_scopes)
        # `not use_fsdp and not is_main`: the conjuncts that test no rank; where one of them is known false (under
        # `if use_fsdp:`), the test's false side holds on every rank (see ControlMixin.lift_rank_guards)
        plain = tuple(state.text(v) for v, p in zip(node.values, polarities, strict=True) if p is None)
        if plain:
            props["plain"] = plain
    else:
        polarity = present[0] if all(p == present[0] for p in present) else "other"
        # `not distributed or local_rank == 0`: local rank 0 of every node passes
        local = [s for s in scopes if s != "global"]
        scope = narrowest_local(local) if local else "global"
    props.update(polarity=polarity, scope=scope)
    return (state.new("value", node, tags=frozenset({"rank_cond"}), props=props),)


def compare(state: TorchState, node: ast.Compare, operands: list[Value]) -> Value | None:
    ranked = [i for i, v in enumerate(operands) if is_rank_value(v)]
    if not ranked:
        return _made_on_main_test(state, node, operands)
    results: list[str | None] = []
    for i, op in enumerate(node.ops):
        left, right = operands[i], operands[i + 1]
        lr, rr = i in ranked, (i + 1) in ranked
        if not lr and not rr:
            continue
        if lr and rr:
            results.append("other")
            continue
        other = right if lr else left
        consts = [o.value for o in other if o.const]
        if not consts or len(consts) != len(other):
            results.append("other")
            continue
        results.append(_rank_polarity(type(op), consts[0], rank_on_left=lr))
    present = [r for r in results if r is not None]
    if not present:
        return (state.new("value", node),)
    polarity = present[0] if all(p == present[0] for p in present) else "other"
    scope = combine_scopes([value_scope(operands[i]) for i in ranked])
    return (state.new("value", node, tags=frozenset({"rank_cond"}), props={"polarity": polarity, "scope": scope}),)


def _made_on_main_test(state: TorchState, node: ast.Compare, operands: list[Value]) -> Value | None:
    """`saver is not None` (or `is None`) where saver exists only on the main rank: a test of the rank."""
    if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)):
        return None
    left, right = operands
    if made_on_main(left) and _is_none(right):
        made = left
    elif made_on_main(right) and _is_none(left):
        made = right
    else:
        return None
    present = isinstance(node.ops[0], (ast.IsNot, ast.NotEq))
    scope = combine_scopes([o.props["made_on"] for o in made if o.props.get("made_on")])
    props = {"polarity": "main" if present else "nonmain", "scope": scope}
    return (state.new("value", node, tags=frozenset({"rank_cond"}), props=props),)


def _is_none(value: Value) -> bool:
    return len(value) == 1 and value[0].kind == "const" and value[0].value is None


_LOCAL_SCOPES = ("local_by_name", "local")  # weakest evidence first


def narrowest_local(scopes: list[str]) -> str:
    """Of several node-local scopes, the one with the weakest evidence (a name only beats a visible origin)."""
    for s in _LOCAL_SCOPES:
        if s in scopes:
            return s
    return "global"


def combine_scopes(scopes: list[str]) -> str:
    """A test that may read a global rank (any alternative) counts as global: only a test that reads a node-local
    rank on every path is reported as per-node."""
    if not scopes or "global" in scopes:
        return "global"
    return narrowest_local(scopes)


_PER_NODE_WORDS = ("per_node", "local", "device_count", "gpu", "nproc")


def value_scope(value: Value) -> str:
    """Scope of a rank value compared in a test: "global" for a job-wide rank, "local"/"local_by_name" for a
    node-local one: LOCAL_RANK and local_rank variables as they are (not `node_rank * gpus + local_rank`, which is
    global), and `rank % gpus_per_node` (the ImageNet example's `args.rank % ngpus_per_node == 0`)."""
    scopes: list[str] = []
    for o in value:
        if not (o.tags & PER_RANK_TAGS) or o.const:
            continue
        op = o.props.get("op")
        if op == "Mod" and tags_of(o.props.get("left") or ()) & PER_RANK_TAGS:
            right = o.props.get("right") or ()
            per_node = all(
                r.const or "device_count" in r.tags or any(w in (r.label or "").lower() for w in _PER_NODE_WORDS)
                for r in right
            ) and bool(right)
            scopes.append("local" if per_node else "global")
        elif "rank" in o.tags or op is not None:
            scopes.append("global")  # a global rank, or local_rank combined with other numbers
        elif o.tags & {"env", "spawn"} or "named" not in o.tags:
            scopes.append("local")
        else:
            scopes.append("local_by_name")
    return combine_scopes(scopes)


def _rank_polarity(op: type, const: Any, rank_on_left: bool) -> str | None:
    """Which ranks of a distributed run (0, 1, 2…) make `rank <op> const` true: only 0 → "main", all but 0 →
    "nonmain", all or none → None (the test is uniform: `local_rank != -1` is true on every rank of a DDP run)."""
    fn = CMP_OPS.get(op)
    if fn is None:
        return "other"
    try:
        truths = [bool(fn(r, const) if rank_on_left else fn(const, r)) for r in (0, 1, 2)]
    except TypeError:
        return "other"
    if all(truths) or not any(truths):
        return None
    if truths == [True, False, False]:
        return "main"
    if truths == [False, True, True]:
        return "nonmain"
    return "other"


# ---------------------------------------------------------------------- what names say


def tag_binding(name: str, value: Value) -> Value:
    """A literal stored under a world-size name (`world_size = 2`) is a world size: `lr * world_size` scales."""
    if "world_size" not in N.name_tags(name) or not value:
        return value
    out: list[Obj] = []
    for o in value:
        if o.kind == "const" and isinstance(o.value, int) and not (o.tags & WORLD_TAGS):
            o = Obj(
                kind="const",
                line=o.line,
                node=o.node,
                label=name,
                tags=o.tags | {"world_size", "named"},
                const=True,
                value=o.value,
                file=o.file,
            )
        out.append(o)
    return tuple(out)


def name_facts(name: str) -> tuple[frozenset[str], bool]:
    """(tags, rank_direct) of a value known only by its name."""
    tags = N.name_tags(name)
    return tags, bool(tags & PER_RANK_TAGS)


def call_result_facts(func: Obj | None, name: str | None, args_value: Value, props: dict[str, Any]) -> frozenset[str]:
    """Tags of the result of an unmodelled call: its arguments' world size and grads, and what its name says
    (`is_main_process()` is a rank test, `get_local_rank()` a local rank)."""
    tags = depends(args_value)
    base_name = name[4:] if name and name.startswith("get_") else name
    if name and N.is_main_predicate(name):
        tags = frozenset({"rank_cond", "named"})
        props["polarity"] = "main"
        props["scope"] = N.main_predicate_scope(name)
    elif base_name:
        nt = N.name_tags(base_name) - {"rank_cond"}
        if nt & (PER_RANK_TAGS | {"world_size"}) and (name.startswith("get_") or base_name == name):
            tags = tags | nt
            props["rank_direct"] = bool(nt & PER_RANK_TAGS)
    if "grad" in tags:
        props["owner"] = grad_owners(args_value + ((func,) if func is not None else ()))
    return tags


def grad_owners(value: Value, depth: int = 0) -> Value:
    """The modules whose gradients a value was computed from (`torch.cat([p.grad.view(-1) for p in params])`)."""
    out: list[Obj] = []
    for o in value:
        if "grad" not in o.tags:
            continue
        out.extend(o.props.get("owner", ()))
        if o.kind == "tuple" and depth < 3:
            for v in (o.items or ()) + ((o.props["elem"],) if "elem" in o.props else ()):
                out.extend(grad_owners(v, depth + 1))
    return union(out)


_DISTRIBUTED_FLAG = LazyPattern(r"^(is_|use_|enable_|args_)?(distributed|ddp|dist_?mode)$")
_DISTRIBUTED_CALL = LazyPattern(r"^(is_)?dist(ributed)?(_avail(able)?_and)?_?(is_)?initiali[sz]ed$|^is_distributed$")


def asks_distributed(state: TorchState, node: ast.expr) -> bool:
    """An `if` test that asks whether the run is distributed — a flag (`args.distributed`, `self._distributed`,
    `use_ddp`), `dist.is_initialized()` or a helper named like it (`is_dist_avail_and_initialized()`), or a world
    size above one: its `else` side runs in a single process."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        return any(asks_distributed(state, v) for v in node.values)
    if isinstance(node, (ast.Name, ast.Attribute)):
        ident = node.id if isinstance(node, ast.Name) else node.attr
        return bool(_DISTRIBUTED_FLAG.match(ident.lower().lstrip("_")))
    if isinstance(node, ast.Call) and not node.args:
        func = node.func
        ident = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return bool(_DISTRIBUTED_CALL.match(ident.lower().lstrip("_")))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Gt, ast.NotEq)):
        right = node.comparators[0]
        if isinstance(right, ast.Constant) and right.value == 1:
            return "world_size" in state.text(node.left).lower() or "num_gpus" in state.text(node.left).lower()
    return False
