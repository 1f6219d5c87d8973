"""DD501 module-prefix-checkpoint: a checkpoint saved from the DDP wrapper (state-dict keys start with "module.").

What it does: looks at what every `torch.save` of the run wrote — the saved object itself when it is a state
dict, or its values one level down (`{"model": ..., "optimizer": ...}`) — and fires per save site when a state
dict's keys all start with "module.". If the same run loaded such a checkpoint, the load's outcome is quoted.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analyses.consequence import Consequence
from ddpdoctor.analyses.consequence import key as evidence_key
from ddpdoctor.analyses.context import RunContext, fmt_ranks
from ddpdoctor.findings import Finding, Measures, Severity
from ddpdoctor.rules.dd501_module_prefix_checkpoint import CODE

MEASURES = Measures(
    scope="site",
    what="the keys of every state dict each torch.save wrote, at the save and at the user lines that called it",
)

# a finding its own measurement contradicts is never reported (ddpdoctor.analyses.consequence)
CONSEQUENCE = Consequence(
    what="the state-dict keys measured saved with the DDP wrapper prefix module.",
    measure=evidence_key("module_prefixed"))


def prefixed_state_dicts(e: dict[str, Any]) -> list[dict[str, Any]]:
    return [sd for sd in e.get("state_dicts") or [] if sd.get("keys") and sd.get("module_prefixed") == sd.get("keys")]


def _site_key(site: dict[str, Any] | None) -> tuple[str, int]:
    return (site or {}).get("file", "?"), (site or {}).get("line", 0)


def _call_sites(ctx: RunContext, saves: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The save site and the user lines that called into it (a save helper), as findings show places."""
    out: list[dict[str, Any]] = []
    for _, e in saves:
        for site in [e.get("site"), *(e.get("callers") or [])]:
            file, line = ctx.where(site)
            if site and {"file": file, "line": line} not in out:
                out.append({"file": file, "line": line})
    return out


def analyze(ctx: RunContext) -> list[Finding]:
    groups: dict[tuple[str, int], list[tuple[int, dict[str, Any]]]] = {}
    clean: dict[tuple[str, int], list[tuple[int, dict[str, Any]]]] = {}
    for r, p in ctx.ranks.items():
        for e in p.of("checkpoint_save"):
            if prefixed_state_dicts(e):
                groups.setdefault(_site_key(e.get("site")), []).append((r, e))
            elif any(sd.get("keys") for sd in e.get("state_dicts") or []):
                clean.setdefault(_site_key(e.get("site")), []).append((r, e))
    for key, saves in clean.items():
        if key in groups:
            continue
        _, e = saves[0]
        sds = [sd for sd in e.get("state_dicts") or [] if sd.get("keys")]
        reason = (
            f"the probe saw what this save wrote ({e.get('path') or e.get('target')}): "
            + ", ".join(f"{sd.get('keys')} keys{' under ' + repr(sd['key']) if sd.get('key') else ''}, "
                        f"{sd.get('module_prefixed') or 0} starting with \"module.\"" for sd in sds[:3])
        )
        for place in _call_sites(ctx, saves):
            ctx.measured(CODE, site=place, reason=reason)
    loads = [(r, e) for r, p in ctx.ranks.items() for e in p.of("state_dict_load") if e.get("given_prefixed")]
    resumed_at = {(s.get("file"), s.get("line")): s for s in ctx.static_sites(CODE)
                  if (s.get("evidence") or {}).get("loaded_back_into_wrapper")}
    clean_dicts = [c for saves in clean.values() for _, ce in saves for c in ce.get("state_dicts") or []
                   if c.get("keys") and not c.get("module_prefixed")]
    findings = []
    for saves in groups.values():
        r0, e = saves[0]
        sd = prefixed_state_dicts(e)[0]
        exported = next((c for c in clean_dicts if _plain_part_of(c, sd)), None)
        where = f"under key '{sd['key']}' " if sd.get("key") else ""
        target = e.get("path") or f"a {e.get('target')}"
        consequence = (
            "loading it into the plain model raises on missing/unexpected keys, and with strict=False loads nothing"
        )
        load = next((le for _, le in loads if not le.get("is_ddp")), None)
        into_ddp = next((le for _, le in loads if le.get("is_ddp") and not le.get("error")), None)
        static_resume = next((resumed_at[(c["file"], c["line"])] for c in _call_sites(ctx, saves)
                              if (c["file"], c["line"]) in resumed_at), None)
        severity = None
        if load is None and into_ddp is not None:
            consequence = (
                f"this run loads it back into the DDP wrapper at {ctx.at(into_ddp.get('site'))}, where the keys "
                f"match ({_loaded(into_ddp)} of {into_ddp.get('model_keys')}), but the plain model (evaluation, "
                "fine-tuning, export) cannot load it without stripping the prefix"
            )
        elif load is None and static_resume is not None:
            consequence = (
                "the script loads it back into the DDP wrapper when it resumes (static analysis), where the keys "
                "match, but the plain model (evaluation, fine-tuning, export) cannot load it without stripping the "
                "prefix"
            )
        if load is None and (into_ddp is not None or static_resume is not None):
            severity = Severity.LOW  # the script's own use of it (resuming) works: another program's breaks
        if load is None and exported is not None:
            # the same run saved the plain weights of this model (or of its backbone) for everything else: the
            # prefixed file is the script's own (resume) checkpoint, measured, nothing to fix
            consequence = (
                f"the same run also saved {exported.get('keys')} plain keys of the same model (e.g. "
                f"'{(exported.get('first_keys') or ['?'])[0]}'), which evaluation or fine-tuning can load as they "
                "are; only a program that loads this checkpoint itself into the plain model must strip the prefix"
            )
            severity = Severity.INFO
        if load is not None:
            consequence = (
                f"this run's load_state_dict at {ctx.at(load.get('site'))} "
                + (f"raised ({str(load.get('error'))[:80]})" if load.get("error")
                   else f"loaded {_loaded(load)} of the model's {load.get('model_keys')} keys")
            )
        message = (
            f"torch.save at {ctx.at(e.get('site'))} wrote {target} with a state dict {where}whose {sd['keys']} keys "
            f"all start with \"module.\" (saved from the DDP wrapper, e.g. '{(sd.get('first_keys') or ['?'])[0]}'): "
            f"{consequence}"
        )
        findings.append(
            ctx.finding(
                CODE,
                message=message,
                site=e.get("site"),
                ranks=sorted({r for r, _ in saves}),
                evidence={
                    "call_sites": _call_sites(ctx, saves),
                    "paths": sorted({str(s.get("abspath") or s.get("path") or s.get("target")) for _, s in saves}),
                    "saves": len(saves),
                    "state_dict_key": sd.get("key"),
                    "keys": sd.get("keys"),
                    "module_prefixed": sd.get("module_prefixed"),
                    "first_keys": sd.get("first_keys"),
                    "saved_by": fmt_ranks({r for r, _ in saves}),
                    "loads_in_run": [
                        {k: le.get(k) for k in ("module_class", "strict", "given_keys", "model_keys", "matched",
                                                "missing", "unexpected", "match_without_prefix", "error")}
                        for _, le in loads[:3]
                    ],
                },
                magnitude=float(sd.get("keys") or 0),
                severity=severity,
            )
        )
    return findings


def _loaded(load: dict[str, Any]) -> int:
    matched = load.get("matched")
    if isinstance(matched, int):
        return int(matched)
    return int(load.get("model_keys") or 0) - int(load.get("missing") or 0)


def _plain_part_of(plain: dict[str, Any], prefixed: dict[str, Any]) -> bool:
    """Whether a state dict saved without the "module." prefix holds the model of a prefixed one, or a part of it
    (a backbone): its first keys are the prefixed dict's first keys with one common prefix removed
    ("module." or "module.backbone.")."""
    mine, theirs = plain.get("first_keys") or [], prefixed.get("first_keys") or []
    if not mine or not theirs or int(plain.get("keys") or 0) > int(prefixed.get("keys") or 0):
        return False
    head = theirs[0]
    if not head.endswith("." + mine[0]) or not head.startswith("module."):
        return False
    prefix = head[: len(head) - len(mine[0])]
    pairs = list(zip(mine, theirs))
    return len(pairs) >= min(2, len(mine)) and all(t == prefix + m for m, t in pairs)
