"""Models of file paths and of `sys.path`: enough of os.path and pathlib to compute the literal directories a
script puts on `sys.path` (`sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))`,
`sys.path.append(str(Path(__file__).resolve().parents[1]))`), which then become import roots of the project.

A path is a `path` object whose value is its text; an os.path function over known strings gives a known string.
"""

from __future__ import annotations

import ast
import os
import posixpath
from typing import Any

from ddpdoctor.static.apis.registry import Call, method
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.expressions import NOT_COMPUTED, known_value
from ddpdoctor.static.engine.support import Args
from ddpdoctor.static.semantic import Obj, Value


def text_of(value: Value | None) -> str | None:
    """The text of a Value that is one known string or path."""
    if not value or len(value) != 1:
        return None
    o = value[0]
    if o.kind == "path":
        return o.value
    v = known_value(value)
    return v if isinstance(v, str) and v is not NOT_COMPUTED else None


def path(state: TorchState, node: ast.AST | None, text: str) -> Obj:
    return state.new("path", node, const=True, value=text, label="Path")


def _string(state: TorchState, c: Call, fn: Any) -> Value | None:
    texts = [text_of(v) for v in c.args.pos]
    if not texts or any(t is None for t in texts) or c.args.kw or c.args.opaque:
        return None
    try:
        result = fn(*texts)
    except (TypeError, ValueError):
        return None
    return (state.const(result, c.node),)


def _os_path(fn: Any):
    def handler(state: TorchState, c: Call) -> Value | None:
        return _string(state, c, fn)

    return handler


def _path_ctor(state: TorchState, c: Call) -> Value | None:
    texts = [text_of(v) for v in c.args.pos]
    if any(t is None for t in texts) or c.args.kw or c.args.opaque:
        return None
    return (path(state, c.node, posixpath.join(*texts) if texts else "."),)


def _resolved(text: str) -> str:
    return posixpath.normpath(text) if posixpath.isabs(text) else text


CALLS = {
    **{f"os.path.{name}": _os_path(getattr(os.path, name)) for name in ("dirname", "basename", "join", "normpath")},
    "os.path.abspath": _os_path(_resolved),
    "os.path.realpath": _os_path(_resolved),
    "os.fspath": _os_path(str),
    "pathlib.Path": _path_ctor,
    "pathlib.PurePath": _path_ctor,
    "pathlib.PosixPath": _path_ctor,
}


def _sys_path_add(state: TorchState, c: Call) -> Value:
    value = c.args.pos[-1] if c.args.pos else None
    text = text_of(value)
    added = False
    if text is not None and state.project is not None:
        added = state.project.add_root(text)
    state.emit("sys_path", c.node, dir=text, added=added)
    return (state.const(None, c.node),)


CALLS.update({"sys.path.append": _sys_path_add, "sys.path.insert": _sys_path_add})


# ---------------------------------------------------------------------- path objects


def special_attr(state: TorchState, obj: Obj, name: str, node: ast.AST | None) -> Value | None:
    text = obj.value
    if name == "parent":
        return (path(state, node, posixpath.dirname(text) or "."),)
    if name == "parents":
        parents: list[Value] = []
        current = text
        while posixpath.dirname(current) not in ("", current):
            current = posixpath.dirname(current)
            parents.append((path(state, node, current),))
        return (state.new("tuple", node, items=tuple(parents)),)
    if name in ("name", "stem", "suffix"):
        base = posixpath.basename(text)
        stem, suffix = posixpath.splitext(base)
        return (state.const({"name": base, "stem": stem, "suffix": suffix}[name], node),)
    return None


def _same_path(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    return (path(state, node, _resolved(o.value)),)


def _joinpath(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value | None:
    texts = [text_of(v) for v in args.pos]
    if any(t is None for t in texts):
        return None
    return (path(state, node, posixpath.join(o.value, *texts)),)


METHODS = {
    **{name: method(_same_path, "path") for name in ("resolve", "absolute", "expanduser")},
    "joinpath": method(_joinpath, "path"),
}


def divide(state: TorchState, node: ast.AST, left: Value, right: Value) -> Obj | None:
    """`Path(...) / "sub"`."""
    if len(left) == 1 and left[0].kind == "path":
        text = text_of(right)
        if text is not None:
            return path(state, node, posixpath.join(left[0].value, text))
    return None


def as_string(state: TorchState, name: str, node: ast.Call, args: Args) -> Value | None:
    """`str(path)`."""
    if name == "str" and len(args.pos) == 1 and len(args.pos[0]) == 1 and args.pos[0][0].kind == "path":
        return (state.const(args.pos[0][0].value, node),)
    return None


BUILTINS = {"str": as_string}
