"""Regenerate the terminal pictures the README shows: `make docs`.

Each picture is the real output of a real command, run as a user runs it: in a pseudo-terminal (so ddpdoctor sees
a colour terminal, exactly as at a prompt) of WIDTH columns, its ANSI output turned into SVG with rich's own
export (`Console.save_svg`). Nothing is edited by hand; a picture that looks wrong is a bug in the tool.

    .venv/bin/python docs/capture.py            # all pictures
    .venv/bin/python docs/capture.py check      # only those whose name contains "check"

Beside each picture, `docs/<name>.ansi` keeps the captured output it was drawn from. tests/test_docs_pictures.py
holds the two together (the picture is exactly what that output draws) and, in its slow half, the output to what
the command prints today (`comparable`: durations aside), so a picture cannot drift from the tool.
"""

from __future__ import annotations

import os
import pty
import re
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


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_RULE = re.compile(r"[─━═]+")
# the local part of torch's version (`2.13.0+cpu`, `2.11.0+cu130`): the build the pictures were taken with, not the tool
_TORCH_BUILD = re.compile(r"(\d)\+(?:cpu|cu\d+|rocm[\d.]+|xpu)\b")


def comparable(ansi: str) -> list[str]:
    """The captured output as words to compare across runs of the same command: no colour codes, every number
    `#` (the demo's data are not seeded: its measurements, timings and pids differ from run to run), torch's build
    suffix (`+cpu`, `+cu130`) dropped, table rules
    and line breaks aside (a number's width moves columns and wraps). What is left is what drifts when the tool
    changes: the findings, their wording and order, the tables' columns and rows."""
    text = _RULE.sub("─", _NUMBER.sub("#", _TORCH_BUILD.sub(r"\1", _ANSI.sub("", ansi))))
    return text.split()


def svg_text(name: str, title: str, ansi: str) -> str:
    """The picture of `ansi` as SVG (rich's export, with a fixed id: the same output gives the same bytes)."""
    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=WIDTH, file=sink, force_terminal=True, color_system="truecolor")
        console.print(Text.from_ansi(ansi.rstrip("\n")), soft_wrap=True)
        return console.export_svg(title=title, unique_id=f"ddpdoctor-{name}")


def save_svg(name: str, title: str, ansi: str) -> Path:
    (DOCS / f"{name}.ansi").write_text(ansi, encoding="utf-8")
    path = DOCS / f"{name}.svg"
    path.write_text(svg_text(name, title, ansi), encoding="utf-8")
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
