"""What the run did to files, for the report: the writes the probe redirected into the run directory (each with
the path the script asked for), a resume from a checkpoint that was there before the probe, and — from the
launcher's before/after fingerprint — any of the user's files that changed anyway.

Pure: reads `file_write` and `checkpoint_load` events and launcher.json `user_tree`.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.context import RunContext

SHOWN = 6  # paths named in a note
_WHAT = {
    "write": "written",
    "create": "created",
    "modify": "modified",
    "mkdir": "folder created",
    "delete": "deleted",
    "rename": "renamed onto",
}


def redirected_writes(ctx: RunContext) -> list[dict[str, Any]]:
    """One row per path the script changed, in the order first seen: {path, ops, existed, stored}."""
    rows: dict[str, dict[str, Any]] = {}
    events = sorted((e for _, e in ctx.run.events("file_write")), key=lambda e: float(e.get("t", 0.0)))
    for e in events:
        key = str(e.get("abspath") or e.get("path"))
        row = rows.setdefault(
            key,
            {"path": ctx.path(key) or key, "asked": e.get("path"), "ops": [], "existed": bool(e.get("existed")),
             "stored": e.get("stored")},
        )
        if e.get("op") not in row["ops"]:
            row["ops"].append(e.get("op"))
        row["existed"] = row["existed"] or bool(e.get("existed"))
    return list(rows.values())


def resumed_from(ctx: RunContext) -> list[dict[str, Any]]:
    """torch.load calls of a file the user had before the probe (a resume from an earlier run)."""
    seen: dict[str, dict[str, Any]] = {}
    for _, e in ctx.run.events("checkpoint_load"):
        if e.get("users_file"):
            seen.setdefault(str(e.get("abspath") or e.get("path")), e)
    return list(seen.values())


def _names(paths: list[str]) -> str:
    shown = ", ".join(paths[:SHOWN])
    return shown + (f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else "")


def add_file_notes(ctx: RunContext) -> None:
    tree = ctx.launcher.get("user_tree") or {}
    counts = tree.get("counts") or {}
    if any(counts.get(k) for k in ("modified", "deleted", "created")):
        parts = []
        for kind in ("modified", "deleted", "created"):
            if counts.get(kind):
                parts.append(f"{kind} {_names([ctx.path(p) or p for p in tree.get(kind) or ()])}"
                             + (f" ({counts[kind]} in all)" if counts[kind] > len(tree.get(kind) or ()) else ""))
        ctx.notes.insert(
            0,
            "WARNING: files in your folders changed during the probe although it redirects the script's writes "
            "(native code or a program the script ran wrote them directly): " + "; ".join(parts),
        )
    rows = redirected_writes(ctx)
    if rows:
        yours = [r for r in rows if r["existed"]]
        deleted = sum(1 for r in rows if r["ops"][-1] == "delete")
        counts = [f"{len(rows) - deleted} written or changed"] if len(rows) > deleted else []
        if deleted:
            counts.append(f"{deleted} deleted")
        text = (
            f"the script changed {len(rows)} path{'s' if len(rows) != 1 else ''} outside the run directory "
            f"({', '.join(counts)}): the probe did it in the run directory (writes/<absolute path>) and left your "
            f"files as they were: {_names([r['path'] for r in rows])}"
        )
        if yours:
            text += f" (of these you already had {_names([r['path'] for r in yours])}: untouched)"
        if "keep_run" in ctx.run.meta and not ctx.run.meta["keep_run"]:
            text += "; they were removed with the run (keep them with --keep-run DIR)"
        ctx.notes.append(text)
        ctx.tables["files"] = {
            "title": "Files the script wrote (kept in the run directory; yours untouched)",
            "columns": ["path", "what the script did", "you had one", "kept as"],
            "rows": [
                [r["path"], ", ".join(_WHAT.get(op, op) for op in r["ops"]), "yes" if r["existed"] else "no",
                 r["stored"]]
                for r in rows
            ],
        }
    for p in ctx.run.processes:
        cut = (p.done or {}).get("writes_cut") or []
        if cut:
            who = f"rank {p.rank}" if p.rank is not None else f"process {p.pid}"
            ctx.notes.append(
                f"{who} was still writing {_names([ctx.path(c) or c for c in cut])} when the probe had to end it: "
                "the run's copy is incomplete (your files are untouched)"
            )
    for e in resumed_from(ctx):
        counters = e.get("counters") or {}
        state = ", ".join(f"{k}={v}" for k, v in list(counters.items())[:4])
        # training counters in the file say it resumed; a bare state dict is as likely pretrained weights
        what = ("it resumed from an earlier run, so what the probe measured starts from that state" if state else
                "pretrained weights or an earlier run's state, so what the probe measured starts from those weights")
        ctx.notes.append(
            f"the script loaded {ctx.path(e.get('abspath')) or e.get('path')} at {ctx.at(e.get('site'))}, a file "
            f"that was there before the probe{f' ({state})' if state else ''}: {what}"
        )
