"""Print what a rule reads: the static events of a script and the probe events of a recorded run (ruff's
`print-ast` for ddpdoctor).

    python -m ddpdoctor.dev.show_events train.py --rule DD301              # the static events DD301 reads
    python -m ddpdoctor.dev.show_events train.py --rule DD301 --run RUN    # and the probe events of a run
    python -m ddpdoctor.dev.show_events train.py --all                     # every static event of the script

A rule reads the event kinds its `static.py` / `probe.py` name (string constants that are documented kinds:
`ddpdoctor/static/events.py` STATIC_EVENT_KINDS, `ddpdoctor/events.py` EVENT_KINDS); helpers it calls may read
more, `--all` shows everything. A run to read comes from `ddpdoctor check SCRIPT --keep-run RUN` (or any recorded
run in fixtures/runs/). Static events print in execution order, one a line: file:line, kind, the function it is in,
its context (loop, cond, rank, grad; "unreached" where the walk found it dead), then its data; probe events per
process, in order: rank, kind, fields.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path
from typing import Any, Iterable

from ddpdoctor.errors import UsageError

WIDTH = 160  # a value's text is cut at this many characters


def kinds_read(code: str, hook: str) -> list[str]:
    """The documented event kinds the rule's `hook` ("static" or "probe") names, in the order it names them."""
    from ddpdoctor.rules import get_rule

    try:
        rule = get_rule(code)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    if not getattr(rule, hook):
        return []
    if hook == "static":
        from ddpdoctor.static.events import STATIC_EVENT_KINDS as known
    else:
        from ddpdoctor.events import EVENT_KINDS as known
    spec = importlib.util.find_spec(f"{rule.package}.{hook}")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))  # type: ignore[union-attr, arg-type]
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            if node.value not in out:
                out.append(node.value)
    return out


def _short(value: Any) -> str:
    if isinstance(value, ast.AST):
        return f"<{type(value).__name__} L{getattr(value, 'lineno', '?')}>"
    text = repr(value)
    return text if len(text) <= WIDTH else text[: WIDTH - 3] + "..."


def static_lines(script: Path, kinds: Iterable[str] | None) -> list[str]:
    """One line per static event of `script` (and the project modules it imports) of `kinds` (None: all)."""
    from ddpdoctor.static import build_project_model

    model = build_project_model(script)
    wanted = None if kinds is None else set(kinds)
    lines = []
    for ev in model.events:
        if wanted is not None and ev.kind not in wanted:
            continue
        where = f"{Path(ev.file or model.filename).name}:{ev.line}"
        ctx = ",".join(c.kind for c in ev.ctx) or "-"
        reached = "" if ev.reached else " unreached"
        data = " ".join(f"{k}={_short(v)}" for k, v in ev.data.items())
        lines.append(f"{where:<24} {ev.kind:<18} in {ev.func or '<module>'} [{ctx}]{reached}  {data}".rstrip())
    return lines


def probe_lines(run: Path, kinds: Iterable[str] | None) -> list[str]:
    """One line per recorded event of `kinds` (None: all) in the run directory, process by process."""
    from ddpdoctor.rundata import read_run

    data = read_run(run)
    wanted = None if kinds is None else set(kinds)
    lines = []
    for p in data.processes:
        who = f"rank {p.rank}" if p.rank is not None else p.role
        for e in p.events:
            if wanted is not None and e.get("kind") not in wanted:
                continue
            fields = " ".join(f"{k}={_short(v)}" for k, v in e.items() if k not in ("kind", "t"))
            lines.append(f"{who:<10} {e.get('kind'):<20} {fields}".rstrip())
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpdoctor.dev.show_events",
        description="Print the static events of a script and the probe events of a run that a rule reads.",
        epilog=__doc__.split("\n\n", 2)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("script", type=Path, help="the training script")
    parser.add_argument("--rule", help="a rule code: only the event kinds it reads")
    parser.add_argument("--run", type=Path, help="a recorded run directory (check --keep-run DIR): its probe events")
    parser.add_argument("--all", action="store_true", help="every event kind, not only the rule's")
    ns = parser.parse_args(argv)
    try:
        if not ns.script.is_file():
            raise UsageError(f"{ns.script}: no such file")
        if ns.rule is None and not ns.all:
            raise UsageError("name a rule (--rule DD301) or ask for --all")
        if ns.run is not None and not ns.run.is_dir():
            raise UsageError(f"{ns.run}: not a run directory")
        static_kinds = None if ns.all else kinds_read(ns.rule, "static")
        probe_kinds = None if ns.all else kinds_read(ns.rule, "probe")
        out = []
        if ns.all or static_kinds:
            out.append(f"# static events{'' if ns.all else ' (' + ', '.join(static_kinds) + ')'}")  # type: ignore[arg-type]
            out += static_lines(ns.script, static_kinds) or ["(none)"]
        if ns.run is not None and (ns.all or probe_kinds):
            out.append(f"# probe events{'' if ns.all else ' (' + ', '.join(probe_kinds) + ')'}")  # type: ignore[arg-type]
            out += probe_lines(ns.run, probe_kinds) or ["(none)"]
        elif probe_kinds and ns.run is None:
            out.append(f"# probe events ({', '.join(probe_kinds)}): give --run DIR (ddpdoctor check SCRIPT "
                       "--keep-run DIR)")
    except UsageError as exc:
        sys.stderr.write(f"show_events: error: {exc}\n")
        return 2
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
