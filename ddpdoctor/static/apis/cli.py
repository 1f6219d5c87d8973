"""Models of argparse: the options a script declares (`parser.add_argument`) and the namespace it parses.

`args.local_rank` is an attribute of the parsed namespace: it carries what its option's default carries (a default
read from LOCAL_RANK is the local rank) and a reference to its `CliArg`. When the interpreter is told which values
the command line gives (`TorchState(assume={"options": ...})`, the launch plan), an option read gives that
value as a constant.
"""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor.plain import ValueRecord
from ddpdoctor.static.apis.registry import Call, method
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.support import Args
from ddpdoctor.static.semantic import PER_RANK_TAGS, Obj, Value, tags_of


class CliArg(ValueRecord):
    """One `parser.add_argument(...)` of the script."""

    __match_args__ = ("flags", "dest", "default", "line", "node", "args", "file")

    def __init__(
        self, flags: tuple[str, ...], dest: str, default: Value | None, line: int, node: ast.AST,
        args: Args | None = None, file: str = "",
    ) -> None:
        self.flags = flags
        self.dest = dest
        self.default = default
        self.line = line
        self.node = node
        self.args = args
        self.file = file


class Unknown:
    """An option value the command line does not settle (a custom `type=`, a computed default)."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = Unknown()


def _parser(state: TorchState, c: Call) -> Value:
    return (state.new("parser", c.node),)


CALLS = {"argparse.ArgumentParser": _parser}


def _add_argument(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value | None:
    if not args.pos:
        return None
    flags = tuple(x.value for v in args.pos for x in v if x.kind == "const" and isinstance(x.value, str))
    if flags:
        dest_v = args.get(None, "dest")
        dest = None
        if dest_v:
            dv = [x.value for x in dest_v if x.kind == "const"]
            dest = dv[0] if dv else None
        if dest is None:
            longs = [f for f in flags if f.startswith("--")]
            dest = (longs[0] if longs else flags[0]).lstrip("-").replace("-", "_")
        arg = CliArg(
            flags=flags,
            dest=dest,
            default=args.get(None, "default"),
            line=node.lineno,
            node=node,
            args=args,
            file=state.frame.file,
        )
        state.cli_args[dest] = arg
        state.emit("add_argument", node, arg=arg)
    return (state.unknown(node),)


def _group(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    return (state.new("parser", node),)


def _parse_args(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    return (state.new("cli_args", node, label="args"),)


def _parse_known_args(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    return (state.new("tuple", node, items=((state.new("cli_args", node, label="args"),), (state.unknown(node),))),)


def _set_defaults(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    state.emit("set_defaults", node, args=args)
    return (state.const(None, node),)


LATE_METHODS = {
    "add_argument": method(_add_argument),
    **{
        name: method(_group)
        for name in ("add_argument_group", "add_mutually_exclusive_group", "add_subparsers", "add_parser")
    },
    "parse_args": method(_parse_args),
    "parse_known_args": method(_parse_known_args),
    "set_defaults": method(_set_defaults),
}


def attribute_facts(
    state: TorchState, base: Obj, ident: str | None, tags: frozenset[str], props: dict[str, Any]
) -> frozenset[str]:
    """`args.<option>`: what the option's default carries, and the option itself."""
    if base.kind == "cli_args" and ident in state.cli_args:
        default = state.cli_args[ident].default
        props["cli_arg"] = state.cli_args[ident]
        if default is not None:
            tags = tags | (tags_of(default) - {"rank_cond"})
            props["rank_direct"] = props["rank_direct"] or any(o.props.get("rank_direct") for o in default)
    return tags


def given_option(state: TorchState, base: Obj, name: str, node: ast.AST | None) -> Value | None:
    """`args.<option>` as the command line sets it, when the interpreter was told (the launch plan)."""
    options = state.assume.get("options")
    if options is None or base.kind != "cli_args" or name in base.fields or name not in options:
        return None
    value = options[name]
    if value is UNKNOWN:
        return None
    obj = state.const(value, node)
    obj.props["cli_option"] = name
    if name in state.cli_args:
        obj.props["cli_arg"] = state.cli_args[name]
    base.fields[name] = (obj,)
    return (obj,)


__all__ = ["PER_RANK_TAGS", "UNKNOWN", "CliArg"]
