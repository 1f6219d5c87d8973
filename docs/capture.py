"""Regenerate the terminal pictures the README shows: `make docs`.

Each picture is the real output of a real command, run as a user runs it: in a pseudo-terminal (so ddpdoctor sees
a colour terminal, exactly as at a prompt) of WIDTH columns, its ANSI output turned into SVG with rich's own
export (`Console.save_svg`). Nothing is edited by hand; a picture that looks wrong is a bug in the tool.

    .venv/bin/python docs/capture.py            # all pictures
    .venv/bin/python docs/capture.py check      # only those whose name contains "check"
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
WIDTH = 100

# name → (title shown in the picture's window bar, command after `ddpdoctor`, which stream to show)
PICTURES: dict[str, tuple[str, list[str], str]] = {
    "demo-check": (
        "ddpdoctor check fixtures/demo/train.py --base-lr 0.1 --base-batch 32",
        ["check", "fixtures/demo/train.py", "--base-lr", "0.1", "--base-batch", "32"],
        "stdout",
    ),
    "compare-bn": ("ddpdoctor compare-bn --shard sorted", ["compare-bn", "--shard", "sorted"], "stdout"),
}


def run_in_terminal(args: list[str], stream: str = "stdout", timeout: float = 600.0) -> str:
    """Run `ddpdoctor ARGS` with `stream` on a pseudo-terminal of WIDTH columns; return what it printed there."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}
    env.update(COLUMNS=str(WIDTH), LINES="50", TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    streams = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    streams[stream] = slave
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpdoctor", *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL, **streams
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            raise SystemExit(f"ddpdoctor {' '.join(args)}: no end within {timeout:.0f} s")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return b"".join(chunks).decode("utf-8", errors="replace").replace("\r\n", "\n")


def save_svg(name: str, title: str, ansi: str) -> Path:
    path = DOCS / f"{name}.svg"
    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=WIDTH, file=sink, force_terminal=True, color_system="truecolor")
        console.print(Text.from_ansi(ansi.rstrip("\n")), soft_wrap=True)
        # a fixed id keeps a regenerated picture byte-identical when the output did not change
        console.save_svg(str(path), title=title, unique_id=f"ddpdoctor-{name}")
    return path


def main(argv: list[str]) -> int:
    wanted = [name for name in PICTURES if not argv or any(a in name for a in argv)]
    for name in wanted:
        title, args, stream = PICTURES[name]
        t0 = time.perf_counter()
        ansi = run_in_terminal(args, stream)
        path = save_svg(name, title, ansi)
        print(f"{path.relative_to(REPO)}: {len(ansi.splitlines())} lines, {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
