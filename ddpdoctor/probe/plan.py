"""How to launch a script, decided from its source and the arguments it is given. The script is read through the
static interpreter (`ddpdoctor.static`), the same reading the static rules get: its spawn calls, process groups,
launcher variables and options are events of that walk, and whether a spawn call runs is read from the branches
around it on the path the walk took to it (callers included), evaluated with the script's options as the given
arguments set them. Never imports or runs the script.

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
- A script whose argparse parser declares a *required* --local_rank / --local-rank gets `--local_rank=N`, as
  torch.distributed.launch passed it (torchrun does not, and argparse would exit); an optional one is left to its
  default, as under torchrun, so DD108 measures what the script does with it.
- A script that trains with nn.DataParallel and never initialises a process group (no spawn, no launcher variable
  read) is one process driving every GPU: it is started once (mode "single"), as `python train.py`, and that
  process is rank 0 of a world of one; under CUDA emulation it sees N GPUs. If it turns out to need a launcher
  after all (launch_check), it is relaunched under torchrun.
- A script that imports Horovod is launched the way `horovodrun -np N` launches it: one process per slot whose
  environment has Horovod's contract (HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, ...) and not torchrun's
  (no RANK, WORLD_SIZE, MASTER_ADDR...): `launcher` is "horovodrun" (ddpdoctor.probe.launch_env applies it).
- A script that builds a Lightning Fabric and never calls `.launch()` is written for `fabric run`: torchrun's
  contract plus Fabric's LT_CLI_USED=1, LT_DEVICES, LT_NUM_NODES (`launcher` "fabric-run"); without them Fabric
  refuses more than one device and the run would report the launcher's absence as the script's crash.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ddpdoctor import torchnames as N
from ddpdoctor.errors import UsageError
from ddpdoctor.records import LaunchMode
from ddpdoctor.static.apis.cli import UNKNOWN as CLI_UNKNOWN
from ddpdoctor.static.engine.expressions import NOT_COMPUTED, known_value, truth_of

LAUNCHER_ENV = N.LAUNCHER_ENV
LOCAL_RANK_OPTIONS = N.LOCAL_RANK_OPTIONS
DATA_PARALLEL_FUNCTION = "torch.nn.parallel.data_parallel"  # the functional form, canonical name


def _place(ev: Any, model: Any) -> str:
    return f"line {ev.line}" if ev.file == model.filename else f"{ev.file}:{ev.line}"


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
    # whose environment contract each process gets: "torchrun" (RANK, WORLD_SIZE, ...), "horovodrun" (HOROVOD_*)
    # or "fabric-run" (torchrun's and Lightning Fabric's LT_CLI_USED, LT_DEVICES, LT_NUM_NODES)
    launcher: str = "torchrun"
    # one process drives every GPU (nn.DataParallel without a process group): started once, as `python train.py`
    single_process: bool = False

    @property
    def mode(self) -> LaunchMode:
        if self.spawns_own_ranks:
            return LaunchMode.SPAWN
        return LaunchMode.SINGLE if self.single_process else LaunchMode.TORCHRUN

    def to_json(self) -> dict:
        return {
            "mode": self.mode.value,
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


# --------------------------------------------------------------------------------------------- three-valued logic


# a value the source does not settle before the run (the interpreter's sentinel: an option set to it stays unknown)
UNKNOWN: Any = CLI_UNKNOWN
_NOT_GIVEN = object()


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


# --------------------------------------------------------------------------------------------- argparse options


class _ParseError(Exception):
    pass


class _QuietParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _ParseError(message)

    def exit(self, status: int = 0, message: str | None = None):
        raise _ParseError(message or "")


_ACTIONS = {"store", "store_true", "store_false", "store_const", "append", "append_const", "count", "extend"}
_TYPES = {"int": int, "float": float, "str": str}


def _literal(value: Any) -> Any:
    """The Python value of an interpreter Value that is a literal (lists stay lists), else _NOT_GIVEN."""
    v = known_value(value) if value else _NOT_GIVEN
    if v is _NOT_GIVEN or v is NOT_COMPUTED:
        return _NOT_GIVEN
    obj = value[0]
    if isinstance(v, tuple) and isinstance(obj.node, ast.List):
        return list(v)
    return v


def _read(tree_or_model: Any) -> Any:
    """The static model of a script given as a model, a tree, or source text."""
    from ddpdoctor.static import build_model
    from ddpdoctor.static.model import ScriptModel

    if isinstance(tree_or_model, ScriptModel):
        return tree_or_model
    if isinstance(tree_or_model, ast.Module):
        return ScriptModel.build(tree_or_model, "", "<script>")
    return build_model(tree_or_model, "<script>")


def script_options(script: Any, argv: Sequence[str]) -> dict[str, Any]:
    """dest → value of the script's argparse options as `argv` sets them, rebuilt from the literal parts of its
    `add_argument` calls (every parser the script builds, merged). Options whose value the source cannot tell (a
    custom `type=` applied to a given value, a computed default) map to UNKNOWN; {} when the arguments do not
    parse. `script`: its static model (or tree, or source text)."""
    model = _read(script)
    parser = _QuietParser(add_help=False, allow_abbrev=True, conflict_handler="resolve")
    unknown_when_given: set[str] = set()
    unknown_default: set[str] = set()
    defaults: dict[str, Any] = {}
    declared = False
    for ev in model.of("add_argument", "set_defaults"):
        if ev.kind == "set_defaults":
            for name, value in ev.data["args"].kw.items():
                literal = _literal(value)
                if literal is not _NOT_GIVEN:
                    defaults[name] = literal
            continue
        spec = ev.data["arg"]
        args = spec.args
        flags = [_literal(v) for v in args.pos]
        if args.opaque or not flags or not all(isinstance(f, str) and f for f in flags):
            continue
        kwargs: dict[str, Any] = {}
        custom_type = computed_default = False
        for key, value in args.kw.items():
            if key == "action":
                action = _literal(value)
                if isinstance(action, str) and action in _ACTIONS:
                    kwargs["action"] = action
                elif any(o.kind == "qual" and (o.qual or "").endswith("BooleanOptionalAction") for o in value):
                    kwargs["action"] = argparse.BooleanOptionalAction
                else:
                    kwargs = {}
                    break  # help / version / a custom action: not an option we can evaluate
            elif key == "type":
                names = {o.label for o in value if o.kind == "builtin"}
                if len(value) == 1 and names and names <= set(_TYPES):
                    kwargs["type"] = _TYPES[names.pop()]
                else:
                    custom_type = True
            elif key == "default":
                literal = _literal(value)
                if literal is _NOT_GIVEN:
                    computed_default = True
                else:
                    kwargs["default"] = literal
            elif key in ("nargs", "const", "dest"):
                literal = _literal(value)
                if literal is not _NOT_GIVEN:
                    kwargs[key] = literal
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


# --------------------------------------------------------------------------------------------- reaching a call


class _Reach:
    """Whether a spawn call runs with the given options: the branches on the path the interpreter took to it,
    each test evaluated to true, false or UNKNOWN, and-ed; a call reached only because nothing calls its function
    (a callback handed to fire.Fire or hydra) is UNKNOWN."""

    def __init__(self, model: Any, flags: dict[str, tuple[str, ...]], argv: Sequence[str]) -> None:
        self.model = model
        self.flags = flags
        self.argv = list(argv)
        self.env_dependent = False
        self.deciding: list[str] = []  # the guards that settled it, as source text with their values
        self._env_sites = [
            (ev.file, ev.node) for ev in model.of("env_read", "env_check") if getattr(ev.node, "end_lineno", None)
        ]

    def reach(self, ev: Any) -> Any:
        if not ev.reached:
            return UNKNOWN
        result: Any = True
        for c in reversed(ev.ctx):
            if c.kind in ("cond", "rank") and isinstance(c.node, (ast.If, ast.IfExp)):
                result = _and(result, self._guard(c, ev.file))
            elif c.kind == "loop" and isinstance(c.node, ast.While):
                result = _and(result, self._truth(c, ev.file))
            elif (
                c.kind == "try"
                and isinstance(c.node, ast.ExceptHandler)
                or c.kind == "cond"
                and isinstance(c.node, ast.Match)
            ):
                result = _and(result, UNKNOWN)
            if result is False:
                return False
        return result

    def _truth(self, c: Any, file: str) -> Any:
        truth = truth_of(c.test) if c.test else None
        if truth is None:
            if self._reads_env(c, file):
                self.env_dependent = True
            return UNKNOWN
        return truth

    def _guard(self, c: Any, file: str) -> Any:
        t = self._truth(c, file)
        if t is not UNKNOWN:
            test = c.node.test
            self.deciding.append(f"`{ast.unparse(test)}` is {'true' if t else 'false'}{self._because(test)}")
        return t if c.branch == 0 else _not(t)

    def _reads_env(self, c: Any, file: str) -> bool:
        if any("env" in o.tags for o in c.test):
            return True
        nodes = [getattr(c.node, "test", None)] + [o.node for o in c.test]
        return any(
            site_file == file and _inside(site, node)
            for node in nodes
            if node is not None
            for site_file, site in self._env_sites
        )

    def _because(self, test: ast.AST) -> str:
        """` (--flag given)` when the test reads a store_true-like option the arguments set or not."""
        for sub in ast.walk(test):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                flags = self.flags.get(sub.attr)
                if flags:
                    given = [f for f in flags if any(a == f or a.startswith(f + "=") for a in self.argv)]
                    longest = max(flags, key=len)
                    return f": {given[0]} given" if given else f": {longest} not given"
        return ""


def _inside(node: ast.AST, outer: ast.AST) -> bool:
    """Whether `node` lies within `outer`'s source span."""
    start = (getattr(outer, "lineno", 0), getattr(outer, "col_offset", 0))
    end = (getattr(outer, "end_lineno", None) or 0, getattr(outer, "end_col_offset", None) or 0)
    here = (getattr(node, "lineno", -1), getattr(node, "col_offset", -1))
    return start <= here < end


# --------------------------------------------------------------------------------------------- the plan


FABRIC_CLASSES = ("lightning.fabric.Fabric",)  # canonical (torchnames): lightning.Fabric, lightning_fabric.Fabric


def fabric_run_style(model: Any) -> int | None:
    """The line that builds a Lightning Fabric, when the script never calls `.launch()` (nothing named launch is
    called as a method): such a script is written for `fabric run`, which starts the ranks itself and tells
    Fabric so (LT_CLI_USED); started under torchrun alone, Fabric refuses to run on more than one device."""
    built = [ev for ev in model.of("call") if (ev.data.get("qual") or "") in FABRIC_CLASSES]
    if not built:
        return None
    if any((ev.data.get("name") or "").rsplit(".", 1)[-1] == "launch" and not ev.data.get("qual")
           for ev in model.of("call")):
        return None
    return min(built, key=lambda ev: ev.seq).line


def plan_for_model(model: Any, args: Sequence[str] = (), nproc: int = 2, rebuild: Any = None) -> LaunchPlan:
    """The launch plan from a script's static model. `rebuild(assume)` interprets the script again with facts
    the source cannot tell (the options as `args` set them, the devices the probe gives): needed only for a
    script that spawns its own ranks, to decide whether its spawn call runs. A torchrun-style script written for
    `fabric run` (fabric_run_style) gets that launcher's contract: torchrun's variables and Fabric's LT_*."""
    plan = _plan_for_model(model, args, nproc, rebuild)
    line = fabric_run_style(model) if plan.mode is LaunchMode.TORCHRUN and plan.launcher == "torchrun" else None
    if line is None:
        return plan
    return replace(plan, launcher="fabric-run", reason=(
        f"it builds a Lightning Fabric (line {line}) and never calls .launch(): it is written for `fabric run "
        f"--devices {nproc}`, which starts the ranks under torchrun with LT_CLI_USED=1, LT_DEVICES and LT_NUM_NODES"))


def _plan_for_model(model: Any, args: Sequence[str], nproc: int, rebuild: Any) -> LaunchPlan:
    spawns = model.of("spawn", "process")
    inits = bool(model.of("init_pg")) or any(
        (ev.data.get("name") or "").endswith("init_process_group") for ev in model.of("call")
    )
    reads_env = any(
        ev.data.get("var") in LAUNCHER_ENV and ev.data.get("how") != "setdefault" for ev in model.of("env_read")
    ) or any(ev.data.get("var") in LAUNCHER_ENV for ev in model.of("env_check"))
    local_rank: tuple[str, int] | None = None
    local_rank_required = False
    for ev in model.of("add_argument"):
        declared = [f for f in ev.data["arg"].flags if f in LOCAL_RANK_OPTIONS]
        if declared:
            local_rank = (declared[0], ev.line)
            local_rank_required = any(
                kw.arg == "required" and isinstance(kw.value, ast.Constant) and kw.value.value is True
                for kw in getattr(ev.data["arg"].node, "keywords", ())
            )
            break
    if any(m.split(".")[0] == "horovod" for m in model.imported) and not spawns:
        return LaunchPlan(
            reads_launcher_env=reads_env,
            inits_process_group=inits,
            launcher="horovodrun",
            reason="it imports Horovod: one process per slot with Horovod's environment, as `horovodrun -np N` "
            "starts it",
        )
    data_parallel = [ev for ev in model.of("wrap") if ev.data["wrapper_kind"] == "dp"] + [
        ev for ev in model.of("call") if ev.data.get("qual") == DATA_PARALLEL_FUNCTION
    ]
    if data_parallel and not spawns and not inits and not reads_env:
        first = min(data_parallel, key=lambda ev: ev.seq)
        return LaunchPlan(
            local_rank_line=local_rank[1] if local_rank else None,
            local_rank_declared=local_rank[0] if local_rank else None,
            single_process=True,
            reason=f"it trains with nn.DataParallel ({_place(first, model)}) and never initialises a process "
            "group: one process drives every GPU, so it was started once, as `python train.py`",
        )
    spawn_line = spawns[0].line if spawns else None
    spawn_place = _place(spawns[0], model) if spawns else f"line {spawn_line}"
    common: dict[str, Any] = {
        "spawn_line": spawn_line,
        "reads_launcher_env": reads_env,
        "inits_process_group": inits,
        "local_rank_line": local_rank[1] if local_rank else None,
        "local_rank_declared": local_rank[0] if local_rank else None,
    }
    # torchrun never passes --local_rank: the probe passes it only where argparse would otherwise exit (a required
    # option), so that the rest can be measured; an optional one keeps its default, as under torchrun, and DD108
    # measures what that does (the ranks' devices, DD105).
    torchrun = LaunchPlan(**common, local_rank_option=local_rank[0] if local_rank and local_rank_required else None)
    if not spawns or not inits:
        return torchrun
    options = script_options(model, args)
    flags = {ev.data["arg"].dest: ev.data["arg"].flags for ev in model.of("add_argument")}
    assumed = rebuild({"options": options, "device_count": nproc, "cuda_available": True}) if rebuild else model
    reach = _Reach(assumed, flags, args)
    reached: Any = False
    for ev in assumed.of("spawn", "process"):
        reached = _or(reached, reach.reach(ev))
    where = f"its spawn call at {spawn_place}"
    why = "; ".join(dict.fromkeys(reach.deciding))
    spawn = {**common, "spawns_own_ranks": True, "local_rank_option": None}
    if reached is True:
        return LaunchPlan(**spawn, reason=f"{where} runs" + (f" with these arguments ({why})" if why else ""))
    if reached is False:
        return LaunchPlan(
            **common,
            local_rank_option=torchrun.local_rank_option,
            reason=f"{where} does not run with these arguments" + (f" ({why})" if why else ""),
        )
    if reach.env_dependent:
        return LaunchPlan(
            **common,
            local_rank_option=torchrun.local_rank_option,
            reason=f"it reads the launcher's variables to choose between torchrun and {where}",
        )
    return LaunchPlan(**spawn, decided_at_runtime=True, reason=f"whether {where} runs is not known before the run")


def plan_launch(source: str, args: Sequence[str] = (), nproc: int = 2, filename: str = "<script>") -> LaunchPlan:
    """The launch plan for a script's source text run with `args`. A script that does not parse gets the default
    plan (static analysis reports it)."""
    from ddpdoctor.static import build_model

    try:
        model = build_model(source, filename)
    except UsageError:
        return LaunchPlan()
    return plan_for_model(model, args, nproc, rebuild=lambda assume: build_model(source, filename, assume))


def plan_for_file(script: Path, args: Sequence[str] = (), nproc: int = 2) -> LaunchPlan:
    """The launch plan for a script file, read with the project modules it imports (a helper may hold the spawn
    call, the process group or the launcher variables)."""
    from ddpdoctor.static import build_project_model

    try:
        model = build_project_model(script)
    except UsageError:
        return LaunchPlan()
    return plan_for_model(model, args, nproc, rebuild=lambda assume: build_project_model(script, assume))
