"""Scaffold a new rule: the package, its fixtures, its test and its row in the contract.

    python -m ddpdoctor.dev.new_rule DD110 --static --probe              # a row SPEC lists as pending
    python -m ddpdoctor.dev.new_rule DD123 some-name --probe --severity low --summary "..."
    python -m ddpdoctor.dev.new_rule DD110 --static --probe --dry-run    # print what would change

Creates, in the checkout that holds this file:

    ddpdoctor/rules/ddNNN_<name>/__init__.py     CODE, RULE = Rule(...): the documentation to write
    ddpdoctor/rules/ddNNN_<name>/static.py       (--static) check(script) to write
    ddpdoctor/rules/ddNNN_<name>/probe.py        (--probe) analyze(ctx) to write
    fixtures/static/DDNNN/{bad,good}_<name>.py   (--static) the bad one carries `# expect: DDNNN`
    fixtures/probe/ddNNN/{bad,good}_<name>.py    (--probe) 2-rank scripts: tests/test_probe_rule_fixtures.py
                                                 holds the probe to firing on bad_*, silent on good_*

and edits `ddpdoctor/rules/__init__.py` (the package in `NAMES`, code order), the contract's rule table in
`docs/contract.md` (the row no longer pending, or added: the tests read the contract from there), the README
rule table and, for a rule with both halves, the index of the rules' evidence (`ddpdoctor/dev/evidence.py`: no
recorded run yet that clears or confirms its static suspicion, tests/test_measured.py). The templates follow
CONTRIBUTING and the fixtures trip no other rule (tests/test_new_rule.py runs every static rule over them).

What it writes is a start that fails the tests until it is filled in — the documentation says TODO (the catalog
test rejects that), the bad static fixture expects a finding the generated check() never yields,
tests/test_probe_rule_fixtures.py expects a finding on the bad probe script — so a half-written rule cannot land
green.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ddpdoctor.errors import UsageError
from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import CATEGORIES

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class NewRule:
    code: str
    name: str
    severity: Severity
    summary: str
    static: bool
    probe: bool

    @property
    def package(self) -> str:
        return f"{self.code.lower()}_{self.name.replace('-', '_')}"

    @property
    def stem(self) -> str:
        return self.name.replace("-", "_")


# ------------------------------------------------------------------------------------------------ templates


def _init(r: NewRule) -> str:
    what = []
    if r.static:
        what.append("Static analysis looks for TODO: the construct in the source, through any import alias.")
    if r.probe:
        what.append("The probe records TODO: what it measures on the ranks, and fires when TODO.")
    paragraphs = "\n\n".join(f"        {p}" for p in what)
    context = '''
    # what the example assumes and does not show, `...` where each half goes (tests/test_rule_examples.py runs
    # static analysis on both halves: the Bad one must trigger the rule, the Good one must not)
    example_context=snippet(
        """
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        ...
        """
    ),''' if r.static else ""
    return f'''"""{r.code} {r.name}: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "{r.code}"

# The rule's thresholds: a module constant each, declared in `settings=(Setting(name, CONSTANT, unit, meaning),)`
# below (import Setting from ddpdoctor.rules.rule); code outside this package reads them with
# ddpdoctor.rules.setting(name).

RULE = Rule(
    package=__name__,
    code=CODE,
    name="{r.name}",
    severity=Severity.{r.severity.name},
    summary="{r.summary}",
    what=prose(
        """
{paragraphs}
        """
    ),
    why=prose(
        """
        TODO: why it hurts accuracy, the mechanism, with the measured numbers (docs/facts.md) where there are any.
        """
    ),
    example=snippet(
        """
        # Bad: TODO

        # Good: TODO
        """
    ),{context}
    fix="TODO: a short imperative (a finding's fix and the SARIF fix title).",
)
'''


def _static(r: NewRule) -> str:
    return f'''"""{r.code} {r.name}: TODO one line.

What it flags: TODO.

What stays silent: TODO (the close variants that are correct: they become good_* fixtures).

Confidence: certain from syntax; likely when inferred through names or aliases; possible when heuristic.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.{r.package} import CODE
from ddpdoctor.static.model import ScriptModel


def check(script: ScriptModel) -> Iterator[Finding]:
    for ev in script.of("TODO: the event kinds of the semantic model this rule reads"):
        yield script.finding(
            CODE,
            line=ev,  # the event, not its .line: it may be in a module the script imports
            message="TODO: one sentence, with what the source says (another place: script.place(other, near=ev))",
            confidence=Confidence.CERTAIN,
            evidence={{}},
        )
'''


def _probe(r: NewRule, *, with_static: bool = False) -> str:
    measures = '''

# what the run shows of the condition static.py suspects (tests/test_measured.py requires it of a rule with both
# halves): call ctx.measured(CODE, site=..., reason="the numbers") where the run settled it, found or not (no finding
# there drops the static suspicion with that note), and ctx.not_measured(CODE, site=..., reason="why") where it could
# not (the code did not run)
MEASURES = Measures(scope="site", what="TODO: what the probe reads of the condition, in the user's words")
''' if with_static else ""
    imports = "Finding, Measures" if with_static else "Finding"
    return f'''"""{r.code} {r.name}: TODO one line.

What it does: TODO: the events it reads (ddpdoctor/events.py documents every kind; a new measurement needs a
recorder and a documented kind) and when it fires.
"""

from __future__ import annotations

from ddpdoctor.analyses.context import RunContext
from ddpdoctor.findings import {imports}
from ddpdoctor.rules.{r.package} import CODE
{measures}

def analyze(ctx: RunContext) -> list[Finding]:
    findings: list[Finding] = []
    for rank, events in ctx.rank_events("TODO: the event kind this rule reads").items():
        for ev in events:
            findings.append(
                ctx.finding(
                    CODE,
                    message="TODO: one sentence with the measured numbers",
                    site=ev.get("site"),
                    ranks=[rank],
                    evidence={{}},
                )
            )
    return findings
'''


def _static_fixture(r: NewRule, bad: bool) -> str:
    doc = f"TODO: the pattern this fixture reproduces ({r.code} must {'fire on' if bad else 'stay silent on'} it)."
    mark = f"  # expect: {r.code}" if bad else ""
    todo = "the rule flags; keep the expect comment on the offending line" if bad else "that is right"
    return f'''"""{doc}"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    dist.init_process_group("gloo")
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    sampler = DistributedSampler(data)
    # the global batch stays the single-process recipe's 32, so its lr stays right (DD401)
    loader = DataLoader(data, batch_size=32 // dist.get_world_size(), sampler=sampler)
    model = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            # TODO: write the code {todo}
            opt.step(){mark}


if __name__ == "__main__":
    main()
'''


def _probe_fixture(r: NewRule, bad: bool) -> str:
    what = "the bug it detects" if bad else "the correct counterpart of that bug"
    verb = "fire on" if bad else "stay silent on"
    return f'''"""TODO: the pattern this fixture reproduces; {r.code} must {verb} it."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
sampler = DistributedSampler(data, shuffle=True)
loader = DataLoader(data, batch_size=16 // dist.get_world_size(), sampler=sampler)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.05)  # the recipe's lr: the global batch is the recipe's 16 (DD401)
# TODO: write {what} ({r.code})
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
dist.destroy_process_group()
'''


# ------------------------------------------------------------------------------------------------ edits


def _insert_sorted(text: str, start: str, end: str, line: str, key: re.Pattern[str]) -> str:
    """Insert `line` into the block of lines between the line `start` and the next line `end`, keeping the block's
    lines ordered by the first group of `key`."""
    lines = text.split("\n")
    try:
        a = lines.index(start)
        b = lines.index(end, a + 1)
    except ValueError:
        raise UsageError(f"cannot find the block {start!r} ... {end!r} to edit") from None
    new_key = key.match(line).group(1)  # type: ignore[union-attr]
    at = b
    for i in range(a + 1, b):
        m = key.match(lines[i])
        if m and m.group(1) > new_key:
            at = i
            break
    lines.insert(at, line)
    return "\n".join(lines)


def _registry(text: str, r: NewRule) -> str:
    key = re.compile(r'^    "(dd\d{3})_\w+",$')
    return _insert_sorted(text, "NAMES: tuple[str, ...] = (", ")", f'    "{r.package}",', key)


def _contract_page(text: str, r: NewRule) -> str:
    """docs/contract.md: the rule's row no longer pending (a half SPEC lists and the rule lacks stays pending)."""
    yes = {True: "yes", False: "–"}
    lines = text.split("\n")
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == r.code:
            spec = (cells[3] == "yes", cells[4] == "yes")
            halves = (("static", spec[0], r.static), ("probe", spec[1], r.probe))
            missing = [h for h, want, have in halves if want > have]
            status = f" {missing[0]} half pending " if missing else " "
            lines[i] = f"| {r.code} | {r.name} | {r.severity.label} | {yes[spec[0]]} | {yes[spec[1]]} |{status}|"
            return "\n".join(lines)
    row = f"| {r.code} | {r.name} | {r.severity.label} | {yes[r.static]} | {yes[r.probe]} | |"
    return _insert_sorted(text, "|---|---|---|---|---|---|", "", row, re.compile(r"^\| (DD\d{3}) \|"))


def _readme(text: str, r: NewRule) -> str:
    cell = r.summary.replace("\\", "\\\\").replace("|", "\\|")
    row = (f"| {r.code} | {r.name} | {r.severity.label} | {'yes' if r.static else '–'} | "
           f"{'yes' if r.probe else '–'} | {cell} |")
    return _insert_sorted(text, "|---|---|---|---|---|---|", "<!-- rules:end -->", row, re.compile(r"^\| (DD\d{3}) \|"))


def _evidence(text: str, r: NewRule) -> str:
    """ddpdoctor/dev/evidence.py: a rule with both halves has no recorded run yet that clears or confirms its static
    suspicion (tests/test_measured.py holds it to one of each, or to the reason why not)."""
    key = re.compile(r'^    "(DD\d{3})":')
    for table, reason in (("PENDING_CLEARED", "NO_CLEARED_RUN_YET"), ("PENDING_CONFIRMED", "NO_CONFIRMED_RUN_YET")):
        text = _insert_sorted(text, f"{table}: dict[str, str] = {{", "}", f'    "{r.code}": {reason},', key)
    return text


def _pending(contract: str) -> dict[str, tuple[str, str, bool, bool]]:
    """The rows of docs/contract.md's rule table whose status is `pending`: code -> (name, severity, static,
    probe)."""
    out = {}
    for line in contract.split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"DD\d{3}", cells[0]) and cells[5] == "pending":
            out[cells[0]] = (cells[1], cells[2], cells[3] == "yes", cells[4] == "yes")
    return out


# ------------------------------------------------------------------------------------------------ the command


def plan(code: str, name: str | None, *, static: bool, probe: bool, severity: str | None, summary: str | None,
         root: Path = REPO) -> tuple[NewRule, dict[Path, str], list[str]]:
    """(the rule, every file's new text by path, warnings). Writes nothing."""
    code = code.strip().upper()
    if not re.fullmatch(r"DD\d{3}", code) or code[2] not in CATEGORIES:
        raise UsageError(f"{code}: a rule code is DD + 3 digits, first digit one of {', '.join(sorted(CATEGORIES))}")
    if not (static or probe):
        raise UsageError("say which halves the rule has: --static, --probe or both")
    page = root / "docs" / "contract.md"
    contract = page.read_text(encoding="utf-8")
    warnings: list[str] = []
    pending = _pending(contract).get(code)
    if pending is not None:
        if name is not None and name != pending[0]:
            raise UsageError(f"{code} is {pending[0]!r} in the contract (docs/contract.md, pending), not {name!r}")
        name = pending[0]
        severity = severity or pending[1]
        if (static, probe) != pending[2:]:
            warnings.append(f"the contract gives {code} static={pending[2]} probe={pending[3]}: the catalog test will "
                            "say so until the halves match (or mark the missing one `<half> half pending` in "
                            "docs/contract.md)")
    elif name is None:
        raise UsageError(f"{code} is not a pending row of the contract: give its name")
    else:
        warnings.append(f"{code} is not in SPEC's table: the contract test fails until the row is added there")
    if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name):
        raise UsageError(f"{name!r}: a rule name is lower-case words joined by '-'")
    try:
        sev = Severity.parse(severity or "")
    except ValueError as exc:
        raise UsageError(f"--severity: {exc}") from None
    r = NewRule(code, name, sev, (summary or "TODO: one line, what triggers it").replace('"', "'"), static, probe)
    pkg_dir = root / "ddpdoctor" / "rules" / r.package
    if any(d.name.startswith(code.lower() + "_") for d in (root / "ddpdoctor" / "rules").iterdir()):
        raise UsageError(f"{code} already has a package in ddpdoctor/rules/")
    files: dict[Path, str] = {pkg_dir / "__init__.py": _init(r)}
    if static:
        files[pkg_dir / "static.py"] = _static(r)
        for bad in (True, False):
            path = root / "fixtures" / "static" / code / f"{'bad' if bad else 'good'}_{r.stem}.py"
            files[path] = _static_fixture(r, bad)
    if probe:
        files[pkg_dir / "probe.py"] = _probe(r, with_static=static)
        for bad in (True, False):
            path = root / "fixtures" / "probe" / code.lower() / f"{'bad' if bad else 'good'}_{r.stem}.py"
            files[path] = _probe_fixture(r, bad)
    registry = root / "ddpdoctor" / "rules" / "__init__.py"
    readme = root / "README.md"
    index = root / "ddpdoctor" / "dev" / "evidence.py"
    files[registry] = _registry(registry.read_text(encoding="utf-8"), r)
    files[readme] = _readme(readme.read_text(encoding="utf-8"), r)
    files[page] = _contract_page(contract, r)
    if static and probe:
        files[index] = _evidence(index.read_text(encoding="utf-8"), r)
    for path in files:
        if path not in (registry, readme, page, index) and path.exists():
            raise UsageError(f"{path.relative_to(root)} exists already")
    return r, files, warnings


def diff_stat(files: dict[Path, str], root: Path = REPO) -> str:
    """`git diff --stat`-like lines: path | +added -removed."""
    out = []
    total_add = total_del = 0
    for path, new in sorted(files.items()):
        old = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        diff = list(difflib.unified_diff(old, new.splitlines(), lineterm="", n=0))
        add = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
        rem = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
        total_add, total_del = total_add + add, total_del + rem
        state = "modified" if path.exists() else "new"
        out.append(f" {str(path.relative_to(root)):<56} {state:>8}  +{add} -{rem}")
    out.append(f" {len(files)} files changed, {total_add} insertions(+), {total_del} deletions(-)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpdoctor.dev.new_rule",
        description="Scaffold a rule package, its fixtures, its test and its contract row.",
        epilog=textwrap.dedent(__doc__.split("\n\n", 2)[1]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("code", help="DDNNN")
    parser.add_argument("name", nargs="?", help="lower-case-words (default: the contract's pending row)")
    parser.add_argument("--static", action="store_true", help="the rule has a static half (static.py)")
    parser.add_argument("--probe", action="store_true", help="the rule has a probe half (probe.py)")
    parser.add_argument("--severity", help="default severity (default: the contract's pending row)")
    parser.add_argument("--summary", help="the one-line summary (SPEC's 'what triggers it')")
    parser.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    ns = parser.parse_args(argv)
    try:
        r, files, warnings = plan(ns.code, ns.name, static=ns.static, probe=ns.probe, severity=ns.severity,
                                  summary=ns.summary)
    except UsageError as exc:
        sys.stderr.write(f"new_rule: error: {exc}\n")
        return 2
    print(f"{'would scaffold' if ns.dry_run else 'scaffolded'} {r.code} {r.name} ({r.severity.label}; "
          f"{' + '.join(h for h, on in (('static', r.static), ('probe', r.probe)) if on)}):")
    print(diff_stat(files))
    for w in warnings:
        print(f"note: {w}")
    if not ns.dry_run:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        print("next: write the TODOs (make test-fast shows what is left), then CONTRIBUTING.md 'Adding a rule'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
