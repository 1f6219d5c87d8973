"""Command-line recorder: a `--local_rank` / `--local-rank` option declared with argparse (the legacy launcher's
contract). Records where it is declared, its default and the parsed value, so DD108 can tell whether the script
falls back to LOCAL_RANK (the default differs per rank) or would give every rank the same value under torchrun;
and the first read of LOCAL_RANK from the environment by user code (a helper module such as timm's
`init_distributed_device` reads it after parsing), so DD108 knows the script does not depend on the option.
Also the numeric options every parser parsed (`parsed_args`): DD402 evaluates the scaling expression static analysis
saw (`args.lr * args.batch_size / 256`) with them. Needs no torch: installed before the script starts.

Diagnose past the first fatal bug (SPEC): under the probe's own torchrun launch an optional --local_rank keeps its
default, as under torchrun, and that is what the event records (`value`). A default that is a device index (0:
every rank on cuda:0) is left alone: the run measures what it does (DD105). One that names no device (-1, None:
`.cuda(-1)` raises before the first step) is replaced in the parsed namespace by the rank's LOCAL_RANK — what
torch.distributed.launch passed — so the probe goes on measuring the rest. The event says so (`overridden_to`), and
DD108 reports both: what torchrun would give every rank, and that the probe overrode it."""

from __future__ import annotations

import argparse
import math
from typing import Any

from ddpdoctor.probe.session import Probe
from ddpdoctor.records import LaunchMode

NAME = "cli_args"
SPELLINGS = ("--local_rank", "--local-rank")
MAX_VALUES = 64  # numeric options kept per parser


def _json(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)[:80]


def install(probe: Probe) -> None:
    sites: dict[int, Any] = {}
    seen: set[int] = set()
    parsed: set[int] = set()

    def make_add(orig):
        def add_argument(self, *args: Any, **kwargs: Any) -> Any:
            action = orig(self, *args, **kwargs)
            if any(a in SPELLINGS for a in args if isinstance(a, str)):
                sites[id(action)] = probe.site()
            return action

        return add_argument

    def make_parse(orig):
        def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:
            result = orig(self, *args, **kwargs)
            overridden = probe.safely("local_rank_arg", _override_default, probe, self, result)
            if id(self) not in parsed:
                parsed.add(id(self))
                probe.safely("parsed_args", _record_values, probe, result, probe.site())
            if id(self) not in seen:
                probe.safely("local_rank_arg", _record, probe, self, result, sites, seen, overridden)
            return result

        return parse_known_args

    probe.patcher.wrap(argparse._ActionsContainer, "add_argument", make_add)
    probe.patcher.wrap(argparse.ArgumentParser, "parse_known_args", make_parse)
    _install_env_reads(probe)


ENV_VARS = ("LOCAL_RANK",)


def _install_env_reads(probe: Probe) -> None:
    """One `env_read` event for the first read of LOCAL_RANK by user code (`os.environ[...]`, `.get`,
    `os.getenv`, `"LOCAL_RANK" in os.environ`)."""
    import os
    import sys

    from ddpdoctor.probe.session import is_user_file

    seen: set[str] = set()

    import _collections_abc

    # Python 3.11+ runs os and _collections_abc frozen: their frames say "<frozen os>", not os.__file__ (without
    # these, `os.environ.get(...)` and `os.getenv(...)`, which go through Mapping.get, were never attributed). Only
    # these two: the import machinery's frozen frames must stop the walk (a read made while a module is imported,
    # by an import hook, is not the importing line's)
    from ddpdoctor.probe import session

    plumbing = {os.__file__, _collections_abc.__file__, "<frozen os>", "<frozen _collections_abc>"}
    ours = {__file__, session.__file__}  # this wrapper and Probe.safely, between the read and whoever asked

    def _is_plumbing(filename: str) -> bool:
        return filename in plumbing

    def note(key: Any, how: str) -> None:
        if key in ENV_VARS and key not in seen and not probe.ending:
            # the code that asked: above this wrapper and os.environ's own machinery (os.getenv, Mapping.get); a
            # read made by a library (torch) or by the probe itself (a recorder wrapping init_process_group) on the
            # user's behalf is not the script reading it
            f = sys._getframe(1)
            while f is not None and (f.f_code.co_filename in ours or _is_plumbing(f.f_code.co_filename)):
                f = f.f_back
            if f is None or not is_user_file(f.f_code.co_filename):
                return
            seen.add(key)
            probe.emit("env_read", var=key, how=how, value=os.environ.get(key) if how != "contains" else None,
                       site={"file": f.f_code.co_filename, "line": f.f_lineno, "function": f.f_code.co_name})

    def make_getitem(orig):
        def __getitem__(self: Any, key: Any) -> Any:
            if key in ENV_VARS:
                probe.observe("env_read", note, key, "getitem")
            return orig(self, key)

        return __getitem__

    def make_contains(orig):
        def __contains__(self: Any, key: Any) -> bool:
            if key in ENV_VARS:
                probe.observe("env_read", note, key, "contains")
            return orig(self, key)

        return __contains__

    probe.patcher.wrap(type(os.environ), "__getitem__", make_getitem)
    probe.patcher.wrap(type(os.environ), "__contains__", make_contains)


def _local_rank_action(parser: argparse.ArgumentParser) -> argparse.Action | None:
    return next((a for a in parser._actions if any(o in SPELLINGS for o in a.option_strings)), None)


def _override_default(probe: Probe, parser: argparse.ArgumentParser, result: Any) -> tuple[Any, Any] | None:
    """(the value parsed, the value given instead) when an optional --local_rank kept a default that names no device
    (-1, None) under the probe's own torchrun launch; the namespace then holds LOCAL_RANK, converted by the option's
    type as argparse converts `--local_rank=N`."""
    import os

    settings = probe.settings
    env = os.environ.get("LOCAL_RANK")
    if settings.mode is not LaunchMode.TORCHRUN or settings.local_rank_arg or env is None:
        return None
    action = _local_rank_action(parser)
    if action is None or action.required:
        return None
    namespace = result[0] if isinstance(result, tuple) else result
    parsed = getattr(namespace, action.dest, None)
    if parsed != action.default or str(parsed) == env:
        return None  # given on the command line, or already this rank's
    try:
        if int(parsed) >= 0:
            return None  # a device index: what every rank on that device does is measured as it is (DD105)
    except (TypeError, ValueError):
        pass
    given = action.type(env) if callable(action.type) else env
    setattr(namespace, action.dest, given)
    return parsed, given


def _record(probe: Probe, parser: argparse.ArgumentParser, result: Any, sites: dict[int, Any], seen: set[int],
            overridden: tuple[Any, Any] | None = None) -> None:
    namespace = result[0] if isinstance(result, tuple) else result
    for action in parser._actions:
        if not any(o in SPELLINGS for o in action.option_strings):
            continue
        seen.add(id(parser))
        probe.emit(
            "local_rank_arg",
            option_strings=list(action.option_strings),
            dest=action.dest,
            default=_json(action.default),
            required=bool(action.required),
            value=_json(overridden[0] if overridden else getattr(namespace, action.dest, None)),
            overridden_to=_json(overridden[1]) if overridden else None,
            injected=bool(probe.settings.local_rank_arg),
            site=sites.get(id(action)),
            env_local_rank=_local_rank_env(),
        )
        return


def _record_values(probe: Probe, result: Any, site: Any) -> None:
    namespace = result[0] if isinstance(result, tuple) else result
    values = {
        k: v for k, v in vars(namespace).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    if values:
        probe.emit("parsed_args", values=dict(list(values.items())[:MAX_VALUES]), site=site)


def _local_rank_env() -> Any:
    import os

    return os.environ.get("LOCAL_RANK")
