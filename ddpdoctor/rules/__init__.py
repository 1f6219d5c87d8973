"""The rules: one package per code, listed once in `PACKAGES`. Everything about a rule lives in its package.

    ddpdoctor/rules/dd301_sampler_not_reshuffled/
        __init__.py   CODE, RULE = Rule(...): name, severity, summary, the four-part documentation, the fix;
                      the rule's parameters (thresholds) as module constants, imported from here by whoever
                      needs them
        static.py     check(script: ScriptModel) -> Iterator[Finding]    (found from the source)
        probe.py      analyze(ctx: RunContext) -> list[Finding]          (found from a recorded run)

A rule has the hooks it has: "found by static analysis / the probe" (`Rule.static`, `Rule.probe`, the catalog
columns, `explain`) is derived from which of `static.py` / `probe.py` exist, never declared. Findings are built
with `ScriptModel.finding` / `RunContext.finding`, which both go through `ddpdoctor.findings.new_finding`: severity
and fix text come from the rule. `ddpdoctor rules`, `ddpdoctor explain`, the README rule table and SARIF
`tool.driver.rules` are generated from `RULES`. Codes are stable forever; a retired code is never reused.

Adding a rule: `python -m ddpdoctor.dev.new_rule` (see CONTRIBUTING.md), or by hand: the package, a line in
`PACKAGES` (code order), fixtures.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from types import ModuleType

from ddpdoctor.rules import (
    dd101_sync_bn_after_ddp,
    dd102_forward_bypasses_ddp,
    dd103_replicas_diverged,
    dd104_hardcoded_rank,
    dd105_device_not_bound,
    dd106_data_parallel,
    dd107_moved_after_wrap,
    dd108_legacy_local_rank_arg,
    dd109_single_node_world_size,
    dd110_model_not_wrapped,
    dd201_bn_stats_diverge,
    dd202_small_bn_batch,
    dd203_non_iid_shards,
    dd204_syncbn_large_batch,
    dd205_syncbn_needs_cuda,
    dd206_collective_on_subset,
    dd207_eval_in_train_mode,
    dd208_conversion_changed_function,
    dd209_bn_type_check_misses_syncbn,
    dd210_frozen_bn_unfrozen,
    dd211_syncbn_stats_wrong,
    dd212_syncbn_scope,
    dd213_stale_running_stats,
    dd214_bn_train_test_inconsistency,
    dd215_micro_batch_bn,
    dd216_bn_params_not_trained,
    dd301_sampler_not_reshuffled,
    dd302_missing_distributed_sampler,
    dd303_eval_sampler_padding,
    dd304_identical_rng_streams,
    dd305_dataset_differs_across_ranks,
    dd306_uneven_batches,
    dd401_lr_not_scaled,
    dd402_no_warmup,
    dd403_accumulation_without_no_sync,
    dd404_grads_reduced_twice,
    dd405_no_learning_signal,
    dd406_non_finite,
    dd501_module_prefix_checkpoint,
    dd502_save_on_every_rank,
    dd503_non_strict_load,
    dd504_unreduced_metric,
    dd901_probe_hang,
    dd902_rank_failed,
    dd903_not_distributed,
    dd904_nothing_observed,
)
from ddpdoctor.rules.rule import CATEGORIES, HOOKS, Rule

__all__ = ["CATEGORIES", "PACKAGES", "RULES", "Rule", "catalog_markdown_table", "get_rule", "hooks", "select_codes"]

# Code order. The one list of rules: the catalog, the static rules and the probe analyses all come from it.
PACKAGES: tuple[ModuleType, ...] = (
    dd101_sync_bn_after_ddp,
    dd102_forward_bypasses_ddp,
    dd103_replicas_diverged,
    dd104_hardcoded_rank,
    dd105_device_not_bound,
    dd106_data_parallel,
    dd107_moved_after_wrap,
    dd108_legacy_local_rank_arg,
    dd109_single_node_world_size,
    dd110_model_not_wrapped,
    dd201_bn_stats_diverge,
    dd202_small_bn_batch,
    dd203_non_iid_shards,
    dd204_syncbn_large_batch,
    dd205_syncbn_needs_cuda,
    dd206_collective_on_subset,
    dd207_eval_in_train_mode,
    dd208_conversion_changed_function,
    dd209_bn_type_check_misses_syncbn,
    dd210_frozen_bn_unfrozen,
    dd211_syncbn_stats_wrong,
    dd212_syncbn_scope,
    dd213_stale_running_stats,
    dd214_bn_train_test_inconsistency,
    dd215_micro_batch_bn,
    dd216_bn_params_not_trained,
    dd301_sampler_not_reshuffled,
    dd302_missing_distributed_sampler,
    dd303_eval_sampler_padding,
    dd304_identical_rng_streams,
    dd305_dataset_differs_across_ranks,
    dd306_uneven_batches,
    dd401_lr_not_scaled,
    dd402_no_warmup,
    dd403_accumulation_without_no_sync,
    dd404_grads_reduced_twice,
    dd405_no_learning_signal,
    dd406_non_finite,
    dd501_module_prefix_checkpoint,
    dd502_save_on_every_rank,
    dd503_non_strict_load,
    dd504_unreduced_metric,
    dd901_probe_hang,
    dd902_rank_failed,
    dd903_not_distributed,
    dd904_nothing_observed,
)

RULES: tuple[Rule, ...] = tuple(p.RULE for p in PACKAGES)

_BY_CODE = {r.code: r for r in RULES}


def get_rule(code: str) -> Rule:
    """The rule for a code (case-insensitive); KeyError for an unknown code."""
    try:
        return _BY_CODE[code.strip().upper()]
    except KeyError:
        raise KeyError(f"unknown rule code {code!r}") from None


@lru_cache(maxsize=None)
def hooks(kind: str) -> tuple[ModuleType, ...]:
    """The `static` or `probe` hook modules of every rule that has one, in code order (imported on first use,
    so reading the catalog never imports the analysis code)."""
    if kind not in HOOKS:
        raise ValueError(f"unknown hook {kind!r}")
    return tuple(importlib.import_module(f"{r.package}.{kind}") for r in RULES if getattr(r, kind))


def select_codes(patterns: list[str] | tuple[str, ...]) -> set[str]:
    """Codes matched by prefix patterns (`DD3` = all data rules). Raises ValueError on a pattern matching none."""
    chosen: set[str] = set()
    for pat in patterns:
        p = pat.strip().upper()
        if not p:
            continue
        hits = {c for c in _BY_CODE if c.startswith(p)}
        if not hits:
            raise ValueError(f"unknown rule or prefix {pat!r}")
        chosen |= hits
    return chosen


def _md_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def catalog_markdown_table() -> str:
    """The README's rule table (between `<!-- rules:start -->` and `<!-- rules:end -->`), generated from `RULES`
    so the two cannot drift apart; a test compares them."""
    lines = [
        "| code | name | default severity | static | probe | summary |",
        "|---|---|---|---|---|---|",
    ]
    for r in RULES:
        lines.append(
            f"| {r.code} | {_md_cell(r.name)} | {r.severity.label} | {'yes' if r.static else '–'} | "
            f"{'yes' if r.probe else '–'} | {_md_cell(r.summary)} |"
        )
    return "\n".join(lines) + "\n"
