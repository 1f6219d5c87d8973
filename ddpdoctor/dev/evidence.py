"""One index of each rule's evidence: where its fixtures, recorded runs and golden reports are. The tests read it
(one place), the scaffolder (ddpdoctor.dev.new_rule) writes a new rule's entry, and a contributor prints it:

    .venv/bin/python -m ddpdoctor.dev.evidence DD301        # one rule's evidence, and the tests that read it
    .venv/bin/python -m ddpdoctor.dev.evidence              # every rule, one line each

What a file's place says is derived here, once, from the layout CONTRIBUTING describes:

    fixtures/static/DDNNN/{bad,good}_*.py    static fixtures: `# expect: DDNNN` on a bad one's line
                                             (tests/test_static_fixtures.py)
    fixtures/probe/ddnnn/{bad,good}_*.py     probe fixtures, run on 2 ranks (tests/test_probe_rule_fixtures.py)
    fixtures/projects/<project>/             projects whose files say `# expect: DDNNN` (tests/test_static_projects.py)
    fixtures/measured/ddnnn_*.py             scripts whose recorded runs measure what both halves see
    fixtures/runs/<run>/                     recorded runs (a directory with meta.json), each pinned by
    tests/golden/reports/<run>.{txt,json}    its golden reports (tests/test_report_pins.py); a run is evidence of
                                             the rules its golden JSON report names

What no place says is declared here: for a rule with both halves, the recorded run in which the probe measured
absent what static analysis suspected (CLEARED) and the one in which it found it (CONFIRMED), or why there is
none yet (PENDING_*); tests/test_measured.py holds every rule with both halves to them.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
STATIC_FIXTURES = FIXTURES / "static"
PROBE_FIXTURES = FIXTURES / "probe"
PROJECTS = FIXTURES / "projects"
MEASURED_FIXTURES = FIXTURES / "measured"
RUNS = FIXTURES / "runs"
GOLDEN = REPO / "tests" / "golden" / "reports"
GOLDEN_FORMATS = {"text": "txt", "json": "json"}  # report format -> the golden file's suffix

# rule -> the recorded run where static analysis suspected the condition below `certain` and the probe measured it
# absent (the static finding is dropped, with a note giving the numbers)
CLEARED: dict[str, str] = {
    "DD106": "measured_dd106_dataparallel_branch_not_taken",
    "DD108": "probe_legacy_local_rank_device_from_rank",
    "DD110": "measured_dd110_wrap_under_launcher_condition",
    "DD207": "probe_precise_bn",
    "DD206": "measured_dd206_ddp_forward_on_every_rank",
    "DD209": "measured_dd209_exact_class_before_conversion",
    "DD303": "data_synthetic_unseeded",
    "DD401": "measured_dd401_optimizer_branch_not_taken",
    "DD402": "measured_dd402_lr_scaled_down",
    "DD403": "measured_dd403_accumulation_off",
    "DD404": "measured_dd404_manual_sync_flag_off",
    "DD216": "measured_dd216_converter_reuses_parameters",
    "DD502": "measured_dd502_save_guarded_by_rank_string",
    "DD503": "ckpt_save_rank0",
}
# rule -> the recorded run where the probe found what static analysis suspected: one finding, static and probe
CONFIRMED: dict[str, str] = {
    "DD101": "probe_cuda_syncbn_after_wrap",
    "DD102": "probe_forward_bypass",
    "DD104": "probe_hardcoded_rank",
    "DD105": "probe_device_not_bound",
    "DD106": "styles_dataparallel_bad",
    "DD108": "probe_legacy_local_rank",
    "DD110": "probe_model_not_wrapped",
    "DD205": "bn_syncbn_cpu",
    "DD206": "bn_rank0_eval_hang",
    "DD207": "probe_momentum_encoder_eval_bug",
    "DD209": "measured_dd209_exact_class_after_conversion",
    "DD216": "measured_dd216_converter_clones_parameters",
    "DD301": "probe_missing_set_epoch",
    "DD302": "probe_no_distributed_sampler",
    "DD303": "data_seeded_augment",
    "DD401": "measured_dd401_optimizer_branch_taken",
    "DD402": "measured_dd402_lr_scaled_up",
    "DD403": "optim_accumulate_hand_reduce",
    "DD404": "optim_accumulate_hand_reduce",
    "DD501": "ckpt_save_every_rank",
    "DD502": "ckpt_save_every_rank",
    "DD503": "ckpt_save_every_rank",
    "DD504": "styles_horovod_bad",
}

# Rules with both halves whose measurement a recorded run does not hold yet, and why. Empty it, don't grow it: a
# rule's MEASURES code path without a recorded run that exercises it is untested.
NO_CLEARED_RUN_YET = ("no recorded run yet where static analysis suspects it below certain and the probe measures it "
                      "absent")
NO_CONFIRMED_RUN_YET = "no recorded run yet where the probe finds what static analysis suspects"
PENDING_CLEARED: dict[str, str] = {
    "DD101": NO_CLEARED_RUN_YET,
    "DD102": NO_CLEARED_RUN_YET,
    "DD104": NO_CLEARED_RUN_YET,
    "DD105": NO_CLEARED_RUN_YET,
    "DD109": "one node with one process per emulated GPU cannot show a device-count world size wrong; a clearance "
             "needs a world size passed that is not the device count",
    "DD205": NO_CLEARED_RUN_YET,
    "DD301": NO_CLEARED_RUN_YET,
    "DD302": NO_CLEARED_RUN_YET,
    "DD501": NO_CLEARED_RUN_YET,
    "DD504": NO_CLEARED_RUN_YET,
    "DD904": "static DD904 fires below certain on an unknown trainer of an installed package; none that trains "
             "through torch.optim without ddpdoctor modelling it is installed with the test extra",
}
PENDING_CONFIRMED: dict[str, str] = {
    "DD109": "a confirmation needs a launch across nodes or --nproc unlike the GPU count (tests/test_rule_dd109.py)",
    "DD904": "static DD904 names an engine not modelled (DeepSpeed); none is installed with the test extra to run "
             "under the probe without a step",
}

_EXPECT = re.compile(r"#\s*expect:\s*(?P<codes>[A-Z0-9(),\s a-z]+)$")
_EXPECTED = re.compile(r"(DD\d{3})(?:\((certain|likely|possible)\))?")


def expectations(path: Path) -> dict[tuple[str, int], str | None]:
    """(rule, line) -> the confidence expected (None: any), from a fixture's `# expect: DDNNN` / `DDNNN(likely)`
    comments: what tests/test_static_fixtures.py and tests/test_static_projects.py hold static analysis to."""
    out: dict[tuple[str, int], str | None] = {}
    for lineno, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        m = _EXPECT.search(text)
        if m:
            for code, confidence in _EXPECTED.findall(m.group("codes")):
                out[(code, lineno)] = confidence or None
    return out


def expected_codes(path: Path) -> set[str]:
    return {code for code, _ in expectations(path)}


def static_fixtures() -> list[Path]:
    """Every script under fixtures/static/ (the rule folders and the shared ones: scripts/, frameworks/)."""
    return sorted(STATIC_FIXTURES.rglob("*.py"))


def static_fixtures_of(code: str) -> list[Path]:
    return sorted((STATIC_FIXTURES / code.upper()).glob("*.py"))


def probe_fixtures(code: str | None = None) -> list[Path]:
    """The bad_*/good_* scripts of fixtures/probe/ddnnn/ (of one rule, or of every rule)."""
    folders = [PROBE_FIXTURES / code.lower()] if code else sorted(PROBE_FIXTURES.glob("dd[0-9][0-9][0-9]"))
    return sorted(p for d in folders if d.is_dir() for p in d.glob("*.py") if re.match(r"(bad|good)_", p.name))


def projects() -> list[Path]:
    return sorted(p for p in PROJECTS.iterdir() if p.is_dir())


def project_fixtures_of(code: str) -> list[Path]:
    """The files of fixtures/projects/ whose `# expect:` comments name the rule."""
    return [p for project in projects() for p in sorted(project.rglob("*.py")) if code in expected_codes(p)]


def measured_fixtures_of(code: str) -> list[Path]:
    return sorted(MEASURED_FIXTURES.glob(f"{code.lower()}_*.py"))


def recorded_runs() -> list[Path]:
    """Every recorded run a golden report pins: a directory of fixtures/runs/ with a meta.json."""
    return sorted(p for p in RUNS.iterdir() if (p / "meta.json").is_file())


def golden(run: Path | str, fmt: str) -> Path:
    """The golden report of a recorded run in a format ("text" or "json")."""
    return GOLDEN / f"{Path(run).name}.{GOLDEN_FORMATS[fmt]}"


def _codes_in(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        if isinstance(value.get("rule"), str):
            yield value["rule"]
        for v in value.values():
            yield from _codes_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from _codes_in(v)


@lru_cache(maxsize=None)
def _runs_by_rule() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for run in recorded_runs():
        path = golden(run, "json")
        if not path.is_file():
            continue
        findings = json.loads(path.read_text(encoding="utf-8")).get("findings") or []
        for code in sorted(set(_codes_in(findings))):
            out.setdefault(code, []).append(run.name)
    return {code: tuple(runs) for code, runs in out.items()}


def runs_of(code: str) -> list[Path]:
    """The recorded runs whose golden JSON report names the rule (a finding, or one folded under another)."""
    return [RUNS / name for name in _runs_by_rule().get(code.upper(), ())]


@dataclass(frozen=True)
class Evidence:
    """One rule's evidence, by kind (paths in this checkout)."""

    code: str
    static: tuple[Path, ...]  # fixtures/static/DDNNN/
    probe: tuple[Path, ...]  # fixtures/probe/ddnnn/
    projects: tuple[Path, ...]  # files of fixtures/projects/ that expect it
    measured: tuple[Path, ...]  # fixtures/measured/ddnnn_*.py
    cleared: str | None  # the recorded run that drops its static suspicion (CLEARED), else why none (PENDING)
    confirmed: str | None
    runs: tuple[Path, ...]  # recorded runs whose golden report names it
    goldens: tuple[Path, ...]  # their golden reports

    def paths(self) -> list[Path]:
        return [*self.static, *self.probe, *self.projects, *self.measured, *self.runs, *self.goldens]


def evidence(code: str) -> Evidence:
    code = code.upper()
    runs = tuple(runs_of(code))
    return Evidence(
        code=code,
        static=tuple(static_fixtures_of(code)),
        probe=tuple(probe_fixtures(code)),
        projects=tuple(project_fixtures_of(code)),
        measured=tuple(measured_fixtures_of(code)),
        cleared=CLEARED.get(code) or PENDING_CLEARED.get(code),
        confirmed=CONFIRMED.get(code) or PENDING_CONFIRMED.get(code),
        runs=runs,
        goldens=tuple(golden(run, fmt) for run in runs for fmt in GOLDEN_FORMATS),
    )


def index() -> dict[str, Evidence]:
    """Every rule of the catalog's evidence, in code order."""
    from ddpdoctor.rules import RULES

    return {r.code: evidence(r.code) for r in RULES}


# ------------------------------------------------------------------------------------------------ the command


def _show(e: Evidence) -> str:
    def rel(p: Path) -> str:
        return str(p.relative_to(REPO))

    lines = [e.code]
    for label, paths, test in (
        ("static fixtures", e.static, "tests/test_static_fixtures.py"),
        ("probe fixtures", e.probe, "tests/test_probe_rule_fixtures.py"),
        ("project files", e.projects, "tests/test_static_projects.py"),
        ("measured fixtures", e.measured, "recorded as fixtures/runs/measured_*"),
        ("recorded runs", e.runs, "tests/test_report_pins.py, with their golden reports"),
    ):
        if paths:
            lines.append(f"  {label} ({test}):")
            lines += [f"    {rel(p)}" for p in paths]
    for label, value in (("cleared by", e.cleared), ("confirmed by", e.confirmed)):
        if value:
            lines.append(f"  {label} (tests/test_measured.py): {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    entries = index()
    if not argv:
        for code, e in entries.items():
            print(f"{code}: {len(e.static)} static, {len(e.probe)} probe, {len(e.projects)} project, "
                  f"{len(e.measured)} measured fixtures; {len(e.runs)} recorded runs")
        return 0
    unknown = [c for c in argv if c.upper() not in entries]
    if unknown:
        sys.stderr.write(f"evidence: error: no rule {', '.join(unknown)} in the catalog\n")
        return 2
    print("\n\n".join(_show(entries[c.upper()]) for c in argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
