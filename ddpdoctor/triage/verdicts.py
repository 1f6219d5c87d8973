"""From the arms' recorded runs to a ranked diagnosis (pure: event logs and findings in, causes out; no torch).

`triage(arms, settings)` decides every cause against the others from the same arms:

- deterministic checks → CONFIRMED (ddpdoctor.triage.checks): what the conversion did to each layer, and per-layer
  attributes compared between the arm with the conversion and the arm without it;
- statistical measurements → LIKELY / POSSIBLE / RULED OUT (ddpdoctor.triage.measures): BN noise removed by
  syncing, non-i.i.d. shards, micro-batch BN, running statistics against population statistics. A confirmed
  conversion defect decides whether A's and P's statistics may be compared (without arm L they differ by the defect
  too), and the non-i.i.d. verdict decides how the noise is read;
- port problems (`port_causes`): the as-written arm's check findings that are not about SyncBN; found in both arms
  they are BOTH ARMS — they cannot explain a gap between the arms. Those that only make a run crash, hang, run
  slower or put its files at risk (model.RUN_ONLY: device binding, checkpoint keys...) rank with the low ones and
  are never named as where the regression is: they change neither what the arms learn nor the score reported.

A cause explained by another on this run's evidence (running statistics worse with per-rank statistics, because
per-rank batches are small or the shards non-i.i.d.; a port finding explained by another) is folded under it
through the one declared relation, ddpdoctor.causes (`fold`), and ranked right after it.

Ranking (`rank_key`): confirmed; both-arms causes of medium severity or more; likely; possible; ruled out in favour
of one arm ("SyncBN is right here"); low both-arms causes; not measurable; ruled out — then by severity and
measured size. The headline answers the user's question (is it SyncBN, or the conversion?) from the BatchNorm
causes, and names the port causes after it, never in their place.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.causes import explained_by
from ddpdoctor.conversion import locate_class_test
from ddpdoctor.findings import Finding, Severity
from ddpdoctor.rules import get_rule
from ddpdoctor.triage.checks import attribute_causes, conversion_causes, pairing
from ddpdoctor.triage.measures import (
    accumulation_cause,
    noise_cause,
    noniid_cause,
    running_stats_causes,
)
from ddpdoctor.triage.model import (
    RUN_ONLY,
    SYNCBN_ONLY,
    TRIAGE_RULES,
    Arm,
    Cause,
    TriageResult,
    clip,
    small,
)

TIERS = {"confirmed": 0, "both_arms_high": 1, "likely": 2, "possible": 3, "ruled_out_favouring": 4,
         "both_arms_low": 5, "not_measurable": 6, "ruled_out": 7}
HEADLINE_PORT_CAUSES = 3  # port causes the headline names (the table lists them all)


# --------------------------------------------------------------------------------------------------- port causes


def port_causes(written: Arm, other: Arm | None) -> list[Cause]:
    """Findings of the as-written arm that are not about SyncBN: in both arms → BOTH ARMS; in the as-written arm
    only → possible, in favour of the other arm."""
    out = []
    other_rules = {f.rule for f in other.findings} if other is not None else set()
    seen: set[str] = set()
    for f in written.findings:
        if f.rule in TRIAGE_RULES or f.rule in SYNCBN_ONLY or f.rule in seen:
            continue
        seen.add(f.rule)
        both = other is None or f.rule in other_rules
        run_only = f.rule in RUN_ONLY
        if both and run_only:
            verdict, favours = "both_arms", "none"
            message = (f.message + " — in both arms; it does not change what either arm learns "
                       f"({RUN_ONLY[f.rule]}), so it cannot explain a gap in their scores")
        elif both:
            verdict, favours = "both_arms", "none"
            message = f.message + " — this hurts both arms, so it cannot explain a gap between them"
        else:
            verdict = "possible"
            favours = "plain" if written.name == "A" else "syncbn"
            message = f.message + f" — seen with arm {written.name} only, not with arm {other.name}"
        out.append(Cause(cause=get_rule(f.rule).name, rule=f.rule, verdict=verdict, favours=favours,
                         measured={"summary": clip(f.message), **small(dict(list(f.evidence.items())[:8]))},
                         message=message, fix=f.fix, severity=f.severity, magnitude=f.magnitude, file=f.file,
                         line=f.line, port=True, run_only=run_only, source=f))
    return out


# --------------------------------------------------------------------------------------------------- ranking


def tier(c: Cause) -> int:
    if c.verdict == "both_arms":
        return TIERS["both_arms_high" if c.severity >= Severity.MEDIUM and not c.run_only else "both_arms_low"]
    if c.verdict == "ruled_out" and c.favours != "none":  # evidence for one arm ("SyncBN is right here")
        return TIERS["ruled_out_favouring"]
    return TIERS[c.verdict]


def rank_key(c: Cause) -> tuple:
    return (tier(c), -int(c.severity), -c.magnitude, c.rule or "", c.cause)


def fold(causes: list[Cause], script: str | None = None, ranks: Any = ()) -> None:
    """Fold every cause that another explains on this run's evidence under it (ddpdoctor.causes.explained_by, over
    the causes as findings, best-ranked first): `explained_by`, `because`, and the message says so. A cause takes
    the highest severity among what it explains, as a folded finding's cause does."""
    ordered = sorted(causes, key=rank_key)
    pairs = [(c, f) for c in ordered if (f := c.finding(script, ranks)) is not None]
    parents = explained_by([f for _, f in pairs])
    for j, (i, because) in parents.items():
        c, root = pairs[j][0], pairs[i][0]
        if tier(c) < tier(root):
            # verdicts first: a LIKELY cause is never folded under (and ranked after) a RULED OUT or weaker one;
            # the explanation still says what explains it
            c.related, c.because = root, because
            c.message += f" — explained by {root.cause} ({root.rule}): {because}"
            continue
        c.explained_by, c.because = root, because
        c.message += f" — a consequence of {root.cause} ({root.rule}): {because}"
    for c in causes:
        up = c.explained_by
        while up is not None:
            up.severity = max(up.severity, c.severity)
            up = up.explained_by


def rank_causes(causes: list[Cause]) -> list[Cause]:
    """By `rank_key`; each consequence right after the cause that explains it (root causes first)."""
    out: list[Cause] = []

    def visit(c: Cause) -> None:
        out.append(c)
        for x in sorted((x for x in causes if x.explained_by is c), key=rank_key):
            visit(x)

    for c in sorted((c for c in causes if not any(c.explained_by is x for x in causes)), key=rank_key):
        visit(c)
    return out


# --------------------------------------------------------------------------------------------------- headline


REASONS = {
    "DD208": "a converted layer computes a different function",
    "DD209": "code that picks norm layers by class treats the converted layers differently",
    "DD210": "frozen BatchNorm layers train again",
    "DD211": "SyncBN applies statistics that are not its group's exact ones",
    "DD212": "SyncBN synchronises over the wrong ranks",
    "DD216": "the converted layers' BN parameters are never trained",
    "DD203": "the ranks' data are not i.i.d., which SyncBN corrects",
    "DD215": "BN normalises small micro-batches under gradient accumulation, which SyncBN partly recovers",
    "DD213": "running statistics lag the weights more without SyncBN",
    "DD214": "evaluation is more inconsistent with training without SyncBN",
    "DD204": "per-GPU BN statistics from so few samples are noisy",
}


def _names(causes: list[Cause]) -> str:
    shown = [f"{c.cause} ({c.rule})" for c in causes[:HEADLINE_PORT_CAUSES]]
    more = len(causes) - len(shown)
    text = ", ".join(shown[:-1]) + (" and " if len(shown) > 1 else "") + shown[-1]
    return text + (f" and {more} more" if more else "")


def headline(causes: list[Cause], mirror: bool) -> str:
    """One sentence that answers the user's question — does SyncBN (or the conversion to it) make this run score
    lower? — from the BatchNorm causes; port causes that hurt both arms (medium severity or more) follow it as where
    the regression is instead, never in its place."""
    roots = [c for c in causes if c.explained_by is None]
    bn = [c for c in roots if not c.port]
    port = [c for c in roots if c.port and c.verdict == "both_arms" and c.severity >= Severity.MEDIUM
            and not c.run_only]
    verb, it = ("hurts", "it") if len(port) == 1 else ("hurt", "them")
    elsewhere = f"the regression is elsewhere: {_names(port)} {verb} both arms — fix {it} first" if port else ""
    beside = f"beside it, {_names(port)} {verb} both arms" if port else ""
    top = bn[0] if bn else None
    if top is not None and top.verdict == "confirmed":
        reason = REASONS.get(top.rule or "", top.cause)
        if mirror:
            return (f"Converting this plain-BN script to SyncBN would change the model itself: {reason} "
                    f"({top.rule}) — fix that before converting" + (f"; {beside}." if beside else "."))
        return (f"The conversion to SyncBN changed the model itself: {reason} ({top.rule}) — fix that before "
                "comparing accuracy" + (f"; {beside}." if beside else "."))
    prefix = "No SyncBN-specific defect found"
    noise = next((c for c in bn if c.rule == "DD204"), None)
    b = noise.measured.get("per_rank_samples") if noise is not None else None
    of_b = f" of {b}" if b else ""
    if top is not None and top.verdict == "likely" and top.favours in ("plain", "subgroups"):
        if mirror:
            answer = (f"SyncBN would most likely not help: per-GPU batches{of_b} already give stable BN statistics, "
                      "and syncing would remove the BN noise that regularises")
        else:
            answer = (f"SyncBN most likely scores lower because it removes the BN noise that per-GPU batches{of_b} "
                      "already average out: use per-GPU BatchNorm or SyncBN over small subgroups")
        return f"{prefix}; {answer}" + (f"; {beside}." if beside else ".")
    favouring = next((c for c in bn if c.favours == "syncbn" and c.verdict in ("likely", "possible", "ruled_out")),
                     None)
    if favouring is not None and (top is favouring or top is None or top.favours in ("syncbn", "none")):
        if favouring.related is not None and favouring.related.favours == "syncbn":
            favouring = favouring.related  # what explains it is the answer (small per-rank batches, say)
        reason = REASONS.get(favouring.rule or "", favouring.cause)
        if mirror:
            return (f"{prefix} in the conversion; SyncBN would likely help here: {reason} ({favouring.rule})"
                    + (f"; {elsewhere}." if elsewhere else "."))
        return (f"{prefix}; SyncBN is right here — {reason} ({favouring.rule}) — so "
                + (f"{elsewhere}." if elsewhere else "the regression is elsewhere."))
    if top is not None and top.verdict == "possible":
        if top.rule == "DD204" and not mirror:
            answer = (f"SyncBN may score lower because it removes part of the BN noise of per-GPU batches{of_b} "
                      "(possible, not likely): compare with per-GPU BatchNorm")
        else:
            answer = f"the strongest BatchNorm candidate is only possible: {top.cause} ({top.rule})"
        return f"{prefix}; {answer}" + (f"; {beside}." if beside else ".")
    nothing = ("nothing measured about BatchNorm explains a gap between SyncBN and plain DDP on this script"
               + (" (the mirror question: converting would change nothing measurable)" if mirror else ""))
    return f"{prefix}: {nothing}" + (f"; {elsewhere}." if elsewhere else ".")


# --------------------------------------------------------------------------------------------------- triage


STOPPED = ("DD901", "DD902", "DD904")  # why a run stopped before it measured anything


def nothing_measured(arms: list[Arm]) -> str | None:
    """The headline of a triage whose arms all stopped before their first optimizer step, or None: every cause
    triage decides compares what the arms did while training, so such a run claims nothing (SPEC: no verdict from
    a measurement that did not happen)."""
    if not arms or any(arm.steps > 0 for arm in arms):
        return None
    why = []
    for arm in arms:
        stop = next((f for f in arm.findings if f.rule in STOPPED), None)
        why.append(f"arm {arm.name}: " + (f"{stop.rule} {stop.name}" if stop is not None else "no optimizer step"))
    return ("Nothing measured: every arm stopped before its first optimizer step (" + "; ".join(why) + "), so "
            "triage claims nothing about SyncBN or the conversion — fix that first and run triage again.")


def triage(arms: list[Arm], settings: Any) -> TriageResult:
    by_name = {arm.name: arm for arm in arms}
    a, p = by_name.get("A"), by_name.get("P")
    written = next((arm for arm in arms if arm.as_written), arms[0])
    mirror = written.name == "P"
    paired, pair_info = pairing(arms)
    arms_json = [{"name": arm.name, "what": arm.what, "steps": arm.steps} for arm in arms]
    emulated = any(e.get("cuda_emulated") for arm in arms for _, e in arm.ctx.run.events("torch_ready"))
    nothing = nothing_measured(arms)
    if nothing is not None:
        return TriageResult(arms=arms_json, paired=False, pairing={"reason": "no arm took an optimizer step"},
                            headline=nothing, causes=[], emulated=emulated, mirror=mirror, measured=False)
    causes: list[Cause] = []
    notes: list[str] = []
    if a is not None:
        conv = conversion_causes(a)
        causes.extend(conv)
        if p is not None:
            causes.extend(attribute_causes(a, p, conv))
            for c in causes:  # the class test of an optimizer-group builder or precise-BN helper, as check does
                locate_class_test(a, p, c)
        nonid = noniid_cause(a)
        if nonid is not None:
            causes.append(nonid)
        causes.append(noise_cause(a, by_name.get("L") or p, settings,
                                  noniid=bool(nonid and nonid.verdict != "ruled_out"), g_arm=by_name.get("G")))
        acc = accumulation_cause(a)
        if acc is not None:
            causes.append(acc)
    # without arm L, A and P differ by whatever the conversion changed too: once that is confirmed, their running
    # statistics are not compared (no arm is favoured)
    confounded = "L" not in by_name and any(c.verdict == "confirmed" for c in causes)
    causes.extend(running_stats_causes([x for x in (a, by_name.get("L"), p) if x is not None],
                                       paired and not confounded))
    other = p if written is a else a
    causes.extend(port_causes(written, other))
    fold(causes, written.ctx.script, sorted(written.ctx.ranks))
    for arm in arms:
        failed = [f for f in arm.findings if f.rule in ("DD901", "DD902")] if arm is not written else []
        if failed:
            notes.append(f"arm {arm.name} ({arm.what}) failed: {failed[0].rule} {failed[0].name} — what compares it "
                         f"with the other arms covers its {arm.steps} steps only")
    if not paired:
        notes.append(f"arms not paired: {pair_info.get('reason')}; statistics comparing the arms are not used")
    ranked = rank_causes(causes)
    return TriageResult(arms=arms_json, paired=paired, pairing=pair_info, headline=headline(ranked, mirror),
                        causes=ranked, emulated=emulated, mirror=mirror, notes=notes)


def cause_findings(result: TriageResult, arm: Arm) -> list[Finding]:
    """Confirmed and likely causes with a rule triage decides, as findings (so exit codes and --fail-on see them;
    the report folds them with the others, ddpdoctor.causes)."""
    unique: dict[tuple, Finding] = {}
    for c in result.causes:
        if c.rule is None or c.verdict not in ("confirmed", "likely") or c.rule not in TRIAGE_RULES:
            continue
        f = c.finding(arm.ctx.script, sorted(arm.ctx.ranks))
        if f is not None:
            unique.setdefault((f.rule, f.message), f)
    return list(unique.values())
