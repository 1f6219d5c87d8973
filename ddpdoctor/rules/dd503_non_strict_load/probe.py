"""DD503 non-strict-load: `load_state_dict(strict=False)` that skipped keys.

What it does: reads every `Module.load_state_dict` call of the run with strict=False and the missing and
unexpected keys it returned, and fires per call site when some of the module's parameters or buffers were not
loaded (missing keys), with how many. When stripping or adding the "module." prefix would have matched the keys,
it says so (a checkpoint saved from or loaded into the DDP wrapper, DD501). Severity follows the measured
consequence: nothing loaded at all is critical — the whole run trains from the random initialisation instead of
the checkpoint, a larger consequence than any noise in its statistics (it ranks above a high DD202 on the same run).
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence, key, share
from ddpdoctor.analyses.context import RunContext, fmt_ranks, pct
from ddpdoctor.findings import Finding, Measures, Severity
from ddpdoctor.rules.dd503_non_strict_load import CODE

MEASURES = Measures(
    scope="site",
    what="every load_state_dict(strict=False): the keys it left unloaded and those it ignored",
)
# a finding its own measurement contradicts is never reported; the share of the model's keys left at their initial
# values is the share of the checkpoint's training lost, and ranks the finding (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the model's keys a strict=False load was measured to leave unloaded",
    measure=key("missing"), lost=share("missing", "model_keys"))


def _site_key(site: dict[str, Any] | None) -> tuple[str, int]:
    return (site or {}).get("file", "?"), (site or {}).get("line", 0)


def _clear_complete_loads(ctx: RunContext) -> None:
    """Call sites where every strict=False load of the run left no key of the model unloaded."""
    sites: dict[tuple[str, int], list[tuple[int, dict[str, Any]]]] = {}
    for r, p in ctx.ranks.items():
        for e in p.of("state_dict_load"):
            if not e.get("strict") and not e.get("error"):
                sites.setdefault(_site_key(e.get("site")), []).append((r, e))
    for loads in sites.values():
        if any((e.get("missing") or 0) > 0 for _, e in loads):
            continue
        r0, e = loads[0]
        total, unexpected = int(e.get("model_keys") or 0), max(int(e.get("unexpected") or 0) for _, e in loads)
        ctx.clear(
            CODE,
            site=e.get("site"),
            reason=(
                f"load_state_dict(strict=False) loaded all {total} keys of {e.get('module_class')} "
                f"({len(loads)} load{'s' if len(loads) != 1 else ''} on {fmt_ranks({r for r, _ in loads})}, "
                f"0 missing, {unexpected} unexpected checkpoint key{'s' if unexpected != 1 else ''} ignored)"
            ),
            evidence={"model_keys": total, "missing": 0, "unexpected": unexpected, "loads": len(loads)},
        )


def analyze(ctx: RunContext) -> list[Finding]:
    _clear_complete_loads(ctx)
    groups: dict[tuple[str, int], list[tuple[int, dict[str, Any]]]] = {}
    for r, p in ctx.ranks.items():
        for e in p.of("state_dict_load"):
            if not e.get("strict") and not e.get("error") and (e.get("missing") or 0) > 0:
                groups.setdefault(_site_key(e.get("site")), []).append((r, e))
    findings = []
    for loads in groups.values():
        r0, e = max(loads, key=lambda re: re[1].get("missing") or 0)
        missing, total = int(e.get("missing") or 0), int(e.get("model_keys") or 0)
        unexpected = int(e.get("unexpected") or 0)
        matched = e.get("matched")
        nothing = total > 0 and (matched == 0 if isinstance(matched, int) else missing >= total)
        why = ""
        loaded = matched if isinstance(matched, int) else total - missing
        if e.get("given_prefixed") and e.get("match_without_prefix", 0) > loaded:
            why = (f"; the checkpoint's keys start with \"module.\" and {e.get('match_without_prefix')} of {total} "
                   "would match without it (saved from the DDP wrapper)")
        elif e.get("model_prefixed") and e.get("match_with_prefix", 0) > loaded:
            why = (f"; the model is the DDP wrapper (keys \"module.*\") and {e.get('match_with_prefix')} of {total} "
                   "would match with the prefix added (load into ddp.module instead)")
        message = (
            f"load_state_dict(strict=False) at {ctx.at(e.get('site'))} left {missing} of the {total} keys of "
            f"{e.get('module_class')} unloaded"
            + (" (nothing was loaded: the model keeps its random initialisation)" if nothing
               else f" ({pct(missing / total) if total else '?'} at their initial values)")
            + f" and ignored {unexpected} checkpoint key{'s' if unexpected != 1 else ''}{why}"
        )
        findings.append(
            ctx.finding(
                CODE,
                message=message,
                severity=Severity.CRITICAL if nothing else None,
                site=e.get("site"),
                ranks=sorted({r for r, _ in loads}),
                evidence={
                    "module_class": e.get("module_class"),
                    "model_keys": total,
                    "given_keys": e.get("given_keys"),
                    "loaded": loaded,
                    "missing": missing,
                    "unexpected": unexpected,
                    "missing_keys": e.get("missing_keys"),
                    "unexpected_keys": e.get("unexpected_keys"),
                    "match_without_module_prefix": e.get("match_without_prefix"),
                    "match_with_module_prefix": e.get("match_with_prefix"),
                    "calls": len(loads),
                    "loaded_by": fmt_ranks({r for r, _ in loads}),
                },
                magnitude=missing / total if total else 1.0,
            )
        )
    return findings
