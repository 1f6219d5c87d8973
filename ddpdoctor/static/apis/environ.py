"""Models of os.environ: reads of the launcher's variables (`os.environ["LOCAL_RANK"]`, `os.getenv("RANK")`),
writes, and membership tests (`"RANK" in os.environ`). A value read from a variable carries what the variable
means (`torchnames.env_tags`: local_rank, rank, world_size) and the `env` tag."""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor import torchnames as N
from ddpdoctor.static.apis.registry import Call
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.semantic import PER_RANK_TAGS, Obj, Value, tags_of

ENVIRON = "os.environ"


def is_environ(obj: Obj) -> bool:
    return obj.kind == "qual" and N.canonical(obj.qual or "") == ENVIRON


def env_read(state: TorchState, node: ast.AST, key: Any, default: Value | None, how: str) -> Obj:
    var = key if isinstance(key, str) else None
    tags = N.env_tags(var) if var else frozenset({"env"})
    if default:
        tags = tags | (tags_of(default) - {"rank_cond", "named"})
    state.emit("env_read", node, var=var, how=how)
    return state.new(
        "value",
        node,
        label=f"os.environ[{var!r}]" if var else "os.environ[?]",
        tags=tags,
        props={"env": var, "rank_direct": bool(tags & PER_RANK_TAGS)},
    )


def _read_call(state: TorchState, c: Call) -> Value:
    key = state._const_key(c.node.args[0]) if c.node.args else None
    return (env_read(state, c.node, key, c.args.get(1, "default"), how=c.last),)


CALLS = dict.fromkeys(("os.environ.get", "os.getenv", "os.environ.setdefault", "os.environ.__getitem__"), _read_call)


def load_item(state: TorchState, base: Obj, key: Any, node: ast.Subscript) -> Value | None:
    if is_environ(base):
        return (env_read(state, node, key, None, how="[]"),)
    return None


def store_item(state: TorchState, base: Obj, key: Any, value: Value, target: ast.Subscript) -> bool:
    if is_environ(base):
        state.emit("env_write", target, var=key, value=value)
        return True
    return False


def membership(state: TorchState, node: ast.Compare, operands: list[Value]) -> None:
    """`"RANK" in os.environ`: the script checks whether a launcher set a variable."""
    for i, op in enumerate(node.ops):
        if isinstance(op, (ast.In, ast.NotIn)) and any(is_environ(o) for o in operands[i + 1]):
            key = state._const_key(node.comparators[i - 1] if i else node.left)
            state.emit("env_check", node, var=key if isinstance(key, str) else None)
