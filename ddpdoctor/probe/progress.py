"""What the ranks are doing while the probe runs, on stderr: the terminal no longer stays blank until the report.

The display reads the run directory's event logs as the ranks append to them (each `events/*.jsonl` is tailed
from where it was last read; a line is used once it is complete), so it needs nothing from the ranks but what
they record anyway, and it never slows them down. The launcher calls `update()` from its wait loop and `close()`
when the launch is over.

- On a terminal: a live table, one row per rank — launched, importing torch, rendezvous, epoch e/E and step s/S
  of the planned E × S, finished or failed — with each rank's elapsed time, redrawn a few times a second (rich's
  Live, transient: it disappears when the probe ends and leaves one summary line).
- Elsewhere (CI logs, a pipe): a few plain lines — the start, all ranks in the process group, each epoch that
  every rank has finished, a failing rank at once, a "still running" line when nothing was said for a while, and
  the end.
- Either way, a stall — no event from any rank for `stall_after(timeout)` seconds while a rank is alive past its
  torch import — is said as a suspected hang, with where each rank is, long before the timeout ends the run.
- `--quiet`: nothing (the caller does not create a display).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from ddpdoctor.events import EVENTS_DIR

REFRESH_S = 0.2  # terminal redraws at most this often
HEARTBEAT_S = 30.0  # plain mode: a "still running" line after this long without one
STALL_MIN_S, STALL_MAX_S = 10.0, 30.0  # a suspected hang: no rank event for a quarter of the timeout, within these


def stall_after(timeout: float | None) -> float:
    """Seconds without any rank event after which the display calls it a suspected hang: a quarter of the timeout,
    at least STALL_MIN_S (a slow step is not a hang) and at most STALL_MAX_S (said well before the timeout)."""
    if not timeout:
        return STALL_MAX_S
    return min(STALL_MAX_S, max(STALL_MIN_S, timeout / 4))

# phase → what the table says (in the order a rank goes through them)
PHASES = {
    "launched": "launched",
    "torch": "importing torch",
    "ready": "starting",
    "rendezvous": "rendezvous",
    "joined": "in process group",
    "training": "training",
    "finished": "finished",
    "failed": "failed",
}


@dataclass
class RankProgress:
    """One process of the run as far as its events tell."""

    pid: int
    rank: int | None = None
    role: str = "rank"
    phase: str = "launched"
    started: float | None = None  # its process_start time (seconds since the epoch)
    last: float | None = None  # time of its latest event
    ended: float | None = None  # time of done / exception
    steps: int = 0
    epoch: int = 0  # 0-based epoch of its latest optimizer step
    steps_in_epoch: dict[int, int] = field(default_factory=dict)
    error: str | None = None

    def apply(self, e: dict[str, Any]) -> None:
        kind = e.get("kind")
        t = e.get("t")
        if isinstance(t, (int, float)):
            self.last = float(t)
        if e.get("rank") is not None and self.rank is None:
            self.rank = int(e["rank"])
        if kind == "process_start":
            self.started = self.last
            self.role = str(e.get("role") or "rank")
            env = e.get("env") or {}
            if self.rank is None and self.role in ("rank", "attached") and str(env.get("RANK", "")).isdigit():
                self.rank = int(env["RANK"])
            self.phase = "torch" if self.phase == "launched" else self.phase
        elif kind == "torch_ready" and self.phase in ("launched", "torch"):
            self.phase = "ready"
        elif kind == "pg_init_begin" and self.phase in ("launched", "torch", "ready"):
            self.phase = "rendezvous"
        elif kind == "pg_init":
            if e.get("ok"):
                self.rank = int(e["rank"]) if e.get("rank") is not None else self.rank
                if self.phase not in ("training", "finished", "failed"):
                    self.phase = "joined"
        elif kind == "optimizer_step":
            self.steps = int(e.get("step") or self.steps + 1)
            self.epoch = int(e.get("epoch") or 0)
            self.steps_in_epoch[self.epoch] = self.steps_in_epoch.get(self.epoch, 0) + 1
            if self.phase not in ("finished", "failed"):
                self.phase = "training"
        elif kind == "done":
            self.phase, self.ended = "finished", self.last
        elif kind == "exception" and self.phase != "finished":
            what = f"{e.get('type') or 'exception'}: {e.get('message') or ''}".strip().rstrip(":")
            self.error = what.splitlines()[0][:160] if what else None
            self.phase, self.ended = "failed", self.last

    @property
    def is_rank(self) -> bool:
        return self.role in ("rank", "attached") or self.rank is not None


class EventTail:
    """Incremental reader of a run directory's event logs: new complete lines since the last call."""

    def __init__(self, run_dir: Path) -> None:
        self.events_dir = Path(run_dir) / EVENTS_DIR
        self.offsets: dict[str, int] = {}

    def reset(self) -> None:
        self.offsets.clear()

    def read(self) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        try:
            logs = sorted(p for p in os.listdir(self.events_dir) if p.endswith(".jsonl"))
        except OSError:
            return out
        for name in logs:
            start = self.offsets.get(name, 0)
            try:
                with open(self.events_dir / name, "rb") as fh:
                    fh.seek(start)
                    chunk = fh.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n")
            if end < 0:
                continue  # no complete line yet
            self.offsets[name] = start + end + 1
            for line in chunk[: end + 1].splitlines():
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    out.append((name, event))
        return out


class RunProgress:
    """Every process of the run, from its events."""

    def __init__(self, run_dir: Path) -> None:
        self.tail = EventTail(run_dir)
        self.procs: dict[str, RankProgress] = {}
        self.events = 0  # events read so far (a stall is none new for a while)

    def reset(self) -> None:
        """The launch was started again (a single launch relaunched under torchrun): forget the first one."""
        self.tail.reset()
        self.procs.clear()

    def poll(self) -> list[tuple[RankProgress, str | None, str]]:
        """Read what is new; returns (process, phase before, phase now) for every process whose phase changed."""
        changes = []
        for name, event in self.tail.read():
            self.events += 1
            proc = self.procs.get(name)
            if proc is None:
                proc = self.procs[name] = RankProgress(pid=int(event.get("pid") or 0))
                before = None
            else:
                before = proc.phase
            try:
                proc.apply(event)
            except (TypeError, ValueError, AttributeError):  # a malformed event: the analysis reports it
                continue
            if proc.phase != before:
                changes.append((proc, before, proc.phase))
        return changes

    @property
    def ranks(self) -> list[RankProgress]:
        """The rank processes, by rank (unknown ranks last), then the others (a self-spawning main process)."""
        ranks = [p for p in self.procs.values() if p.is_rank]
        others = [p for p in self.procs.values() if not p.is_rank]
        ranks.sort(key=lambda p: (p.rank is None, p.rank if p.rank is not None else 0, p.pid))
        return ranks + sorted(others, key=lambda p: p.pid)


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 600 else f"{seconds / 60:.0f} min"



@contextmanager
def showing(progress: ProgressDisplay | None) -> Iterator[None]:
    """Around a probe run that draws `progress` (None: quiet): a Ctrl-C closes the display as interrupted; whatever
    happens the display is discarded at the end (the run closes it when it ends well; when it fails, the error says
    the rest)."""
    try:
        yield
    except KeyboardInterrupt:
        if progress is not None:
            progress.close(interrupted=True)
        raise
    finally:
        if progress is not None:
            progress.discard()


class ProgressDisplay:
    """Progress of one probe run on `stream` (stderr), live on a terminal, a few plain lines elsewhere."""

    def __init__(
        self,
        run_dir: Path,
        *,
        script: str,
        nproc: int,
        epochs: int,
        steps: int,
        timeout: float | None = None,
        stream: IO[str] | None = None,
        terminal: bool | None = None,
        width: int | None = None,
        clock: Callable[[], float] = time.time,
        stall_s: float | None = None,
    ) -> None:
        import sys

        self.stream = stream if stream is not None else sys.stderr
        self.terminal = bool(terminal if terminal is not None else getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.script = script
        self.nproc, self.epochs, self.steps, self.timeout = nproc, epochs, steps, timeout
        self.clock = clock
        self.progress = RunProgress(run_dir)
        self.t0 = clock()
        self._live: Any = None
        self._last_draw = 0.0
        self._last_line = self.t0
        self._joined_said = False
        self._epochs_said = 0
        self._failed_said: set[int] = set()
        self._closed = False
        self.stall_s = stall_s if stall_s is not None else stall_after(timeout)
        self._events_seen = 0
        self._last_event_at = self.t0
        self._stall_said = False
        self._start()

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        if self.terminal:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream, force_terminal=True, width=self.width, highlight=False,
                              markup=False, emoji=False)
            self._live = Live(self._table(), console=console, transient=True, auto_refresh=False,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start(refresh=True)
        else:
            self._say(f"probing {self.script} on {self.nproc} rank{'s' if self.nproc != 1 else ''}"
                      f" ({self._plan()}{f', timeout {self.timeout:.0f} s' if self.timeout else ''})")

    def relaunched(self) -> None:
        """The run was started again under torchrun (ddpdoctor.probe.launch_check): its ranks start over."""
        self.progress.reset()
        self._joined_said = False
        self._epochs_said = 0
        if not self.terminal:
            self._say("the script needs a launcher: relaunched under torchrun")

    def update(self) -> None:
        """Called from the launcher's wait loop: read new events, redraw or print what changed."""
        if self._closed:
            return
        changes = self.progress.poll()
        now = self.clock()
        if self.progress.events != self._events_seen:
            self._events_seen, self._last_event_at, self._stall_said = self.progress.events, now, False
        if self.terminal:
            if changes or now - self._last_draw >= REFRESH_S:
                self._live.update(self._table(), refresh=True)
                self._last_draw = now
            return
        self._plain(changes, now)

    def close(self, *, timed_out: bool = False, interrupted: bool = False, error: str | None = None) -> None:
        """The launch is over: remove the live table (terminal) and say how the probe ended, in one line."""
        if self._closed:
            return
        self.progress.poll()
        self._closed = True
        if self._live is not None:
            self._live.stop()
            self._live = None
        ranks = [p for p in self.progress.ranks if p.is_rank]
        elapsed = _fmt_s(self.clock() - self.t0)
        failed = [p for p in ranks if p.phase == "failed"]
        if not self.terminal:
            for p in failed:
                self._say_failed(p)
        if interrupted:
            self._say(f"probe interrupted after {elapsed}")
        elif error:
            self._say(f"probe could not run: {error} ({elapsed})")
        elif timed_out:
            where = ", ".join(f"rank {p.rank}: {self._state(p)}" for p in ranks if p.phase != "finished")
            self._say(f"probe stopped at the timeout after {elapsed}" + (f" ({where})" if where else ""))
        else:
            # no rank may have recorded anything (a script that shadows a module the probe needs): say so
            steps = sorted({p.steps for p in ranks})
            each = "" if not steps else f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"
            what = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}, {each} optimizer steps each" if ranks else (
                "no rank recorded anything")
            fail = f", {len(failed)} failed" if failed else ""
            self._say(f"probe finished in {elapsed}: {what}{fail}; analysing")

    def discard(self) -> None:
        """Stop without a word (the probe failed to start: its error is reported by the caller)."""
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            self._live.stop()
            self._live = None

    # ------------------------------------------------------------------ text
    def _plan(self) -> str:
        return f"{self.epochs} epochs × {self.steps} steps" if self.epochs and self.steps else "no step limit"

    def _state(self, p: RankProgress) -> str:
        if p.phase == "training":
            e = p.epoch + 1
            s = p.steps_in_epoch.get(p.epoch, 0)
            of_e = f"/{self.epochs}" if self.epochs else ""
            of_s = f"/{self.steps}" if self.steps else ""
            return f"epoch {e}{of_e}, step {s}{of_s}"
        if p.phase == "failed" and p.error:
            return f"failed: {p.error}"
        if p.phase == "finished":
            return f"finished ({p.steps} steps)"
        return PHASES.get(p.phase, p.phase)

    def _elapsed(self, p: RankProgress) -> float:
        if p.started is None:
            return 0.0
        end = p.ended if p.ended is not None else self.clock()
        return max(0.0, end - p.started)

    def _table(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        elapsed = self.clock() - self.t0
        title = Text(f"ddpdoctor: probing {self.script} — {self.nproc} ranks, {self._plan()}, {_fmt_s(elapsed)}",
                     style="bold", overflow="ellipsis", no_wrap=True)
        stall = self._stall(self.clock())
        if stall:
            title = Group(title, Text(stall, style="bold red"))
        table = Table(box=None, pad_edge=False, show_edge=False)
        for name, justify in (("rank", "right"), ("state", "left"), ("epoch", "right"), ("step", "right"),
                              ("elapsed", "right")):
            table.add_column(name, justify=justify)
        procs = self.progress.ranks
        if not procs:
            table.add_row("", Text("launching…", style="dim"), "", "", "")
        styles = {"failed": "bold red", "finished": "green", "training": "cyan"}
        for p in procs:
            who = str(p.rank) if p.rank is not None else (p.role if not p.is_rank else "?")
            if p.phase in ("training", "finished") and p.steps:
                epoch = f"{p.epoch + 1}" + (f"/{self.epochs}" if self.epochs else "")
                step = f"{p.steps_in_epoch.get(p.epoch, 0)}" + (f"/{self.steps}" if self.steps else "")
            else:
                epoch = step = "–"
            state = PHASES.get(p.phase, p.phase)
            if p.phase == "failed" and p.error:
                state = f"failed: {p.error[:60]}"
            table.add_row(who, Text(state, style=styles.get(p.phase, "")), epoch, step, _fmt_s(self._elapsed(p)))
        return Group(title, table)

    def _plain(self, changes: list[tuple[RankProgress, str | None, str]], now: float) -> None:
        ranks = [p for p in self.progress.ranks if p.is_rank]
        for p, _before, phase in changes:
            if phase == "failed" and p.pid not in self._failed_said:
                self._say_failed(p)
        joined = [p for p in ranks if p.phase in ("joined", "training", "finished")]
        if not self._joined_said and len(joined) >= self.nproc:
            self._joined_said = True
            self._say(f"{len(joined)} ranks joined the process group ({_fmt_s(now - self.t0)})")
        if ranks and self.epochs:
            # an epoch is done everywhere when every rank has started a later one or finished
            everyone = len(ranks) >= self.nproc
            done = min(self.epochs if p.phase == "finished" else p.epoch for p in ranks) if everyone else 0
            while self._epochs_said < min(done, self.epochs):
                self._epochs_said += 1
                self._say(f"epoch {self._epochs_said}/{self.epochs} done on every rank ({_fmt_s(now - self.t0)})")
        stall = self._stall(now)
        if now - self._last_line >= HEARTBEAT_S or (stall and not self._stall_said):
            states = "; ".join(f"rank {p.rank}: {self._state(p)}" for p in ranks) or "no rank has started yet"
            self._stall_said = self._stall_said or bool(stall)
            self._say(f"still running after {_fmt_s(now - self.t0)}: {states}" + (f" — {stall}" if stall else ""))

    def _stall(self, now: float) -> str:
        """"no event from any rank for N s: a suspected hang" while a rank that got past importing torch is alive
        and silent for `stall_s`; "" otherwise."""
        quiet = now - self._last_event_at
        alive = [p for p in self.progress.ranks if p.is_rank and p.phase not in ("finished", "failed")]
        if quiet < self.stall_s or not alive or any(p.phase in ("launched", "torch") for p in alive):
            return ""
        return f"no event from any rank for {_fmt_s(quiet)}: a suspected hang"

    def _say_failed(self, p: RankProgress) -> None:
        if p.pid in self._failed_said:
            return
        self._failed_said.add(p.pid)
        who = f"rank {p.rank}" if p.rank is not None else f"process {p.pid}"
        self._say(f"{who} failed: {p.error or 'it raised'} ({_fmt_s(self.clock() - self.t0)})")

    def _say(self, text: str) -> None:
        self._last_line = self.clock()
        try:
            self.stream.write(f"ddpdoctor: {text}\n")
            self.stream.flush()
        except (OSError, ValueError, AttributeError):  # a closed stderr never stops the probe
            pass
