"""DD104 hardcoded-rank: init_process_group with a literal rank or world size that cannot differ per process.

What it does: compares what each process passed to init_process_group with what the launcher assigned. When the
probe overrode the values (to keep measuring past this fatal bug) the finding says so; when processes claimed the
same rank without an override (a self-spawning script) or the rendezvous failed, it reports the collision.

Measured at the init_process_group call: when every process passed its own rank (or none, taking the launcher's),
a static suspicion of a rank that cannot differ per process is dropped with the ranks each passed. A literal world
size is not measured by one run: the probe launches as many processes as the script expects.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Finding, Measures
from ddpdoctor.rules.dd104_hardcoded_rank import CODE

MEASURES = Measures(
    scope="site",
    what="the rank (and world size) each process passed to init_process_group, against the launcher's",
)


def _literal(evidence: dict) -> float | None:
    """Processes whose literal rank/world size the probe overrode (a launcher's contract), or that claimed a rank
    another process claimed too (no contract to override from)."""
    if isinstance(evidence.get("calls"), list):
        return float(sum(1 for c in evidence["calls"] if isinstance(c, dict) and c.get("overridden")))
    if isinstance(evidence.get("claims"), dict):
        return float(sum(len(p) for p in evidence["claims"].values() if isinstance(p, list) and len(p) > 1))
    return None


# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the processes measured passing a literal rank or world size the launch contradicts (the probe overrode "
    "it, or several claimed one rank)",
    measure=_literal)


def _measure_distinct_ranks(ctx: RunContext, begins: list[tuple[Any, dict[str, Any]]]) -> None:
    """Every process passed a rank of its own (or none): the rank was measured to differ per process."""
    by_site: dict[tuple, list[dict[str, Any]]] = {}
    for _, e in begins:
        by_site.setdefault(ctx.where(e.get("site")), []).append(e)
    for calls in by_site.values():
        if len(calls) < 2 or any("rank" in (e.get("overridden") or {}) for e in calls):
            continue
        given = [e.get("rank_arg") for e in calls]
        if any(isinstance(g, int) and g >= 0 for g in given):
            ints = [g for g in given if isinstance(g, int) and g >= 0]
            if len(set(ints)) != len(ints):
                continue
            what = f"ranks {', '.join(map(str, sorted(ints)))}"
        else:
            what = "no rank (each took the launcher's RANK)"
        ctx.measured(CODE, site=calls[0].get("site"), about=("literal_rank",), reason=(
            f"the {len(calls)} processes that called init_process_group at {ctx.at(calls[0].get('site'))} passed "
            f"{what}: one rank each"
        ), evidence={"rank_args": given})


def analyze(ctx: RunContext) -> list[Finding]:
    begins: list[tuple[Any, dict[str, Any]]] = list(ctx.run.events("pg_init_begin"))
    if not begins:
        return []
    # a world size that is the node's torch.cuda.device_count() is DD109's (measured there), not a literal
    begins = [
        (p, {**e, "overridden": {k: v for k, v in e["overridden"].items() if k != "world_size"}})
        if e.get("overridden") and ctx.world_size_from_device_count(p, e) else (p, e)
        for p, e in begins
    ]
    _measure_distinct_ranks(ctx, begins)
    overridden = [(p, e) for p, e in begins if e.get("overridden")]
    if overridden:
        given_rank = sorted({e["overridden"]["rank"][0] for _, e in overridden if "rank" in e["overridden"]})
        given_world = sorted(
            {e["overridden"]["world_size"][0] for _, e in overridden if "world_size" in e["overridden"]}
        )
        used = sorted({int(e.get("env_rank")) for _, e in begins if str(e.get("env_rank", "")).isdigit()})
        world = ctx.world_size
        parts = []
        if given_rank:
            ranks_with_literal = sorted(
                int(e["env_rank"]) for _, e in begins
                if e.get("rank_arg") in given_rank and str(e.get("env_rank", "")).isdigit()
            )
            parts.append(
                f"passes rank={', '.join(map(str, given_rank))} on {fmt_ranks(ranks_with_literal)}"
                f" while the launcher assigned ranks {min(used)}–{max(used)}"
                if used else f"passes rank={given_rank[0]}"
            )
        if given_world:
            parts.append(f"passes world_size={', '.join(map(str, given_world))} while {world} processes were launched")
        site = begins[0][1].get("site")
        joined = {p.pid for p, e in ctx.run.events("pg_init") if e.get("ok")}
        stuck = [p for p, _ in overridden if p.pid not in joined]
        moved = sorted({str(r.get("given")) for _, e in overridden if (r := e.get("rendezvous"))})
        instead = "the probe passed the launcher's RANK/WORLD_SIZE instead" + (
            f" (and the launcher's rendezvous for the script's own {', '.join(moved)})" if moved else ""
        )
        if stuck:
            who = fmt_ranks(sorted(r for r in (p.rank for p in stuck) if r is not None)) or "some processes"
            outcome = (
                f"{instead}, but {who} still did not join the process group "
                + ("before the timeout" if ctx.timed_out else "(init_process_group failed)")
                + ": nothing past init_process_group was measured"
            )
        else:
            outcome = f"{instead} and went on measuring"
        message = (
            f"init_process_group at {ctx.at(site)} " + " and ".join(parts)
            + f": every process would claim the same rank and the rendezvous would never complete; {outcome}"
        )
        evidence = {
            "calls": [
                {"rank": e.get("env_rank"), "rank_arg": e.get("rank_arg"), "world_size_arg": e.get("world_size_arg"),
                 "overridden": e.get("overridden"), "rendezvous": e.get("rendezvous"),
                 "joined": p.pid in joined}
                for p, e in begins
            ]
        }
        return [ctx.finding(CODE, message=message, fix_variant="probe", site=site, ranks=[r for r in used],
                            evidence=evidence, magnitude=float(len(overridden)))]
    # no override possible (no launcher contract): did processes claim the same rank?
    claims: dict[Any, list[Any]] = {}
    for p, e in begins:
        if isinstance(e.get("rank_arg"), int) and e["rank_arg"] >= 0:
            claims.setdefault(e["rank_arg"], []).append(p.pid)
    clashes = {r: pids for r, pids in claims.items() if len(pids) > 1}
    if not clashes:
        return []
    site = begins[0][1].get("site")
    failed = [e for _, e in ctx.run.events("pg_init") if not e.get("ok")]
    outcome = (
        "the rendezvous failed" if failed
        else ("the rendezvous never completed" if ctx.timed_out else "they collided")
    )
    r, pids = next(iter(sorted(clashes.items())))
    message = (
        f"init_process_group at {ctx.at(site)}: {len(pids)} processes all passed rank={r}; {outcome}"
    )
    evidence = {"claims": {str(k): v for k, v in claims.items()}, "errors": [e.get("error") for e in failed][:4]}
    return [
        ctx.finding(
            CODE, message=message, fix_variant="probe", site=site, evidence=evidence, magnitude=float(len(pids))
        )
    ]
