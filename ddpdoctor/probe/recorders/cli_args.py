"""Command-line recorder: a `--local_rank` / `--local-rank` option declared with argparse (the legacy launcher's
contract). Records where it is declared, its default and the parsed value, so DD108 can tell whether the script
falls back to LOCAL_RANK (the default differs per rank) or would give every rank the same value under torchrun.
Needs no torch: installed before the script starts."""

from __future__ import annotations

import argparse
from typing import Any

from ddpdoctor.probe.session import Probe

NAME = "cli_args"
SPELLINGS = ("--local_rank", "--local-rank")


def _json(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)[:80]


def install(probe: Probe) -> None:
    sites: dict[int, Any] = {}
    seen: set[int] = set()

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
            if id(self) not in seen:
                probe.safely("local_rank_arg", _record, probe, self, result, sites, seen)
            return result

        return parse_known_args

    probe.patcher.wrap(argparse._ActionsContainer, "add_argument", make_add)
    probe.patcher.wrap(argparse.ArgumentParser, "parse_known_args", make_parse)


def _record(probe: Probe, parser: argparse.ArgumentParser, result: Any, sites: dict[int, Any], seen: set[int]) -> None:
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
            value=_json(getattr(namespace, action.dest, None)),
            injected=bool(probe.settings.local_rank_arg),
            site=sites.get(id(action)),
            env_local_rank=_local_rank_env(),
        )
        return


def _local_rank_env() -> Any:
    import os

    return os.environ.get("LOCAL_RANK")
