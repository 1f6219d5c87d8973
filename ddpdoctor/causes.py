"""Root causes first: which finding explains which, declared once, checked on each run's evidence.

A report is a diagnosis. When one cause produces several symptoms — a model never wrapped in DDP makes the
replicas diverge, their BatchNorm statistics differ and their BN inputs look non-i.i.d. — the symptoms are folded
under the cause (`Finding.consequences`) instead of being ranked beside it, so the first finding is the one to fix.

Two levels, both explicit:

- a rule-level relation, `Explains(cause, consequence, when)`: "DD110 can explain DD203". The relations form an
  acyclic graph over rule codes (a test holds them to that and to the catalog);
- a per-run check, `when(cause, consequence, findings) -> str | None`: does *this* run's evidence support it? It
  returns the reason shown with the folded finding ("the replicas had diverged: …"), or None, and then both stay
  top-level findings. E.g. DD110 explains DD203 only when the replicas actually diverged: with identical replicas
  a non-i.i.d. signal in the BN inputs comes from the data, and is a cause of its own.

A folded consequence keeps its own evidence (text, JSON `consequences`, SARIF related locations). The cause takes
the highest severity among what it explains: severity follows the measured consequence.

`ddpdoctor triage` decides its verdicts (ddpdoctor.triage) as findings too — each cause with its verdict and the arm
it favours in `evidence["triage_verdict"]` / `evidence["triage_favours"]` — and folds them with the same relation
(`explained_by`): running statistics that are worse with per-rank statistics are what small per-rank batches,
non-i.i.d. shards or micro-batch BN do, so such DD213/DD214 verdicts are consequences of that cause.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from ddpdoctor.findings import Consequence, Finding, rank_findings
from ddpdoctor.plain import FrozenRecord
from ddpdoctor.rules import setting

Check = Callable[[Finding, Finding, Sequence[Finding]], "str | None"]


class Explains(FrozenRecord):
    """`cause` (a rule code) can explain `consequence` (a rule code); `when` decides it for one run."""

    __match_args__ = ("cause", "consequence", "when")
    cause: str
    consequence: str
    when: Check

    def __init__(self, cause: str, consequence: str, when: Check) -> None:
        object.__setattr__(self, "cause", cause)
        object.__setattr__(self, "consequence", consequence)
        object.__setattr__(self, "when", when)


# ------------------------------------------------------------------------------------------- per-run checks


def _ev(f: Finding, key: str, default: Any = None) -> Any:
    return f.evidence.get(key, default) if isinstance(f.evidence, dict) else default


def _first(findings: Sequence[Finding], rule: str) -> Finding | None:
    return next((f for f in findings if f.rule == rule), None)


def _replicas_diverged(cause: Finding, consequence: Finding, findings: Sequence[Finding]) -> str | None:
    """The symptom is one of diverged replicas: the cause's or the symptom's own evidence says the replicas (the
    models the ranks train) differed, or a DD103 finding measured it."""
    diff = _ev(cause, "max_param_diff")
    if _ev(cause, "replicas_diverged") or _ev(consequence, "replicas_diverged"):
        how = f" (max parameter difference {diff:.3g})" if isinstance(diff, (int, float)) else ""
        return f"the ranks' models had diverged{how}, so their layers see different inputs and statistics"
    dd103 = _first(findings, "DD103")
    if dd103 is not None:
        step = _ev(dd103, "first_step")
        diff = _ev(dd103, "max_abs_diff_final")
        detail = ", ".join(p for p in (f"from step {step}" if step is not None else "",
                                       f"max parameter difference {diff:.3g}" if isinstance(diff, (int, float))
                                       else "") if p)
        return f"the ranks' models had diverged (DD103{': ' + detail if detail else ''}), so their layers see " \
               "different inputs and statistics"
    return None


def _always(reason: str) -> Check:
    def check(cause: Finding, consequence: Finding, findings: Sequence[Finding]) -> str | None:
        return reason

    return check


def _rendezvous_hang(cause: Finding, consequence: Finding, findings: Sequence[Finding]) -> str | None:
    """DD901 is the rendezvous waiting for a rank the literal rank/world size never lets join."""
    for entry in _ev(consequence, "stuck") or ():
        if not isinstance(entry, dict):
            continue
        last = (entry.get("last_event") or {}).get("kind") if isinstance(entry.get("last_event"), dict) else None
        blocked = str(entry.get("blocked_in") or "")
        if last == "pg_init_begin" or "rendezvous" in blocked or "init_process_group" in blocked:
            return "the ranks were blocked in the rendezvous, which waits for the rank numbers the literal never gives"
    return None


def _split_differs(cause: Finding, consequence: Finding, findings: Sequence[Finding]) -> str | None:
    if _ev(consequence, "splits_differ_across_ranks") or _ev(cause, "split_differs"):
        return "the ranks hold different random splits, so the sampler shards different subsets that overlap"
    return None


def _default_local_rank_shared(cause: Finding, consequence: Finding, findings: Sequence[Finding]) -> str | None:
    if _ev(cause, "injected_by_probe"):
        return None  # the probe passed --local_rank: the shared device is not the option's doing
    return "every rank kept the option's default local rank, so they all bound the same device"


def _crash_on_default_local_rank(cause: Finding, consequence: Finding, findings: Sequence[Finding]) -> str | None:
    """The ranks ran with the option's default (the probe neither passed nor overrode it) and the first failure is
    a device error naming that default (`.cuda(-1)`: "... but got:-1")."""
    if _ev(cause, "injected_by_probe") or _ev(cause, "overridden_by_probe"):
        return None
    defaults = {str(v.get("default")) for v in (_ev(cause, "per_rank") or {}).values() if isinstance(v, dict)}
    root = _ev(consequence, "root_cause") or {}
    message = str(root.get("message") or "") if isinstance(root, dict) else ""
    value = next(iter(defaults)) if len(defaults) == 1 else None
    named = value is not None and re.search(rf"(?<![\w.-]){re.escape(value)}(?![\w.])", message)
    if named and "device" in message.lower():
        return f"every rank kept the option's default local rank {value}, and the device call that took it failed"
    return None


def _never_distributed(cause: Finding, consequence: Finding, findings: Sequence[Finding]) -> str | None:
    """The script never formed a process group (a single-GPU script launched on several ranks): each process is a
    run of its own, so every one reads all the data and writes the same files."""
    if _ev(cause, "process_group") is not False:
        return None
    if consequence.rule == "DD302":
        return "the script never initialised a process group: each process trains alone, over the whole dataset"
    return "the script never initialised a process group: each process is a run of its own and saves its own"


def _favours_syncbn(consequence: Finding) -> bool:
    """A triage verdict that the arm with per-rank statistics did worse (its running statistics lag more, its
    evaluation shifts more)."""
    return _ev(consequence, "triage_favours") == "syncbn"


def _detected(cause: Finding) -> bool:
    """A check finding, or a triage verdict that says the condition is there (likely or possible)."""
    return _ev(cause, "triage_verdict", "likely") in ("confirmed", "likely", "possible")


def _small_batches_noisy(cause: Finding, consequence: Finding, findings: Sequence[Finding]) -> str | None:
    """Triage measured per-rank batches below DD202's threshold (its noise verdict favours SyncBN): running
    statistics averaged from such noisy batch statistics are worse without SyncBN for that reason."""
    b = _ev(cause, "per_rank_samples")
    if not _favours_syncbn(consequence) or _ev(cause, "triage_favours") != "syncbn":
        return None
    if not isinstance(b, (int, float)) or b >= setting("small_bn_batch").default:
        return None
    return (f"per-rank batches of {b:g} give noisy batch statistics, and running statistics averaged from them "
            "follow the population less well without SyncBN")


def _non_iid_per_rank(cause: Finding, consequence: Finding, findings: Sequence[Finding]) -> str | None:
    if not _favours_syncbn(consequence) or not _detected(cause):
        return None
    return ("each rank's running statistics follow its own shard, not the population: SyncBN normalises over the "
            "union of the shards")


def _micro_batches(cause: Finding, consequence: Finding, findings: Sequence[Finding]) -> str | None:
    if not _favours_syncbn(consequence) or not _detected(cause):
        return None
    return "BN normalises and updates its running statistics per micro-batch, over fewer samples without SyncBN"


EXPLAINS: tuple[Explains, ...] = (
    Explains("DD110", "DD103", _always("no gradient is averaged, so every rank trains its own model")),
    Explains("DD110", "DD201", _replicas_diverged),
    Explains("DD110", "DD203", _replicas_diverged),
    Explains("DD102", "DD103", _always("the training forward bypassed DDP, so gradients were never averaged")),
    Explains("DD102", "DD201", _replicas_diverged),
    Explains("DD102", "DD203", _replicas_diverged),
    Explains("DD103", "DD201", _replicas_diverged),
    Explains("DD103", "DD203", _replicas_diverged),
    Explains("DD104", "DD901", _rendezvous_hang),
    Explains("DD305", "DD302", _split_differs),
    Explains("DD903", "DD302", _never_distributed),
    Explains("DD903", "DD502", _never_distributed),
    Explains("DD108", "DD105", _default_local_rank_shared),
    Explains("DD108", "DD902", _crash_on_default_local_rank),
    # triage (ddpdoctor.triage): running statistics worse with per-rank statistics, and why
    Explains("DD203", "DD213", _non_iid_per_rank),
    Explains("DD203", "DD214", _non_iid_per_rank),
    Explains("DD204", "DD213", _small_batches_noisy),
    Explains("DD204", "DD214", _small_batches_noisy),
    Explains("DD215", "DD213", _micro_batches),
    Explains("DD215", "DD214", _micro_batches),
)


# ------------------------------------------------------------------------------------------------- folding


def relations(explains: Iterable[Explains] = EXPLAINS) -> dict[str, set[str]]:
    """cause rule -> the rules it can explain."""
    out: dict[str, set[str]] = {}
    for e in explains:
        out.setdefault(e.cause, set()).add(e.consequence)
    return out


def explained_by(findings: Sequence[Finding], explains: Iterable[Explains] = EXPLAINS) -> dict[int, tuple[int, str]]:
    """index of each finding explained by another on this run's evidence → (index of its cause, because).

    `findings` in rank order: each finding is explained by at most one cause, the first (best-ranked) that explains
    it. The rule-level relation is acyclic, so chains nest (DD110 → DD103 → DD201) and never loop."""
    by_pair: dict[tuple[str, str], list[Explains]] = {}
    for e in explains:
        by_pair.setdefault((e.cause, e.consequence), []).append(e)
    parent: dict[int, tuple[int, str]] = {}
    for j, y in enumerate(findings):
        for i, c in enumerate(findings):
            if i == j or (c.rule, y.rule) not in by_pair:
                continue
            reason = next((r for e in by_pair[(c.rule, y.rule)] if (r := e.when(c, y, findings))), None)
            if reason is not None:
                parent[j] = (i, reason)
                break
    # a cause folded under an effect of itself cannot happen with an acyclic relation; guard anyway
    for j in list(parent):
        seen = {j}
        k = parent[j][0]
        while k in parent:
            if k in seen:
                del parent[j]
                break
            seen.add(k)
            k = parent[k][0]
    return parent


def fold_consequences(findings: Iterable[Finding], explains: Iterable[Explains] = EXPLAINS) -> list[Finding]:
    """The findings with every explained finding folded under its cause (`explained_by`), ranked.

    Chains fold transitively (DD110 → DD103 → DD201 nests DD201 under DD103 under DD110). A cause's severity is
    raised to the highest severity it explains."""
    findings = rank_findings(findings)
    parent = explained_by(findings, explains)
    children: dict[int, list[int]] = {}
    for j, (i, _) in parent.items():
        children.setdefault(i, []).append(j)

    def build(i: int) -> Finding:
        f = findings[i]
        kids = [Consequence(finding=build(j), because=parent[j][1]) for j in sorted(children.get(i, ()))]
        if not kids:
            return f
        worst = max([f.severity, *(k.finding.severity for k in kids)])
        evidence = f.evidence
        if worst > f.severity:
            evidence = {**f.evidence, "severity_from_consequence": next(k.finding.rule for k in kids
                                                                        if k.finding.severity == worst)}
        return replace(f, severity=worst, evidence=evidence, consequences=tuple(kids))

    return rank_findings(build(i) for i in range(len(findings)) if i not in parent)


def flatten(findings: Iterable[Finding]) -> list[Finding]:
    """Every finding, folded consequences included (depth first)."""
    out: list[Finding] = []
    for f in findings:
        out.append(f)
        out.extend(flatten(c.finding for c in f.consequences))
    return out
