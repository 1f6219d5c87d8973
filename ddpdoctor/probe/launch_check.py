"""The run-time half of the launch decision (ddpdoctor.probe.plan): a script started once, because it may spawn its
own ranks, shows which kind of script it is by what it does first.

- It starts ranks (torch.multiprocessing.spawn / start_processes, a multiprocessing.Process that is not a
  DataLoader worker): it is self-spawning; the run goes on as it is.
- Its main process, before starting any rank, calls init_process_group in a way a lone process cannot complete
  (rank or world size from the launcher's variables, which a single launch does not set, or a world size above
  1), or fails on a missing launcher variable (`os.environ["RANK"]`): it needs a launcher. It records why
  (`launch_decision`) and leaves with RELAUNCH_EXIT_CODE before any rendezvous; the launcher starts it again under
  torchrun, within the same timeout.

Only the main process of a launch with `settings.launch_check` set decides; its children and torchrun's ranks
never do.
"""

from __future__ import annotations

import os
from typing import Any

from ddpdoctor.probe.session import Probe, kill_children
from ddpdoctor.records import LaunchMode

RELAUNCH_EXIT_CODE = 75  # EX_TEMPFAIL: "try again" (under torchrun)
LAUNCHER_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
)


def deciding(probe: Probe) -> bool:
    """This process still has to tell what kind of script it runs."""
    first = probe.role == "main" or (probe.role == "rank" and probe.settings.mode is LaunchMode.SINGLE)
    return bool(probe.settings.launch_check) and first and probe.launch_decided is None


def ranks_started(probe: Probe, how: str, site: dict[str, Any] | None) -> None:
    """The main process started ranks itself: a self-spawning script."""
    if not deciding(probe):
        return
    probe.launch_decided = LaunchMode.SPAWN
    probe.emit("launch_decision", mode=LaunchMode.SPAWN.value, reason=f"the script started its ranks with {how}",
               site=site)


def init_needs_launcher(probe: Probe, arguments: dict[str, Any]) -> str | None:
    """Why this init_process_group cannot complete in a lone process started without a launcher, or None."""
    if not deciding(probe) or arguments.get("store") is not None:
        return None
    init_method = arguments.get("init_method")
    from_env = init_method is None or (isinstance(init_method, str) and init_method.startswith("env:"))
    rank, world = arguments.get("rank"), arguments.get("world_size")
    missing = []
    if from_env:
        if rank in (None, -1) and "RANK" not in os.environ:
            missing.append("RANK")
        if world in (None, -1) and "WORLD_SIZE" not in os.environ:
            missing.append("WORLD_SIZE")
    if missing:
        return (f"init_process_group reads {' and '.join(missing)} from the launcher, and the script's main process "
                "had started no rank")
    if isinstance(world, int) and not isinstance(world, bool) and world > 1:
        return (f"init_process_group(world_size={world}) in the script's main process, which had started no rank: "
                "it waits for peers that only a launcher starts")
    return None


def exception_needs_launcher(probe: Probe, exc: BaseException) -> str | None:
    """A KeyError on a launcher variable in the main process before it started any rank."""
    if not deciding(probe) or not isinstance(exc, KeyError) or not exc.args:
        return None
    key = exc.args[0]
    if isinstance(key, str) and key in LAUNCHER_VARIABLES:
        return f"the script read os.environ[{key!r}], which only a launcher sets"
    return None


def relaunch_under_launcher(probe: Probe, reason: str, site: dict[str, Any] | None) -> None:
    """Record the decision and leave at once (no rendezvous was attempted); the launcher relaunches."""
    probe.launch_decided = LaunchMode.TORCHRUN
    probe.ending = True
    probe.emit("launch_decision", mode=LaunchMode.TORCHRUN.value, reason=reason, site=site)
    probe.safely("children", kill_children)
    probe.leave(RELAUNCH_EXIT_CODE)
