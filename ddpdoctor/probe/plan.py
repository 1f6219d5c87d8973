"""How to launch a script, decided from its source and the arguments it is given (a quick AST read; never imports
or runs it).

- A script that starts its own ranks (torch.multiprocessing.spawn / start_processes, multiprocessing.Process) and
  initialises a process group is started ONCE when, with the given arguments, its spawn call runs; its children
  are instrumented through sitecustomize.
- Many scripts do both: `if args.multiprocessing_distributed: mp.spawn(...) else: main_worker(...)` reading
  RANK/WORLD_SIZE from the launcher in the other branch (pytorch/examples imagenet). The spawn call's guarding
  conditions are evaluated against the script's own argparse options as the given arguments set them: spawned
  only with the flag, torchrun without it. Launched under torchrun while it spawns, every rank would start its
  own set of ranks on one rendezvous (2 × N processes and a hang).
- A guard the source cannot settle (a config file, a helper's return value) is decided at run time: the script is
  started once, and its main process asks to be relaunched under torchrun if it reaches init_process_group (or a
  launcher variable) before starting any rank (see ddpdoctor.probe.launch_check). A guard that reads the
  launcher's variables (`if "RANK" in os.environ`) means the script supports torchrun: it gets torchrun.
- A script whose argparse parser declares --local_rank / --local-rank gets `--local_rank=N`, as
  torch.distributed.launch passed it (torchrun does not).
- A script that trains with nn.DataParallel and never initialises a process group (no spawn, no launcher variable
  read) is one process driving every GPU: it is started once (mode "single"), as `python train.py`, and that
  process is rank 0 of a world of one; under CUDA emulation it sees N GPUs. If it turns out to need a launcher
  after all (launch_check), it is relaunched under torchrun.
- A script that imports Horovod is launched the way `horovodrun -np N` launches it: one process per slot whose
  environment has Horovod's contract (HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, ...) and not torchrun's
  (no RANK, WORLD_SIZE, MASTER_ADDR...): `launcher` is "horovodrun" (ddpdoctor.probe.launch_env applies it).
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

SPAWN_CALLS = {
    "torch.multiprocessing.spawn",
    "torch.multiprocessing.start_processes",
    "torch.multiprocessing.spawn.spawn",
    "torch.multiprocessing.spawn.start_processes",
    "torch.multiprocessing.Process",
    "multiprocessing.Process",
    "multiprocessing.context.Process",
}
LAUNCHER_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE"}
DATA_PARALLEL_CALLS = {
    "torch.nn.DataParallel",
    "torch.nn.parallel.DataParallel",
    "torch.nn.parallel.data_parallel.DataParallel",
    "torch.nn.parallel.data_parallel",
    "torch.nn.parallel.data_parallel.data_parallel",
}
LOCAL_RANK_OPTIONS = ("--local_rank", "--local-rank")


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    spawns_own_ranks: bool = False
    spawn_line: int | None = None
    reads_launcher_env: bool = False
    inits_process_group: bool = False
    local_rank_option: str | None = None  # passed to each rank (torchrun mode only)
    local_rank_line: int | None = None
    local_rank_declared: str | None = None  # the spelling the parser declares, whatever the mode
    # why this mode, in the user's words ("" for a plain launcher script)
    reason: str = ""
    # the guard of the spawn call could not be settled from the source: the single launch checks it at run time
    decided_at_runtime: bool = False
    # whose environment contract each process gets: "torchrun" (RANK, WORLD_SIZE, ...) or "horovodrun" (HOROVOD_*)
    launcher: str = "torchrun"
    # one process drives every GPU (nn.DataParallel without a process group): started once, as `python train.py`
    single_process: bool = False

    @property
    def mode(self) -> str:
        if self.spawns_own_ranks:
            return "spawn"
        return "single" if self.single_process else "torchrun"

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "spawn_line": self.spawn_line,
            "reads_launcher_env": self.reads_launcher_env,
            "inits_process_group": self.inits_process_group,
            "local_rank_option": self.local_rank_option,
            "local_rank_line": self.local_rank_line,
            "reason": self.reason,
            "decided_at_runtime": self.decided_at_runtime,
            "launcher": self.launcher,
            "single_process": self.single_process,
        }


class _Scanner(ast.NodeVisitor):
    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self.spawn_calls: list[ast.Call] = []
        self.reads_env = False
        self.init_pg = False
        self.local_rank: tuple[str, int] | None = None
        self.horovod = False
        self.data_parallel_line: int | None = None

    @property
    def spawn_line(self) -> int | None:
        return self.spawn_calls[0].lineno if self.spawn_calls else None

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.horovod |= a.name.split(".")[0] == "horovod"
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                root = a.name.split(".")[0]
                self.aliases.setdefault(root, root)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level:
            self.horovod |= node.module.split(".")[0] == "horovod"
            for a in node.names:
                self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def visit_Assign(self, node: ast.Assign) -> None:
        # ctx = mp.get_context("spawn") → ctx.Process(...) is a multiprocessing Process
        if isinstance(node.value, ast.Call):
            inner = self.name(node.value.func) or ""
            if inner.endswith("get_context") and "multiprocessing" in inner:
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.aliases[target.id] = inner.rsplit(".", 1)[0] + ".context"
        self.generic_visit(node)

    def name(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.name(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):  # mp.get_context("spawn").Process
            inner = self.name(node.func)
            if inner and inner.endswith("get_context"):
                return inner.rsplit(".", 1)[0] + ".context"
        return None

    def visit_Call(self, node: ast.Call) -> None:
        name = self.name(node.func) or ""
        if name in SPAWN_CALLS or (name.endswith(".Process") and "multiprocessing" in name):
            self.spawn_calls.append(node)
        if name.endswith("init_process_group"):
            self.init_pg = True
        if name in DATA_PARALLEL_CALLS and self.data_parallel_line is None:
            self.data_parallel_line = node.lineno
        if name.endswith(("environ.get", "getenv")) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and first.value in LAUNCHER_ENV:
                self.reads_env = True
        if name.endswith("add_argument"):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and arg.value in LOCAL_RANK_OPTIONS and self.local_rank is None:
                    self.local_rank = (arg.value, node.lineno)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load) and (self.name(node.value) or "").endswith("environ"):
            key = node.slice
            if isinstance(key, ast.Constant) and key.value in LAUNCHER_ENV:
                self.reads_env = True
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if (
            isinstance(node.left, ast.Constant)
            and node.left.value in LAUNCHER_ENV
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
        ):
            self.reads_env = True
        self.generic_visit(node)


# --------------------------------------------------------------------------------------------- argparse options


class _Unknown:
    """A value the source does not settle before the run."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()
_NOT_GIVEN = object()


class _ParseError(Exception):
    pass


class _QuietParser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: ANN201 - argparse protocol
        raise _ParseError(message)

    def exit(self, status: int = 0, message: str | None = None):  # noqa: ANN201
        raise _ParseError(message or "")


_ACTIONS = {"store", "store_true", "store_false", "store_const", "append", "append_const", "count", "extend"}
_TYPES = {"int": int, "float": float, "str": str}


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_GIVEN


def script_options(tree: ast.AST, argv: Sequence[str]) -> dict[str, Any]:
    """dest → value of the script's argparse options as `argv` sets them, rebuilt from the literal parts of its
    `add_argument` calls (every parser in the file, merged). Options whose value the source cannot tell (a custom
    `type=` applied to a given value, a computed default) map to UNKNOWN; {} when the arguments do not parse."""
    parser = _QuietParser(add_help=False, allow_abbrev=True, conflict_handler="resolve")
    unknown_when_given: set[str] = set()
    unknown_default: set[str] = set()
    defaults: dict[str, Any] = {}
    declared = False
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr == "set_defaults":
            for kw in node.keywords:
                value = _literal(kw.value) if kw.arg else _NOT_GIVEN
                if kw.arg and value is not _NOT_GIVEN:
                    defaults[kw.arg] = value
            continue
        if node.func.attr != "add_argument":
            continue
        flags = [_literal(a) for a in node.args]
        if not flags or not all(isinstance(f, str) and f for f in flags):
            continue
        kwargs: dict[str, Any] = {}
        custom_type = computed_default = False
        for kw in node.keywords:
            if kw.arg is None:
                continue
            if kw.arg == "action":
                action = _literal(kw.value)
                if isinstance(action, str) and action in _ACTIONS:
                    kwargs["action"] = action
                elif isinstance(kw.value, (ast.Attribute, ast.Name)) and (
                    getattr(kw.value, "attr", None) or getattr(kw.value, "id", None)
                ) == "BooleanOptionalAction":
                    kwargs["action"] = argparse.BooleanOptionalAction
                else:
                    kwargs = {}
                    break  # help / version / a custom action: not an option we can evaluate
            elif kw.arg == "type":
                name = kw.value.id if isinstance(kw.value, ast.Name) else None
                if name in _TYPES:
                    kwargs["type"] = _TYPES[name]
                else:
                    custom_type = True
            elif kw.arg == "default":
                value = _literal(kw.value)
                if value is _NOT_GIVEN:
                    computed_default = True
                else:
                    kwargs["default"] = value
            elif kw.arg in ("nargs", "const", "dest"):
                value = _literal(kw.value)
                if value is not _NOT_GIVEN:
                    kwargs[kw.arg] = value
        else:
            if kwargs.get("nargs") is None and not flags[0].startswith("-") and kwargs.get("action") in (None, "store"):
                kwargs["nargs"] = "?"  # a required positional must not make the whole parse fail
            if custom_type or computed_default:
                kwargs["default"] = _NOT_GIVEN
            try:
                action = parser.add_argument(*flags, **kwargs)
            except (ValueError, TypeError, argparse.ArgumentError):
                continue
            declared = True
            if custom_type:
                unknown_when_given.add(action.dest)
            if computed_default:
                unknown_default.add(action.dest)
    if not declared:
        return {}
    try:
        ns, _rest = parser.parse_known_args(list(argv))
    except (_ParseError, ValueError, TypeError):
        return {}
    out: dict[str, Any] = {}
    for dest, value in vars(ns).items():
        if value is _NOT_GIVEN:
            out[dest] = UNKNOWN if dest in unknown_default else defaults.get(dest, UNKNOWN)
        elif dest in unknown_when_given:
            out[dest] = UNKNOWN
        else:
            out[dest] = value
    for dest, value in defaults.items():
        out.setdefault(dest, value)
    return out


def _given_flags(tree: ast.AST) -> dict[str, list[str]]:
    """dest → option strings, to say in the plan's reason which argument decided."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if not flags:
                continue
            dest = next((_literal(kw.value) for kw in node.keywords if kw.arg == "dest"), None)
            if not isinstance(dest, str):
                longs = [f for f in flags if f.startswith("--")]
                dest = (longs[0] if longs else flags[0]).lstrip("-").replace("-", "_")
            out.setdefault(dest, flags)
    return out


# --------------------------------------------------------------------------------------------- reaching a call


def _and(a: Any, b: Any) -> Any:
    if a is False or b is False:
        return False
    if a is True and b is True:
        return True
    return UNKNOWN


def _or(a: Any, b: Any) -> Any:
    if a is True or b is True:
        return True
    if a is False and b is False:
        return False
    return UNKNOWN


def _not(a: Any) -> Any:
    return UNKNOWN if a is UNKNOWN else (not a)


class _Reach:
    """Whether a call runs, given the script's options: the `if` tests around it and around the calls of the
    functions it sits in, evaluated with three-valued logic (true, false, UNKNOWN)."""

    def __init__(self, tree: ast.Module, scanner: _Scanner, options: dict[str, Any], flags: dict[str, list[str]],
                 argv: Sequence[str], nproc: int) -> None:
        self.tree = tree
        self.scanner = scanner
        self.options = options
        self.flags = flags
        self.argv = list(argv)
        self.nproc = nproc
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.args_names = self._args_names()
        self.assignments = self._option_assignments()
        self.module_constants = self._module_constants()
        self.env_dependent = False
        self.deciding: list[str] = []  # the guards that settled it, as source text with their values
        self._resolving: set[str] = set()

    # -- what holds the parsed options
    def _args_names(self) -> set[str]:
        producers: set[str] = set()  # functions returning parse_args()
        names: set[str] = set()

        def is_parse(call: ast.AST) -> bool:
            if isinstance(call, ast.Subscript):
                call = call.value
            if not isinstance(call, ast.Call):
                return False
            f = call.func
            if isinstance(f, ast.Attribute) and f.attr in ("parse_args", "parse_known_args"):
                return True
            return isinstance(f, ast.Name) and f.id in producers

        for _ in range(2):  # producers may be defined after their first use
            for node in ast.walk(self.tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for sub in ast.walk(node):
                        if isinstance(sub, ast.Return) and sub.value is not None and (
                            is_parse(sub.value) or (isinstance(sub.value, ast.Name) and sub.value.id in names)
                        ):
                            producers.add(node.name)
                if isinstance(node, ast.Assign) and is_parse(node.value):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            names.add(target.id)
                        elif isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name):
                            names.add(target.elts[0].id)
        return names

    def _option_assignments(self) -> dict[str, list[ast.AST]]:
        """dest → statements that assign `args.dest` after parsing (derived flags, overrides)."""
        out: dict[str, list[ast.AST]] = {}
        for node in ast.walk(self.tree):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in self.args_names:
                        out.setdefault(sub.attr, []).append(node)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
                first, name = node.args[0], node.args[1] if len(node.args) > 1 else None
                if isinstance(first, ast.Name) and first.id in self.args_names:
                    key = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else "*"
                    out.setdefault(key, []).append(node)
        return out

    def _module_constants(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        values: dict[str, Any] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        counts[t.id] = counts.get(t.id, 0) + 1
                        values[t.id] = node.value
        out = {}
        for stmt in self.tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                name = stmt.targets[0].id
                value = _literal(stmt.value)
                if counts.get(name) == 1 and value is not _NOT_GIVEN:
                    out[name] = value
        return out

    # -- values
    def _option(self, dest: str) -> Any:
        assigned = self.assignments.get(dest, []) + self.assignments.get("*", [])
        if not assigned:
            return self.options.get(dest, UNKNOWN)
        if dest in self._resolving or len(assigned) != 1 or not isinstance(assigned[0], ast.Assign):
            return UNKNOWN
        stmt = assigned[0]
        if not isinstance(self.parents.get(stmt), (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            return UNKNOWN  # assigned on some paths only
        self._resolving.add(dest)
        try:
            return self.value(stmt.value)
        finally:
            self._resolving.discard(dest)

    def value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id == "__name__":
                return "__main__"
            return self.module_constants.get(node.id, UNKNOWN)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in self.args_names:
                return self._option(node.attr)
            if (self.scanner.name(node) or "").endswith("environ"):
                self.env_dependent = True
            return UNKNOWN
        if isinstance(node, ast.Subscript):
            if (self.scanner.name(node.value) or "").endswith("environ"):
                self.env_dependent = True
            return UNKNOWN
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, ast.BoolOp):
            result = self.truth(node.values[0])
            for v in node.values[1:]:
                result = (_and if isinstance(node.op, ast.And) else _or)(result, self.truth(v))
            return result
        if isinstance(node, ast.UnaryOp):
            operand = self.value(node.operand)
            if isinstance(node.op, ast.Not):
                return _not(self._truthy(operand))
            if operand is UNKNOWN:
                return UNKNOWN
            try:
                return -operand if isinstance(node.op, ast.USub) else operand
            except TypeError:
                return UNKNOWN
        if isinstance(node, ast.Compare):
            return self._compare(node)
        if isinstance(node, ast.BinOp):
            left, right = self.value(node.left), self.value(node.right)
            if left is UNKNOWN or right is UNKNOWN:
                return UNKNOWN
            ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                   ast.FloorDiv: lambda a, b: a // b, ast.Div: lambda a, b: a / b, ast.Mod: lambda a, b: a % b}
            fn = ops.get(type(node.op))
            try:
                return fn(left, right) if fn else UNKNOWN
            except Exception:
                return UNKNOWN
        if isinstance(node, ast.IfExp):
            test = self.truth(node.test)
            if test is UNKNOWN:
                return UNKNOWN
            return self.value(node.body if test else node.orelse)
        return UNKNOWN

    def _call(self, node: ast.Call) -> Any:
        name = self.scanner.name(node.func) or ""
        if name.endswith(("environ.get", "getenv", "environ.__contains__")):
            self.env_dependent = True
            return UNKNOWN
        if name == "torch.cuda.is_available":
            return True  # the probe gives the ranks devices (real ones, or emulated on CPU)
        if name == "torch.cuda.device_count":
            return self.nproc
        if name in ("int", "float", "bool", "str", "len") and len(node.args) == 1 and not node.keywords:
            arg = self.value(node.args[0])
            if arg is UNKNOWN:
                return UNKNOWN
            try:
                return {"int": int, "float": float, "bool": bool, "str": str, "len": len}[name](arg)
            except Exception:
                return UNKNOWN
        return UNKNOWN

    def _compare(self, node: ast.Compare) -> Any:
        left = self.value(node.left)
        result: Any = True
        for op, comparator in zip(node.ops, node.comparators):
            right = self.value(comparator)
            if isinstance(op, (ast.In, ast.NotIn)) and (self.scanner.name(comparator) or "").endswith("environ"):
                self.env_dependent = True
                return UNKNOWN
            if left is UNKNOWN or right is UNKNOWN:
                result = _and(result, UNKNOWN)
            else:
                try:
                    one = {
                        ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
                        ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
                        ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
                        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
                    }[type(op)](left, right)
                except Exception:
                    one = UNKNOWN
                result = _and(result, bool(one) if one is not UNKNOWN else UNKNOWN)
            left = right
        return result

    @staticmethod
    def _truthy(value: Any) -> Any:
        if value is UNKNOWN:
            return UNKNOWN
        try:
            return bool(value)
        except Exception:
            return UNKNOWN

    def truth(self, node: ast.AST) -> Any:
        return self._truthy(self.value(node))

    # -- paths
    def _guard(self, test: ast.AST, polarity: bool) -> Any:
        t = self.truth(test)
        if t is not UNKNOWN:
            text = ast.unparse(test)
            if text != "__name__ == '__main__'":
                self.deciding.append(f"`{text}` is {'true' if t else 'false'}{self._because(test)}")
        return t if polarity else _not(t)

    def _because(self, test: ast.AST) -> str:
        """` (--flag given)` when the test reads a store_true-like option the arguments set or not."""
        for sub in ast.walk(test):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in self.args_names:
                flags = self.flags.get(sub.attr)
                if flags:
                    given = [f for f in flags if any(a == f or a.startswith(f + "=") for a in self.argv)]
                    longest = max(flags, key=len)
                    return f": {given[0]} given" if given else f": {longest} not given"
        return ""

    def reach(self, node: ast.AST, depth: int = 0, seen: frozenset[str] = frozenset()) -> Any:
        result: Any = True
        cur = node
        parent = self.parents.get(cur)
        while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module, ast.ClassDef, ast.Lambda)):
            if isinstance(parent, ast.If) and cur is not parent.test:
                result = _and(result, self._guard(parent.test, cur in parent.body))
            elif isinstance(parent, ast.IfExp) and cur is not parent.test:
                result = _and(result, self._guard(parent.test, cur is parent.body))
            elif isinstance(parent, ast.While) and cur in parent.body:
                result = _and(result, self.truth(parent.test))
            elif isinstance(parent, ast.Try) and any(cur is h for h in parent.handlers):
                result = _and(result, UNKNOWN)
            elif isinstance(parent, (ast.match_case, ast.BoolOp)):
                result = _and(result, UNKNOWN)
            if result is False:
                return False
            cur, parent = parent, self.parents.get(parent)
        if parent is None or isinstance(parent, ast.Module):
            return result
        if not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) or depth >= 4 or parent.name in seen:
            return _and(result, UNKNOWN)
        if isinstance(self.parents.get(parent), ast.ClassDef):
            return _and(result, UNKNOWN)  # a method: who calls it is beyond this quick read
        callers = [
            n for n in ast.walk(self.tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == parent.name
            and not self._inside(n, parent)
        ]
        if not callers:
            return _and(result, UNKNOWN)  # used as a callback (fire.Fire(main), hydra): cannot tell
        called: Any = False
        for call in callers:
            called = _or(called, self.reach(call, depth + 1, seen | {parent.name}))
            if called is True:
                break
        return _and(result, called)

    def _inside(self, node: ast.AST, func: ast.AST) -> bool:
        p = self.parents.get(node)
        while p is not None:
            if p is func:
                return True
            p = self.parents.get(p)
        return False


def plan_launch(source: str, args: Sequence[str] = (), nproc: int = 2) -> LaunchPlan:
    """The launch plan for a script's source text run with `args`. A syntax error gives the default plan (static
    analysis reports it)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return LaunchPlan()
    s = _Scanner()
    s.visit(tree)
    local_rank = s.local_rank
    if s.horovod and not s.spawn_calls:
        return LaunchPlan(
            reads_launcher_env=s.reads_env, inits_process_group=s.init_pg, launcher="horovodrun",
            reason="it imports Horovod: one process per slot with Horovod's environment, as `horovodrun -np N` "
            "starts it",
        )
    if s.data_parallel_line and not s.spawn_calls and not s.init_pg and not s.reads_env:
        return LaunchPlan(
            local_rank_line=local_rank[1] if local_rank else None,
            local_rank_declared=local_rank[0] if local_rank else None,
            single_process=True,
            reason=f"it trains with nn.DataParallel (line {s.data_parallel_line}) and never initialises a process "
            "group: one process drives every GPU, so it was started once, as `python train.py`",
        )
    common = dict(
        spawn_line=s.spawn_line,
        reads_launcher_env=s.reads_env,
        inits_process_group=s.init_pg,
        local_rank_line=local_rank[1] if local_rank else None,
        local_rank_declared=local_rank[0] if local_rank else None,
    )
    torchrun = LaunchPlan(**common, local_rank_option=local_rank[0] if local_rank else None)
    if not s.spawn_calls or not s.init_pg:
        return torchrun
    reach = _Reach(tree, s, script_options(tree, args), _given_flags(tree), args, nproc)
    reached: Any = False
    for call in s.spawn_calls:
        reached = _or(reached, reach.reach(call))
    where = f"its spawn call at line {s.spawn_line}"
    why = "; ".join(dict.fromkeys(reach.deciding))
    spawn = dict(common, spawns_own_ranks=True, local_rank_option=None)
    if reached is True:
        return LaunchPlan(**spawn, reason=f"{where} runs" + (f" with these arguments ({why})" if why else ""))
    if reached is False:
        return LaunchPlan(**common, local_rank_option=torchrun.local_rank_option,
                          reason=f"{where} does not run with these arguments" + (f" ({why})" if why else ""))
    if reach.env_dependent:
        return LaunchPlan(**common, local_rank_option=torchrun.local_rank_option,
                          reason=f"it reads the launcher's variables to choose between torchrun and {where}")
    return LaunchPlan(**spawn, decided_at_runtime=True, reason=f"whether {where} runs is not known before the run")


def plan_for_file(script: Path, args: Sequence[str] = (), nproc: int = 2) -> LaunchPlan:
    from ddpdoctor.errors import UsageError
    from ddpdoctor.sourcefile import read_source

    try:
        return plan_launch(read_source(script), args, nproc)
    except UsageError:
        return LaunchPlan()
