"""compare-bn's progress on stderr: the phase each rank is in (importing torch, building the model, mode M step
s/S, the exact reference), read from the `rank{r}.phase` files the workers write, so that a comparison of a
minute is never a blank terminal.

Live on a terminal (rich's Live, transient: one line stays at the end); a few plain lines elsewhere (the start, each
change of stage, a "still running" line after 30 s of silence, the end). A stall — no rank's phase changes for
`ddpdoctor.probe.progress.stall_after(timeout)` seconds after the ranks imported torch — is said as a suspected hang
with where each rank is, before the timeout. `--quiet`: no display.
"""

from __future__ import annotations

import re
import sys
import time
from typing import IO, Any, Callable, Sequence

from ddpdoctor.probe.progress import HEARTBEAT_S, REFRESH_S, stall_after

_STEP = re.compile(r",? step \d+/\d+$")


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 600 else f"{seconds / 60:.0f} min"


class PhaseDisplay:
    def __init__(self, title: str, *, nproc: int, timeout: float | None, stream: IO[str] | None = None,
                 terminal: bool | None = None, width: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = bool(terminal if terminal is not None else getattr(self.stream, "isatty", lambda: False)())
        self.title, self.nproc, self.clock = title, nproc, clock
        self.stall_s = stall_after(timeout)
        self.t0 = clock()
        self.phases: list[str] = ["starting"] * nproc
        self._changed_at = self.t0
        self._stages: tuple[str, ...] = ()
        self._last_line = self.t0
        self._last_draw = 0.0
        self._stall_said = False
        self._closed = False
        self._live: Any = None
        if self.terminal:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream, force_terminal=True, width=width, highlight=False, markup=False,
                              emoji=False)
            self._live = Live(self._render(), console=console, transient=True, auto_refresh=False,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start(refresh=True)
        else:
            self._say(f"{title} (timeout {timeout:.0f} s)" if timeout else title)

    def update(self, phases: Sequence[str]) -> None:
        """The ranks' current phases (called from the wait loop); "" keeps what a rank said last (its phase file
        is being rewritten, or it has said nothing yet)."""
        if self._closed:
            return
        now = self.clock()
        phases = [p or old for p, old in zip(phases, self.phases)]
        if phases != self.phases:
            self.phases, self._changed_at, self._stall_said = phases, now, False
        stall = self.stall(now)
        if self.terminal:
            if now - self._last_draw >= REFRESH_S:
                self._live.update(self._render(), refresh=True)
                self._last_draw = now
            return
        stages = tuple(_STEP.sub("", p) for p in phases)
        if stages != self._stages and set(stages) != {"starting"}:
            self._stages = stages
            self._say(f"{self._where()} ({_fmt_s(now - self.t0)})")
        elif now - self._last_line >= HEARTBEAT_S or (stall and not self._stall_said):
            self._stall_said = self._stall_said or bool(stall)
            self._say(f"still running after {_fmt_s(now - self.t0)}: {self._where()}"
                      + (f" — {stall}" if stall else ""))

    def stall(self, now: float) -> str:
        quiet = now - self._changed_at
        if quiet < self.stall_s or any(p in ("starting", "importing torch", "done") for p in self.phases):
            return ""
        return f"no rank has moved on for {_fmt_s(quiet)}: a suspected hang"

    def close(self, *, ok: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            self._live.stop()
            self._live = None
        if ok:
            self._say(f"ranks finished in {_fmt_s(self.clock() - self.t0)}; analysing")

    def _where(self) -> str:
        return "; ".join(f"rank {r}: {p}" for r, p in enumerate(self.phases))

    def _render(self) -> Any:
        from rich.console import Group
        from rich.text import Text

        now = self.clock()
        lines = [Text(f"ddpdoctor: {self.title}, {_fmt_s(now - self.t0)}", style="bold", no_wrap=True,
                      overflow="ellipsis")]
        lines += [Text(f"  rank {r}: {p}", style="green" if p == "done" else "cyan") for r, p in
                  enumerate(self.phases)]
        stall = self.stall(now)
        if stall:
            lines.append(Text(stall, style="bold red"))
        return Group(*lines)

    def _say(self, text: str) -> None:
        self._last_line = self.clock()
        try:
            self.stream.write(f"ddpdoctor: {text}\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass
