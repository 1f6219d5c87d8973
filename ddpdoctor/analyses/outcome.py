"""How each process of a run ended: finished, failed (and whether because of a peer), stuck, or killed.

Shared by DD901/DD902/DD903 and the report's rank table. Follows elastic's "root cause (first observed
failure)" idea: a rank that fails only because a peer went away (connection closed, SIGTERM from the agent) is
a consequence, not the cause.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, field
from typing import Any

from ddpdoctor.analyses.context import PEER_ERROR_MARKERS, RunContext
from ddpdoctor.records import LaunchMode
from ddpdoctor.rundata import ProcessLog, parse_stack_dump, read_text_bounded

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPAWN_EXIT = re.compile(r"process (\d+) terminated with (?:exit code (-?\d+)|signal (\w+))")


@dataclass
class Failure:
    rank: int | None
    pid: int | None
    t: float
    kind: str  # exception | signal | exit
    type: str | None = None
    message: str = ""
    traceback: str = ""
    user_frame: dict[str, Any] | None = None
    exitcode: int | None = None
    signal: str | None = None
    peer_caused: bool = False
    derived: bool = False  # the main process of a self-spawning script reporting a child's failure
    stderr_tail: list[str] = field(default_factory=list)

    @property
    def signature(self) -> tuple:
        return (self.kind, self.type, self.message.splitlines()[0] if self.message else "", self.signal, self.exitcode)


_TB_FRAME = re.compile(r'^  File "(?P<file>[^"]*)", line \d+, in ')


def without_probe_frames(text: str) -> str:
    """A recorded traceback as `python train.py` prints it: ddpdoctor's frames (recorded by runs from before the
    probe left them out) and the runpy frames that start the script removed; every other line kept."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    leading = True  # still in the frames above the script's own (the bootstrap, runpy)
    while i < len(lines):
        m = _TB_FRAME.match(lines[i])
        if m is None:
            if not lines[i].startswith("  "):
                leading = True  # a new traceback of a chained exception starts
            out.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].startswith("    "):  # the source line and carets of this frame
            j += 1
        norm = os.path.normpath(m.group("file"))
        ours = _is_ddpdoctor_file(norm) or (leading and norm in ("<frozen runpy>", "runpy.py") or (
            leading and os.path.basename(norm) == "runpy.py"))
        if not ours:
            leading = False
            out.extend(lines[i:j])
        i = j
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _peer_caused(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in PEER_ERROR_MARKERS)


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def crash_text(lines: list[str]) -> str:
    """The most telling line of a crashed rank's stderr (gloo/NCCL/C++ aborts print no Python exception)."""
    for pattern in ("what():", "Error", "error", "Fatal Python error", "Segmentation fault", "terminate called"):
        for line in reversed(lines):
            if pattern in line:
                return line.strip()[:400]
    return lines[-1].strip()[:400] if lines else ""


def crash_frame(ctx: RunContext, rank: int | None) -> dict[str, Any] | None:
    """The user's frame in the Python stack a crashing rank printed (PYTHONFAULTHANDLER) to its stderr."""
    path = ctx.run.output_file(rank, "stderr")
    if path is None:
        return None
    try:
        dumps = parse_stack_dump(read_text_bounded(path))
    except OSError:
        return None
    for thread in reversed(dumps[-1] if dumps else []):
        user = next((f for f in thread["frames"] if is_user_path(ctx, f["file"])), None)
        if user is not None:
            return user
    return None


def failures(ctx: RunContext) -> list[Failure]:
    """Every failure seen in the run, root causes and consequences alike, in time order."""
    out: list[Failure] = []
    seen_ranks: set[int] = set()
    rank_of = {id(p): r for r, p in ctx.ranks.items()}
    for p in ctx.run.processes:
        if p.done is not None:
            continue
        rank = rank_of.get(id(p), p.rank)
        for e in p.of("exception"):
            tail = (
                ctx.run.output_tail(rank, "stderr", 30) if rank is not None
                else ctx.run.output_tail(None, "stderr", 30)
            )
            f = Failure(
                rank=rank,
                pid=p.pid,
                t=float(e.get("t", 0.0)),
                kind="exception",
                type=e.get("type"),
                message=str(e.get("message") or ""),
                traceback=without_probe_frames(str(e.get("traceback") or "")),
                user_frame=e.get("user_frame"),
                exitcode=e.get("exit_code") if e.get("type") == "SystemExit" else None,
                peer_caused=_peer_caused(str(e.get("message") or "")),
                derived=p.role == "main" and rank is None,
                stderr_tail=tail,
            )
            out.append(f)
            if rank is not None:
                seen_ranks.add(rank)
            break
    if not ctx.timed_out:
        agent = ctx.launcher.get("agent") or {}
        for item in agent.get("failures") or ():
            rank = item.get("rank")
            p = ctx.ranks.get(rank)
            if rank in seen_ranks or (p is not None and p.done is not None):
                continue
            exitcode = item.get("exitcode")
            sig = item.get("signal") or _signal_name(exitcode)
            tail = ctx.run.output_tail(rank, "stderr", 30)
            text = crash_text(tail)
            out.append(
                Failure(
                    rank=rank,
                    pid=item.get("pid"),
                    t=float(item.get("timestamp") or (p.events[-1]["t"] if p and p.events else 0.0)),
                    kind="signal" if sig else "exit",
                    message=text,
                    exitcode=exitcode,
                    signal=sig,
                    peer_caused=sig in ("SIGTERM", "SIGKILL", "SIGINT") or _peer_caused(text),
                    user_frame=crash_frame(ctx, rank),
                    stderr_tail=tail,
                )
            )
            seen_ranks.add(rank)
        # self-spawning scripts: mp.spawn tells which child died and how
        for p in ctx.run.processes:
            if p.role != "main":
                continue
            for e in p.of("exception"):
                for m in _SPAWN_EXIT.finditer(str(e.get("message") or "")):
                    index = int(m.group(1))
                    child = ctx.ranks.get(index)
                    if index in seen_ranks or (child is not None and child.done is not None):
                        continue
                    code = int(m.group(2)) if m.group(2) else None
                    tail = ctx.run.output_tail(None, "stderr", 30)
                    out.append(
                        Failure(
                            rank=index,
                            pid=child.pid if child else None,
                            t=float(child.events[-1]["t"]) if child and child.events else float(e.get("t", 0.0)),
                            kind="signal" if m.group(3) else "exit",
                            message=crash_text(tail),
                            exitcode=code,
                            signal=m.group(3),
                            peer_caused=m.group(3) in ("SIGTERM", "SIGKILL", "SIGINT"),
                            stderr_tail=tail,
                        )
                    )
                    seen_ranks.add(index)
    launcher = launcher_failure(ctx)
    if launcher is not None and not any(f.rank == launcher.rank and launcher.rank is not None for f in out):
        out.append(launcher)
    out.sort(key=lambda f: f.t)
    return out


LAUNCHERS = {LaunchMode.TORCHRUN: "torch.distributed.run's agent (the launcher of the ranks)",
             LaunchMode.SPAWN: "the script's main process (which starts its ranks)",
             LaunchMode.SINGLE: "the script's process"}


def launcher_failure(ctx: RunContext) -> Failure | None:
    """The process the probe launched (the elastic agent, or the main process of a self-spawning script) died of
    a signal, or exited with an error of its own, before the ranks finished: the run is cut short whatever the
    ranks recorded (killed by the OOM killer, by the script, by another user). Not when the probe stopped it
    itself (timeout, Ctrl-C, ranks already done)."""
    launcher = ctx.launcher
    code = launcher.get("returncode")
    mode = launcher.mode or ctx.run.meta.mode
    if code in (None, 0) or mode not in LAUNCHERS or launcher.stopped_by_probe or launcher.end.stopped:
        return None
    if ctx.ranks and all(p.done is not None for p in ctx.ranks.values()):
        return None  # every rank had finished its part: the measurement is complete
    agent = launcher.get("agent") or {}
    sig = _signal_name(code)
    if sig is None and mode is LaunchMode.TORCHRUN and agent and (agent.get("failures") or not agent.get("error")):
        return None  # the agent reports its ranks' failure (each one is a failure above)
    if mode.starts_once:
        main = ctx.run.main_process if mode is LaunchMode.SPAWN else ctx.ranks.get(0)
        if main is not None and main.of("exception"):
            return None  # the process raised: that exception is the failure
    last = max((p.events[-1]["t"] for p in ctx.run.processes if p.events), default=0.0)
    error = str(agent.get("error") or "")
    if mode is LaunchMode.SINGLE:  # the one process is rank 0: it died as a rank does
        return Failure(rank=0, pid=ctx.ranks[0].pid if 0 in ctx.ranks else None, t=float(last),
                       kind="signal" if sig else "exit", message=crash_text(_launcher_tail(ctx, mode)),
                       exitcode=code, signal=sig, user_frame=crash_frame(ctx, None),
                       stderr_tail=_launcher_tail(ctx, mode))
    return Failure(
        rank=None,
        pid=(launcher.get("agent") or {}).get("pid"),
        t=float(last),
        kind="launcher",
        type=mode,
        message=error or (f"died with {sig}" if sig else f"exited with code {code}"),
        exitcode=code if code >= 0 else None,
        signal=sig,
        stderr_tail=_launcher_tail(ctx, mode),
    )


def _launcher_tail(ctx: RunContext, mode: LaunchMode) -> list[str]:
    path = ctx.run.path / "logs" / ("agent.stderr" if mode is LaunchMode.TORCHRUN else "main.stderr")
    try:
        return read_text_bounded(path).splitlines()[-30:]
    except OSError:
        return []


def root_causes(fails: list[Failure]) -> list[Failure]:
    """The first failure that is neither a peer's consequence nor the parent relaying a child's failure, plus
    the other ranks that failed the same way (a bug every rank hits)."""
    primary = [f for f in fails if not f.derived and not f.peer_caused]
    if not primary:
        primary = [f for f in fails if not f.derived] or list(fails)
    if not primary:
        return []
    first = primary[0]
    return [f for f in primary if f.signature == first.signature]


# ---------------------------------------------------------------------------------------------- hangs


@dataclass
class StackView:
    frames: list[dict[str, Any]]  # innermost first
    user_frame: dict[str, Any] | None
    blocked_in: dict[str, Any] | None  # innermost frame overall


def _is_ddpdoctor_file(norm: str) -> bool:
    """A frame in ddpdoctor's own code, also when the run was recorded from another checkout (a replayed run
    directory names the recording machine's paths): `.../ddpdoctor/<rest>` where this package has `<rest>`."""
    if norm.startswith(_PACKAGE_DIR + os.sep):
        return True
    marker = os.sep + "ddpdoctor" + os.sep
    cut = norm.rfind(marker)
    while cut != -1:
        rest = norm[cut + len(marker) :]
        if rest and os.path.isfile(os.path.join(_PACKAGE_DIR, rest)):
            return True
        cut = norm.rfind(marker, 0, cut)
    return False


def is_user_path(ctx: RunContext, file: str) -> bool:
    if not file or file.startswith("<"):
        return False
    norm = os.path.normpath(file)
    if ctx.script_abs and norm == os.path.normpath(ctx.script_abs):
        return True
    if "site-packages" in norm or "dist-packages" in norm or _is_ddpdoctor_file(norm):
        return False
    if "/lib/python" in norm:
        return False
    try:
        rel = os.path.relpath(norm, ctx.base_dir)
    except ValueError:
        return False
    return not rel.startswith("..")


def main_stack(ctx: RunContext, p: ProcessLog) -> StackView | None:
    """The main thread's stack of the process's last dump (innermost first)."""
    if not p.stack_text:
        return None
    dumps = parse_stack_dump(p.stack_text)
    if not dumps:
        return None
    threads = dumps[-1]
    main = str(p.start.get("main_thread") or "").lower()
    chosen = next((t for t in threads if t["thread"] == main), None)
    if chosen is None:
        chosen = next((t for t in threads if any(is_user_path(ctx, f["file"]) for f in t["frames"])), threads[0])
    frames = chosen["frames"]
    user = next((f for f in frames if is_user_path(ctx, f["file"])), None)
    return StackView(frames=frames, user_frame=user, blocked_in=frames[0] if frames else None)


# ---------------------------------------------------------------------------------------------- timeouts
#
# A timeout is a hang only if ranks stopped making progress. A slow run (a big model on a CPU: a step every
# 10 s) that runs out of time is still emitting events shortly before the timeout; a stalled rank has been silent
# for much longer than its own pace, and its stack shows it waiting for the other ranks.

# A rank that had not finished had stalled when it was silent for longer than all of: MIN_ALLOWANCE (or
# MIN_ALLOWANCE_SHARE of a shorter timeout: a 15 s probe of a hang sees ~10 s of silence), PACE_FACTOR typical
# steps, and PAUSE_FACTOR times the longest pause it already made after its first step (an evaluation pass) —
# and its stack shows it waiting for the other ranks (else it was busy: slow, or looping, but not blocked).
MIN_ALLOWANCE = 5.0
MIN_ALLOWANCE_SHARE = 0.2
PACE_FACTOR = 3.0
PAUSE_FACTOR = 1.5

_C10D_DIR = "torch/distributed/"
# torch.distributed functions a rank waits in while the process group is being formed
_RENDEZVOUS = {
    "init_process_group", "rendezvous", "_store_based_barrier", "_env_rendezvous_handler",
    "_tcp_rendezvous_handler", "_file_rendezvous_handler", "_create_c10d_store", "_new_process_group_helper",
}
_POINT_TO_POINT = {"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list"}
_DDP_FILE = "torch/nn/parallel/distributed.py"
# DDP's own calls that wait for the other ranks (buffer broadcast, parameter checks at construction)
_DDP_WAITS = {
    "_sync_buffers", "_sync_module_buffers", "_default_broadcast_coalesced", "_distributed_broadcast_coalesced",
    "_sync_params_and_buffers", "_verify_param_shape_across_processes", "_check_sync_bufs_pre_fwd",
    "_match_all_reduce_for_bwd_pass", "_match_unused_params_allreduce", "_check_global_requires_backward_grad_sync",
}


@dataclass
class RankAtTimeout:
    rank: int
    pid: int
    # finished | running (events within its allowance) | waiting (silent longer, blocked in a call that waits
    # for the other ranks) | busy (silent longer, computing or waiting on something else) | silent (no stack)
    state: str
    silent: float  # seconds from its last event to the timeout
    allowance: float  # silence that still counts as progress for this rank
    steps: int
    last_event: dict[str, Any]
    last_step_t: float | None
    view: StackView | None
    waiting_in: dict[str, Any] | None  # {kind, function, what} of the call that waits for the other ranks

    @property
    def stalled(self) -> bool:
        return self.state in ("waiting", "silent")


@dataclass
class TimeoutView:
    at: float  # when the timeout hit (seconds since the epoch)
    timeout: float
    launched: float | None  # when the (last) launch started
    startup_offset: float  # seconds of the timeout spent before `launched` (a first launch that was relaunched)
    pace: float | None  # seconds per optimizer step (median over ranks), or None before two steps
    ranks: dict[int, RankAtTimeout]

    def having(self, *states: str) -> list[RankAtTimeout]:
        return [r for r in self.ranks.values() if r.state in states]

    @property
    def stalled(self) -> list[RankAtTimeout]:
        return [r for r in self.ranks.values() if r.stalled]

    @property
    def out_of_time(self) -> bool:
        """The probe ran out of time while no rank had stalled: a slow run, not a hang."""
        return not self.stalled and any(r.state != "finished" for r in self.ranks.values())


def waiting_in(ctx: RunContext, frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the innermost frame of a stack (where the thread sits, in the C call it made) waits for, when that is
    the other ranks: a torch.distributed call (collective, point-to-point, barrier, rendezvous), DDP's buffer
    broadcast, or — when the run uses DDP — a backward (its gradient all-reduce runs inside). None: computing, or
    waiting on something else (data, I/O, a lock)."""
    if not frames:
        return None
    for outer in frames:  # anywhere on the stack: the wait itself is a store get/wait or a socket call
        outer_path, outer_fn = str(outer["file"]).replace(os.sep, "/"), str(outer["function"])
        if _C10D_DIR in outer_path and outer_fn in _RENDEZVOUS:
            return {"kind": "rendezvous", "function": outer_fn,
                    "what": f"the rendezvous ({outer_fn}): not every rank joined the process group"}
    f = frames[0]
    path, fn = str(f["file"]).replace(os.sep, "/"), str(f["function"])
    if _C10D_DIR in path and fn in _POINT_TO_POINT:
        return {"kind": "point_to_point", "function": fn, "what": f"dist.{fn}"}
    if _C10D_DIR in path or path.endswith("ddpdoctor/bn/syncbn.py"):
        return {"kind": "collective", "function": fn, "what": f"dist.{fn}"}
    if path.endswith(_DDP_FILE) and fn in _DDP_WAITS:
        return {"kind": "ddp_sync", "function": fn, "what": f"DDP's synchronisation with the other ranks ({fn})"}
    if "torch/autograd/" in path and _uses_ddp(ctx):
        return {"kind": "backward", "function": fn, "what": "backward (DDP's gradient all-reduce)"}
    return None


def _uses_ddp(ctx: RunContext) -> bool:
    return any(e.get("ok") for _, e in ctx.run.events("ddp_init"))


def _timeout_moment(ctx: RunContext) -> tuple[float, float | None, float]:
    """(when the timeout hit, when the last launch started, seconds of the timeout spent before it)."""
    launcher = ctx.launcher
    last = max((p.events[-1]["t"] for p in ctx.run.processes if p.events), default=0.0)
    ended = float(launcher.get("ended") or last)
    started = launcher.get("started")
    before = float((launcher.get("first_launch") or {}).get("wall_seconds") or 0.0)
    timeout = launcher.get("timeout") or ctx.run.meta.timeout
    if started is None or not timeout:
        return ended, None, before
    return min(ended, float(started) + float(timeout) - before), float(started), before


def _pace(ctx: RunContext) -> float | None:
    gaps: list[float] = []
    firsts: list[float] = []
    for p in ctx.ranks.values():
        times = [float(e["t"]) for e in p.of("optimizer_step")]
        gaps += [b - a for a, b in zip(times, times[1:])]
        if times:
            ready = p.first("torch_ready") or p.first("script_start") or p.start
            if ready.get("t") is not None:
                firsts.append(times[0] - float(ready["t"]))  # one step with its set-up: an upper bound
    if gaps:
        gaps.sort()
        mid = len(gaps) // 2
        return gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2
    return max(firsts) if firsts else None


def timeout_view(ctx: RunContext) -> TimeoutView | None:
    """How each rank stood when the probe's timeout hit; None when the run did not time out."""
    if not ctx.timed_out:
        return None
    if "timeout_view" in ctx.memo:
        return ctx.memo["timeout_view"]
    at, launched, before = _timeout_moment(ctx)
    timeout = float(ctx.launcher.get("timeout") or ctx.run.meta.timeout or 0.0)
    floor = min(MIN_ALLOWANCE, MIN_ALLOWANCE_SHARE * timeout) if timeout > 0 else MIN_ALLOWANCE
    pace = _pace(ctx)
    ranks: dict[int, RankAtTimeout] = {}
    for rank, p in ctx.ranks.items():
        last = p.events[-1] if p.events else {}
        steps = p.of("optimizer_step")
        last_step_t = float(steps[-1]["t"]) if steps else None
        silent = max(0.0, at - float(last.get("t", at)))
        pause = 0.0
        if steps:
            times = [float(e["t"]) for e in p.events if float(e.get("t", 0.0)) >= float(steps[0]["t"])]
            pause = max((b - a for a, b in zip(times, times[1:])), default=0.0)
        allowance = max(floor, PACE_FACTOR * (pace or 0.0), PAUSE_FACTOR * pause)
        stack = None
        waiting = None
        if p.done is not None:
            state = "finished"
        else:
            stack = main_stack(ctx, p)
            waiting = waiting_in(ctx, stack.frames) if stack is not None else None
            if silent <= allowance:
                state = "running"
            elif stack is None:
                state = "silent"
            elif waiting is not None and (waiting["kind"] != "backward" or pace is not None):
                state = "waiting"
            else:  # a backward before any step was timed may just be slow: computing, as far as we can tell
                state = "busy"
        ranks[rank] = RankAtTimeout(
            rank=rank, pid=p.pid, state=state, silent=round(silent, 3), allowance=round(allowance, 3),
            steps=len(steps), last_event={k: last.get(k) for k in ("kind", "t", "step") if k in last},
            last_step_t=last_step_t, view=stack, waiting_in=waiting,
        )
    _peers_still_starting(ctx, ranks)
    result = TimeoutView(at=at, timeout=timeout, launched=launched, startup_offset=before, pace=pace, ranks=ranks)
    ctx.memo["timeout_view"] = result
    return result


def _peers_still_starting(ctx: RunContext, ranks: dict[int, RankAtTimeout]) -> None:
    """A rank waiting in the rendezvous for a peer that has not reached it yet — a peer still starting (no event
    of its own, or still importing and setting up) — is not stalled: the run was slow to start (a loaded machine
    starts torch in minutes), not hung. A rendezvous hang is every expected rank in it, and it never completing."""
    waiting = [r for r in ranks.values() if r.stalled and _in_rendezvous(ctx, r)]
    if not waiting:
        return
    expected = int(ctx.run.meta.get("nproc") or 0) if ctx.run.meta.mode is LaunchMode.TORCHRUN else 0
    starting = [r for r in ranks.values() if r.state in ("running", "busy")
                and not ctx.ranks[r.rank].of("pg_init_begin") and not ctx.ranks[r.rank].of("pg_init")]
    if not starting and len(ranks) >= expected:
        return
    for r in waiting:
        r.state = "running"


def _in_rendezvous(ctx: RunContext, r: RankAtTimeout) -> bool:
    if r.waiting_in is not None:
        return r.waiting_in.get("kind") == "rendezvous"
    p = ctx.ranks[r.rank]
    return bool(p.of("pg_init_begin")) and not p.of("pg_init")


PROBE_LIMIT_REASONS = ("epochs observed", "steps observed")


def ended_by_probe_limit(ctx: RunContext, ranks: list[int]) -> bool:
    """Did every one of these ranks finish because the probe's --epochs/--steps limit ended it, not because the
    script returned? Such a rank stops where the probe cut it (at its next epoch or step); in the script's own run
    it goes on, and its next collective may pair with the one a peer still waits in: a peer blocked after the cut
    (a rank-0-only evaluation forward through DDP, whose buffer broadcast pairs with the others' next training
    forward) shows as a stall that the script itself never has."""
    if not ranks:
        return False
    for r in ranks:
        p = ctx.ranks.get(r)
        if p is None or p.done is None or p.done.get("reason") not in PROBE_LIMIT_REASONS:
            return False
    return True
