"""Process-group recorder: init_process_group (what was asked, what was used, where), Python-level collectives,
and the end-of-run wait for peers.

Diagnose past the first fatal bug: when the launcher's env contract (RANK, WORLD_SIZE) is present and the script
passes a literal rank or world size that disagrees with it, the probe uses the launcher's values, records the
override (DD104 says so) and goes on measuring.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from typing import Any

from ddpdoctor.probe import launch_check
from ddpdoctor.probe.patching import wrap_everywhere
from ddpdoctor.probe.session import Probe, is_user_file
from ddpdoctor.records import LaunchMode
from ddpdoctor.world import place_from_env

NAME = "process_group"

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "barrier",
    "monitored_barrier",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)
EVENTS_PER_SITE = 50


def _literal(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)[:120]


class _State:
    def __init__(self) -> None:
        self.store: Any = None
        self.collective_seq = 0
        self.per_site: dict[tuple[str, str, int], int] = {}
        self.in_init = False


_STATES: dict[int, _State] = {}  # id(probe) -> its collective counters, for collectives torch makes itself


def record_implicit(probe: Probe, op: str, site: dict[str, Any] | None, implicit: str) -> None:
    """A collective torch makes on the script's behalf, at the user line that caused it (DDP's broadcast of rank 0's
    buffers at the start of a forward: no torch.distributed call of the script's, yet the other ranks must join it).
    Counted with the script's own calls, first calls per site only."""
    state = _STATES.get(id(probe))
    if state is None or not site or probe.ending or probe.quiet:
        return
    state.collective_seq += 1
    key = (op, str(site.get("file")), int(site.get("line") or 0))
    n = state.per_site.get(key, 0) + 1
    state.per_site[key] = n
    if n <= EVENTS_PER_SITE:
        probe.emit("collective", op=op, site=site, call=state.collective_seq, numel=None, dtype=None,
                   implicit=implicit)


def install(probe: Probe) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    c10d = dist.distributed_c10d
    state = _State()
    _STATES[id(probe)] = state
    signature = probe.signatures.get("init_process_group")
    if signature is None:
        try:
            signature = inspect.signature(c10d.init_process_group)
        except (TypeError, ValueError):
            signature = None

    def make_init(orig):
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            if state.in_init:  # another layer (CUDA emulation) calling through: record once, outermost
                return orig(*args, **kwargs)
            state.in_init = True
            try:
                return _init(orig, args, kwargs)
            finally:
                state.in_init = False

        return init_process_group

    def _init(orig, args: tuple, kwargs: dict) -> Any:
        site = probe.site()
        bound = probe.safely("pg_init arguments", _arguments, signature, args, kwargs)
        info: dict[str, Any] = {"site": site}
        overridden: dict[str, list[Any]] = {}
        rendezvous = None
        if bound is not None:
            if launch_check.deciding(probe):
                why = probe.safely("launch check", launch_check.init_needs_launcher, probe, dict(bound.arguments))
                if why:
                    launch_check.relaunch_under_launcher(probe, why, site)
            info.update(
                backend_requested=_literal(bound.arguments.get("backend")),
                init_method=_literal(bound.arguments.get("init_method")),
                rank_arg=_literal(bound.arguments.get("rank")),
                world_size_arg=_literal(bound.arguments.get("world_size")),
                env_rank=_launcher_value("rank"),
                env_world_size=_launcher_value("world_size"),
            )
            if probe.role in ("rank", "attached"):  # RANK in a child's environment is its parent's, not its own
                overridden = probe.safely("pg_init override", _override, bound) or {}
            rendezvous = probe.safely("pg_init rendezvous", _rendezvous, probe, bound)
            if overridden or rendezvous:
                args, kwargs = tuple(bound.args), dict(bound.kwargs)
        info["overridden"] = overridden
        info["rendezvous"] = rendezvous
        probe.emit("pg_init_begin", **info)
        t0 = time.perf_counter()
        try:
            result = orig(*args, **kwargs)
        except BaseException as exc:
            probe.emit("pg_init", ok=False, error=f"{type(exc).__name__}: {exc}"[:2000],
                       seconds=round(time.perf_counter() - t0, 3), **info)
            raise
        probe.safely("pg_init result", _after_init, probe, state, info, time.perf_counter() - t0)
        return result

    wrap_everywhere(probe, (c10d, dist), "init_process_group", make_init)
    for op in COLLECTIVES:
        if getattr(c10d, op, None) is not None:
            wrap_everywhere(probe, (c10d, dist), op, lambda fn, op=op: _make_collective(probe, state, op, fn))

    wrap_everywhere(probe, (c10d, dist), "destroy_process_group", _make_destroy)
    probe.peer_waiter = lambda: _wait_for_peers(probe, state)
    probe.end_hooks.append(lambda: _summary(probe, state))


# How long destroy_process_group lets other threads run first (seconds): see _make_destroy.
TEARDOWN_YIELD = 0.05


def _make_destroy(orig: Any) -> Any:
    """destroy_process_group, after giving up the GIL for a moment. A gloo worker thread drops the tensors of the
    collective it just finished only once it holds the GIL, and torch's ProcessGroupGloo destructor joins those
    threads while the caller holds it: a script that destroys the group right after a collective can deadlock
    there (seen: rank 0 in ~ProcessGroupGloo, its worker in take_gil, every peer done). The probe runs NCCL
    scripts on gloo, so this teardown hang is the emulation's, never the script's; sleeping releases the GIL so the
    worker finishes first."""

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        time.sleep(TEARDOWN_YIELD)
        return orig(*args, **kwargs)

    return destroy_process_group


def _arguments(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    if signature is None:
        return None
    bound = signature.bind(*args, **kwargs)
    return bound


def _launcher_value(name: str) -> str | None:
    """The launcher's rank / world size for this process, as text: torchrun's RANK/WORLD_SIZE, else SLURM's
    SLURM_PROCID/SLURM_NTASKS (srun without torchrun), else Open MPI's (ddpdoctor.world)."""
    value = getattr(place_from_env(os.environ), name)
    return None if value is None else str(value)


def _override(bound: inspect.BoundArguments) -> dict[str, list[Any]]:
    """Use the launcher's rank / world size where the script passed a different literal value."""
    env_rank, env_world = _launcher_value("rank"), _launcher_value("world_size")
    if env_rank is None or env_world is None or bound.arguments.get("store") is not None:
        return {}
    out: dict[str, list[Any]] = {}
    for name, env_value in (("rank", int(env_rank)), ("world_size", int(env_world))):
        given = bound.arguments.get(name)
        if isinstance(given, int) and not isinstance(given, bool) and given != -1 and given != env_value:
            bound.arguments[name] = env_value
            out[name] = [given, env_value]
    return out


def _rendezvous(probe: Probe, bound: inspect.BoundArguments) -> dict[str, str] | None:
    """Move the script's own rendezvous to the port the launcher chose on 127.0.0.1: `tcp://host:port` init
    methods, and MASTER_ADDR/MASTER_PORT that a self-spawning script set itself. Every process of the run applies
    the same mapping, so the ranks still meet; a fixed port of the user's could otherwise collide with another
    job on this machine (or join its rendezvous), and a remote address could not be reached by a one-machine
    probe. torchrun's own env:// rendezvous and an explicit store are left alone."""
    port = probe.settings.rendezvous_port
    if not port or probe.settings.mode not in (LaunchMode.TORCHRUN, LaunchMode.SPAWN) \
            or bound.arguments.get("store") is not None:
        return None
    init = bound.arguments.get("init_method")
    if isinstance(init, str) and init.startswith("tcp://"):
        _, sep, query = init[len("tcp://"):].partition("?")
        used = f"tcp://127.0.0.1:{port}" + sep + query
        if used == init:
            return None
        bound.arguments["init_method"] = used
        return {"given": init, "used": used}
    env_init = init is None or (isinstance(init, str) and init.startswith("env:"))
    launcher = probe.launcher_rendezvous
    if probe.settings.mode is LaunchMode.TORCHRUN and probe.role == "rank" and env_init and all(launcher.values()):
        # the script set MASTER_ADDR/MASTER_PORT itself (a tutorial's "localhost:12355"): torchrun's store is
        # where the launcher said, so ranks meeting at the script's address would wait there forever
        given = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        used = f"{launcher['MASTER_ADDR']}:{launcher['MASTER_PORT']}"
        if given == used:
            return None
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = launcher["MASTER_ADDR"], launcher["MASTER_PORT"]
        return {"given": f"MASTER_ADDR:MASTER_PORT={given}", "used": f"MASTER_ADDR:MASTER_PORT={used}"}
    if probe.settings.mode is LaunchMode.SPAWN and env_init:
        given = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        used = f"127.0.0.1:{port}"
        if given == used:
            return None
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        return {"given": f"MASTER_ADDR:MASTER_PORT={given}", "used": f"MASTER_ADDR:MASTER_PORT={used}"}
    return None


def _after_init(probe: Probe, state: _State, info: dict[str, Any], seconds: float) -> None:
    import torch.distributed as dist

    probe.rank = dist.get_rank()
    probe.world_size = dist.get_world_size()
    from ddpdoctor.probe.arms import seed_for_rank

    seed_for_rank(probe, probe.rank)  # a spawned child learns its rank here (triage seeds seed + rank)
    try:
        state.store = dist.distributed_c10d._get_default_store()
    except Exception:
        state.store = None
    try:
        backend = str(dist.get_backend())
    except Exception:
        backend = None
    probe.emit(
        "pg_init",
        ok=True,
        backend=backend,
        world_size=probe.world_size,
        seconds=round(seconds, 3),
        **info,
    )


def _make_collective(probe: Probe, state: _State, op: str, fn):
    def collective(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        if is_user_file(caller.f_code.co_filename) and not probe.ending and not probe.quiet:
            probe.safely("collective", _record_collective, probe, state, op, caller, args)
        return fn(*args, **kwargs)

    return collective


def _record_collective(probe: Probe, state: _State, op: str, caller: Any, args: tuple) -> None:
    state.collective_seq += 1
    key = (op, caller.f_code.co_filename, caller.f_lineno)
    n = state.per_site.get(key, 0) + 1
    state.per_site[key] = n
    if n > EVENTS_PER_SITE:
        return
    first = args[0] if args else None
    numel = dtype = None
    if hasattr(first, "numel") and hasattr(first, "dtype"):
        numel, dtype = int(first.numel()), str(first.dtype).replace("torch.", "")
    elif isinstance(first, (list, tuple)) and first and hasattr(first[0], "numel"):
        numel, dtype = int(sum(t.numel() for t in first)), str(first[0].dtype).replace("torch.", "")
    probe.emit(
        "collective",
        op=op,
        site={"file": caller.f_code.co_filename, "line": caller.f_lineno, "function": caller.f_code.co_name},
        call=state.collective_seq,
        numel=numel,
        dtype=dtype,
    )


def _summary(probe: Probe, state: _State) -> None:
    if state.per_site:
        probe.emit(
            "collectives_summary",
            sites=[
                {"op": op, "site": {"file": f, "line": line}, "count": n}
                for (op, f, line), n in state.per_site.items()
            ],
        )


def _wait_for_peers(probe: Probe, state: _State) -> None:
    """Each finished rank counts itself in the default store and waits for the others, so that a peer stuck in a
    collective is seen as a hang (the launcher's timeout dumps its stack) instead of failing on a closed
    connection. Rank 0 may host the store (env:// under mp.spawn): it leaves last."""
    store, world = state.store, probe.world_size
    if store is None or not world or world < 2:
        return
    t0 = time.monotonic()
    deadline = t0 + max(probe.settings.timeout, 1.0)
    store.add("ddpdoctor/done", 1)
    complete = False
    while time.monotonic() < deadline:
        if store.add("ddpdoctor/done", 0) >= world:
            complete = True
            break
        time.sleep(0.02)
    store.add("ddpdoctor/left", 1)
    if probe.rank == 0 and complete:
        end = time.monotonic() + 5.0
        while time.monotonic() < end and store.add("ddpdoctor/left", 0) < world:
            time.sleep(0.01)
    probe.emit("peers_wait", world=world, seconds=round(time.monotonic() - t0, 3), complete=complete)
