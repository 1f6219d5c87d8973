"""DD502 save-on-every-rank: the same checkpoint file written by several ranks.

What it does: groups every `torch.save` of the run by the file it wrote (absolute path; the same path on one
host is the same file, and on several hosts it is the same file on a shared filesystem) and fires when more than
one rank wrote it: every rank, or local rank 0 of every node (a `local_rank == 0` guard on a multi-node run).
Saves into per-rank paths are left alone (per-rank state such as RNG states is saved that way on purpose). Writes
whose time intervals overlap are counted: those are the ones that can interleave.

In attach mode saves go where the script says, as in a real run, and a note lists the files the run wrote; in a
`check` they were redirected into the run directory, and the report's files table lists them instead.

Measured at each save call site (and the user lines that called into a save helper): files written there by one
rank each clear a static "reached by every rank" suspicion, with the writers and the saves; a node-local guard
("local rank 0 of every node") is only measured on a run with several nodes.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence, key
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd502_save_on_every_rank import CODE

MEASURES = Measures(
    scope="site",
    what="which ranks (and nodes) wrote each checkpoint file, per torch.save call site",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the ranks measured writing the same checkpoint path",
    measure=key("writers"), floor=1)


def _measure_sites(ctx: RunContext, files: dict[str, list[tuple[int, dict[str, Any], str]]]) -> None:
    """Per save site: the writers of each file it wrote. One writer per file measures the every-rank suspicion
    absent there; the per-node one needs several nodes to be measured."""
    sites: dict[tuple, dict[str, Any]] = {}
    for path, saves in files.items():
        for r, e, _ in saves:
            for site in [e.get("site"), *(e.get("callers") or [])]:
                if not site:
                    continue
                entry = sites.setdefault(ctx.where(site), {"site": site, "files": {}, "saves": 0})
                entry["files"].setdefault(path, set()).add(r)
                entry["saves"] += 1
    multi_node = len(ctx.nodes) > 1
    for entry in sites.values():
        writers = sorted({r for ranks in entry["files"].values() for r in ranks})
        if any(len(ranks) > 1 for ranks in entry["files"].values()):
            continue  # several ranks wrote one file: the finding speaks for this site
        files_text = f"{len(entry['files'])} file{'s' if len(entry['files']) != 1 else ''}"
        reason = (f"the {entry['saves']} saves at {ctx.at(entry['site'])} were made by {fmt_ranks(writers)} "
                  f"({files_text}, one writer each)")
        ctx.measured(CODE, site=entry["site"], reason=reason, about=("unguarded",))
        if multi_node:
            ctx.measured(CODE, site=entry["site"], reason=reason + f" on a run of {len(ctx.nodes)} nodes",
                         about=("guard_line",))
        else:
            ctx.not_measured(CODE, site=entry["site"], about=("guard_line",), reason=(
                "on one node local rank 0 is global rank 0: only a run on several nodes shows whether each node "
                "writes the file"
            ))


def _overlaps(saves: list[tuple[int, dict[str, Any]]]) -> int:
    """Pairs of saves by different ranks whose [start, end] intervals overlap."""
    spans = [(r, float(e.get("t_start") or e["t"]), float(e.get("t_start") or e["t"]) + float(e.get("seconds") or 0))
             for r, e in saves]
    n = 0
    for i, (ra, sa, ea) in enumerate(spans):
        for rb, sb, eb in spans[i + 1:]:
            if ra != rb and sa <= eb and sb <= ea:
                n += 1
    return n


def analyze(ctx: RunContext) -> list[Finding]:
    files: dict[str, list[tuple[int, dict[str, Any], str]]] = {}
    for r, p in ctx.ranks.items():
        for e in p.of("checkpoint_save"):
            path = e.get("abspath")
            if path and not e.get("error"):
                if e.get("local_rank") is None:  # srun without torchrun: LOCAL_RANK unset, SLURM_LOCALID says
                    e = {**e, "local_rank": ctx.local_rank_of(p)}
                files.setdefault(path, []).append((r, e, p.host))
    _note_written(ctx, files)
    _measure_sites(ctx, files)
    findings = []
    for path, saves in files.items():
        writers = sorted({r for r, _, _ in saves})
        if len(writers) < 2:
            continue
        hosts = {h for _, _, h in saves}
        local = {e.get("local_rank") for _, e, _ in saves}
        # nodes as the launcher numbered them (GROUP_RANK, SLURM_NODEID), else hosts: two launchers on one
        # machine are two nodes
        node_of = {r: ctx.node_of(ctx.ranks[r]) for r in writers}
        nodes = set(node_of.values())
        every_rank = set(writers) >= set(ctx.ranks)
        if every_rank and not (local == {0} and len(nodes) > 1):
            who = f"every rank ({fmt_ranks(writers)})"
        elif local == {0} and len(nodes) > 1:
            who = (f"local rank 0 of each of {len(nodes)} nodes ({fmt_ranks(writers)}; a local-rank guard holds "
                   "once per node)")
        else:
            who = fmt_ranks(writers)
        per_rank = {r: sum(1 for s, _, _ in saves if s == r) for r in writers}
        overlapping = _overlaps([(r, e) for r, e, _ in saves])
        first = saves[0][1]
        times = f"{min(per_rank.values())}–{max(per_rank.values())}" if len(set(per_rank.values())) > 1 else str(
            next(iter(per_rank.values())))
        message = (
            f"torch.save at {ctx.at(first.get('site'))} is reached by {who}, which all wrote "
            f"{ctx.path(path)} ({times} time{'s' if times != '1' else ''} each"
            + (f", {overlapping} pair{'s' if overlapping != 1 else ''} of writes overlapping in time"
               if overlapping else "")
            + "): concurrent writers to one file can leave a truncated or mixed checkpoint, and readers can load it "
            "half-written"
        )
        findings.append(
            ctx.finding(
                CODE,
                message=message,
                site=first.get("site"),
                ranks=writers,
                evidence={
                    "path": path,
                    "writers": writers,
                    "saves_per_rank": {str(r): n for r, n in per_rank.items()},
                    "local_ranks": sorted(x for x in local if x is not None),
                    "hosts": sorted(hosts),
                    **({"nodes": {str(r): node_of[r] for r in writers}} if len(ctx.nodes) > 1 else {}),
                    "overlapping_writes": overlapping,
                    "bytes": first.get("bytes"),
                },
                magnitude=float(len(writers)),
            )
        )
    return findings


def _note_written(ctx: RunContext, files: dict[str, list[tuple[int, dict[str, Any], str]]]) -> None:
    """Where the run's saves went when they are real files where the script says (attach mode, runs recorded
    before the redirection). A `check` that redirected them (file_write events) lists them in its files table."""
    if not files or any(True for _ in ctx.run.events("file_write")):
        return
    parts = []
    for path, saves in list(files.items())[:4]:
        writers = sorted({r for r, _, _ in saves})
        earliest = min((e for _, e, _ in saves), key=lambda e: e.get("t_start") or e.get("t") or 0.0)
        existed = bool(earliest.get("existed"))
        parts.append(f"{ctx.path(path)} ({fmt_ranks(writers)}{', overwrote an existing file' if existed else ''})")
    more = f" and {len(files) - 4} more" if len(files) > 4 else ""
    ctx.notes.append("the script saved checkpoints during the probe, where it says: " + ", ".join(parts) + more)
