"""`Rule`: what every rule declares in its package's `__init__.py` (see `ddpdoctor.rules` for the layout).

Each rule is documented in four parts, in the spirit of ruff's rule pages: `what` it detects (what static analysis
looks for, what the probe measures), `why` it hurts accuracy (the mechanism), an `example` (the bad code, then the
corrected code, as one Python snippet) and the `fix` (a short imperative, used as a finding's fix and as the SARIF
fix title). Prose is written as wrapped paragraphs in the source and re-flowed by `prose`, so the stored text has
one line per paragraph and every renderer wraps it to its own width.

Whether a rule is found by static analysis, by the probe or both is not declared: it is which hooks its package
has (`static.py`, `probe.py`), so the documentation cannot claim a half that does not exist.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import sys
import textwrap
from functools import lru_cache
from typing import Any, Mapping

from ddpdoctor.levels import Severity
from ddpdoctor.plain import FrozenRecord

CATEGORIES = {
    "1": "setup",
    "2": "batchnorm",
    "3": "data",
    "4": "optimisation",
    "5": "checkpoints",
    "9": "probe",
}
HOOKS = ("static", "probe")
_CODE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

# What every rule's example may use without writing it: the imports (and a small BatchNorm network, `Net`) that a
# DDP training script has. `Rule.example_script` puts them before the example's context.
EXAMPLE_PRELUDE = """\
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))
"""


def _blank_lines_emptied(text: str) -> list[str]:
    """The lines of `text`, those of spaces and tabs only made empty (as `textwrap.dedent` does first)."""
    return [line if line.strip(" \t") else "" for line in text.split("\n")]


def prose(text: str) -> str:
    """Dedent a triple-quoted block and join each paragraph's source lines into one line.

    Every rule's documentation goes through here when the catalog is imported (each command, `check --static` in
    a pre-commit hook included): the lines are stripped one by one, so only the blank lines need what
    `textwrap.dedent` does to them, without its regular expressions."""
    paragraphs = "\n".join(_blank_lines_emptied(text)).strip().split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


# The set-up most examples' context starts with (one rank per GPU from torchrun, the model wrapped in DDP): a
# rule's `example_context` is DDP_SET_UP + its own lines when it needs just that.
DDP_SET_UP = """\
dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank)
torch.cuda.set_device(device)
model = Net().to(device)
ddp = DDP(model, device_ids=[local_rank])
"""


def snippet(text: str) -> str:
    """Dedent a triple-quoted code snippet, keeping its lines (`textwrap.dedent`, without its regular
    expressions)."""
    lines = _blank_lines_emptied(text)
    margin = os.path.commonprefix([line[: len(line) - len(line.lstrip(" \t"))] for line in lines if line])
    return "\n".join(line[len(margin) :] for line in lines).strip("\n")


class Setting(FrozenRecord):
    """A rule's parameter (a threshold, a tunable), declared once by the rule that owns it (`Rule.settings`).

    `name` is its one name everywhere (unique in the catalog; for an `option`, the `[tool.ddpdoctor]` key, the
    `--name` option, the run's meta.json key and the analyses' `Settings` field). `default` is the module constant
    the rule's code uses, `unit` what it counts, `meaning` what crossing it means. Code outside the rule packages
    reads it through the catalog (`ddpdoctor.rules.setting(name)`), never by importing a rule package.
    """

    __match_args__ = ("name", "default", "unit", "meaning", "option")
    name: str
    default: int | float
    unit: str
    meaning: str
    option: bool  # the user can change it (`[tool.ddpdoctor]`, the command line, the run records it)

    def __init__(self, name: str, default: int | float, unit: str, meaning: str, option: bool = False) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "default", default)
        object.__setattr__(self, "unit", unit)
        object.__setattr__(self, "meaning", meaning)
        object.__setattr__(self, "option", option)

    def line(self) -> str:
        """One line of a rule's documentation: `name = default unit: meaning`."""
        where = f" (`[tool.ddpdoctor] {self.name}`)" if self.option else ""
        return f"{self.name} = {self.default:g} {self.unit}: {self.meaning}{where}"


@lru_cache(maxsize=None)
def has_hook(package: str, hook: str) -> bool:
    """Whether the rule package has the module `hook` ("static" or "probe"), without importing either: looked up
    in the package's directory, so `hooks("static")` never imports a rule that has no static half."""
    if not package:
        return False
    parent, _, name = package.rpartition(".")
    where = [os.path.join(entry, name) for entry in sys.modules[parent].__path__] if parent else None
    return importlib.machinery.PathFinder.find_spec(hook, where) is not None


class Rule(FrozenRecord):
    """One rule: its catalog entry and documentation.

    `package` is the rule's package (`__name__` in its `__init__.py`): the hooks are found there. `fix` is the
    rule's fix; `fix_variants` are the fixes for situations the rule's fix does not name (a finding picks one by
    key, see `fix_text`; `{name}` fields are filled from the finding's `fix_args`). `run_only`: for a problem that
    makes a run crash, hang, run slower or puts its files at risk but cannot change what the ranks learn, why (a
    triage names such a cause as a row under both arms, never as where an accuracy regression is). `cost_note`:
    why the severity differs from what the measured cost (ddpdoctor/data/consequences.json) would give.
    """

    __match_args__ = ("package", "code", "name", "severity", "summary", "what", "why", "example", "fix",
                      "fix_variants", "fix_names", "run_only", "example_context", "settings", "cost_note")
    # compared and hashed: the entry, not its documentation's extras
    __compared__ = ("package", "code", "name", "severity", "summary", "what", "why", "example", "fix", "run_only")
    package: str
    code: str
    name: str
    severity: Severity
    summary: str
    what: str
    why: str
    example: str
    fix: str
    fix_variants: Mapping[str, str]
    # names in the fix that stand for one of the script's own objects: {name as written in `fix`: the evidence key
    # holding the script's name for it}. `Save ddp.module.state_dict()` becomes `Save model.module.state_dict()`
    # in a finding whose evidence says the wrapper is `model` (see `named`).
    fix_names: Mapping[str, str]
    run_only: str | None
    # The lines the example assumes and does not show (the names it uses, the training around it), written after
    # EXAMPLE_PRELUDE: each half of the example takes the place of the context's `...` line (indented as that
    # line), or follows the context where it has none. tests/test_rule_examples.py holds a static rule to its
    # example: static analysis of the Bad half's script finds the rule, of the Good half's does not. None: the
    # example shows a case only the probe can find (the rule's probe.py documents it; the static half's own cases
    # are in its fixtures).
    example_context: str | None
    # the rule's parameters (thresholds), each declared once here with its default, unit and meaning
    settings: tuple[Setting, ...]
    # why the severity is not what the measured accuracy cost on digits alone would give (the cost grows with the
    # number of ranks, or depends on what the defect touches): `tests/test_consequences.py` holds every other
    # rule's severity to the order of the costs measured by benchmarks/consequences/
    cost_note: str | None

    def __init__(
        self, *, package: str, code: str, name: str, severity: Severity, summary: str, what: str, why: str,
        example: str, fix: str, fix_variants: Mapping[str, str] | None = None,
        fix_names: Mapping[str, str] | None = None, run_only: str | None = None, example_context: str | None = "",
        settings: tuple[Setting, ...] = (), cost_note: str | None = None,
    ) -> None:
        for key, value in (
            ("package", package), ("code", code), ("name", name), ("severity", severity), ("summary", summary),
            ("what", what), ("why", why), ("example", example), ("fix", fix),
            ("fix_variants", {} if fix_variants is None else fix_variants),
            ("fix_names", {} if fix_names is None else fix_names), ("run_only", run_only),
            ("example_context", example_context), ("settings", settings), ("cost_note", cost_note),
        ):
            object.__setattr__(self, key, value)

    @property
    def static(self) -> bool:
        """Found by static analysis: the package has a `static.py` hook."""
        return has_hook(self.package, "static")

    @property
    def probe(self) -> bool:
        """Found by the probe: the package has a `probe.py` hook."""
        return has_hook(self.package, "probe")

    def fix_text(
        self, variant: str | None = None, args: Mapping[str, Any] | None = None, detail: str | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> str:
        """A finding's fix: the rule's fix, or the named variant (formatted with `args`), in the script's own names
        where the evidence holds them (`named`), then `detail` appended (a specialised detail adds to the rule's
        fix, it never replaces it)."""
        text = self.fix if variant is None else self.fix_variants[variant]
        if args:
            text = text.format(**args)
        text = self.named(text, evidence)
        return f"{text} {detail}" if detail else text

    def named(self, text: str, evidence: Mapping[str, Any] | None) -> str:
        """`text` with each of `fix_names` replaced by the script's name from the evidence, where the name is
        used as code (`ddp.module`, `ddp.no_sync()`, `DistributedSampler(dataset)`), and only when the evidence
        holds a plain (dotted) name."""
        for name, key in self.fix_names.items():
            value = (evidence or {}).get(key)
            if isinstance(value, str) and _CODE_NAME.fullmatch(value) and value != name:
                text = re.sub(rf"(?<![\w.]){re.escape(name)}(?=[.(\[,)])", value, text)
        return text

    def example_script(self, half: str) -> str:
        """The example's `half` ("bad" or "good") as a script: EXAMPLE_PRELUDE, the example's context with the
        half in place of its `...` line, the lines before the example's `# Bad` (imports both halves use) first."""
        bad = re.search(r"^# Bad", self.example, re.M)
        good = re.search(r"^# Good", self.example, re.M)
        if bad is None or good is None or half not in ("bad", "good"):
            raise ValueError(f"{self.code}: no {half!r} half in the example")
        shared = self.example[: bad.start()]
        body = self.example[bad.start() : good.start()] if half == "bad" else self.example[good.start() :]
        body = (shared + body).strip("\n")
        lines = (self.example_context or "").splitlines()
        at = next((i for i, line in enumerate(lines) if line.strip() == "..."), len(lines))
        indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())] if at < len(lines) else ""
        body = "\n".join(indent + line if line.strip() else line for line in body.splitlines())
        return "\n".join([EXAMPLE_PRELUDE, *lines[:at], body, *lines[at + 1 :]]) + "\n"

    @property
    def known_limits(self) -> str | None:
        """What the static half deliberately leaves silent: the "What stays silent:" paragraph of its `static.py`
        docstring (read from the file, not imported), re-flowed to one line; None without a static half."""
        if not self.static:
            return None
        import ast  # here, not at the top: the catalog is imported by every command, this only by `explain`

        spec = importlib.util.find_spec(f"{self.package}.static")
        with open(spec.origin, encoding="utf-8") as f:  # type: ignore[union-attr, arg-type]
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        for paragraph in doc.split("\n\n"):
            if paragraph.startswith("What stays silent:"):
                return prose(paragraph.removeprefix("What stays silent:"))
        return None

    @property
    def automatic_fix(self) -> bool:
        """`check --diff` / `--fix` can patch its findings: the package has a `fix.py` hook (where the code has the
        shape the fix needs; otherwise the finding says "no automatic fix")."""
        return has_hook(self.package, "fix")

    @property
    def _automatic_text(self) -> str:
        return ("Automatic: `check --diff` shows it as a patch, `check --fix` writes it to a new file (where the code "
                "has the shape the fix needs; the finding says when not)." if self.automatic_fix
                else "No automatic fix: the change needs a decision `check --diff` cannot make.")

    @property
    def category(self) -> str:
        return CATEGORIES[self.code[2]]

    @property
    def found_by(self) -> str:
        """"static analysis", "probe" or "static analysis, probe": how a finding of this rule can arise."""
        return ", ".join(label for label, on in (("static analysis", self.static), ("probe", self.probe)) if on)

    def documentation(self, width: int = 100) -> str:
        """The four-part documentation as plain text (`ddpdoctor explain`, SARIF `help.text`)."""

        def wrap(text: str) -> str:
            return "\n\n".join(
                textwrap.fill(p, width=width, break_long_words=False, break_on_hyphens=False)
                for p in text.split("\n\n")
            )

        limits = self.known_limits
        return (
            f"{self.code} {self.name}\n"
            f"default severity: {self.severity.label}; category: {self.category}; found by: {self.found_by}\n\n"
            f"{wrap(self.summary)}\n\n"
            f"What it detects\n{wrap(self.what)}\n\n"
            f"Why it hurts accuracy\n{wrap(self.why)}\n\n"
            f"Example\n{textwrap.indent(self.example, '    ')}\n\n"
            f"Fix\n{wrap(self.fix)}\n{wrap(self._automatic_text)}\n"
            + (f"\nKnown limits (static analysis stays silent on)\n{wrap(limits)}\n" if limits else "")
            + ("\nSettings\n" + "\n".join(wrap(s.line()) for s in self.settings) + "\n" if self.settings else "")
            + (f"\nIn triage\n{wrap(self._run_only_text)}\n" if self.run_only else "")
        )

    @property
    def _run_only_text(self) -> str:
        return (f"Cannot change what the ranks learn ({self.run_only}): `triage` lists it under both arms, never as "
                "where an accuracy regression is.")

    def markdown(self) -> str:
        """The same documentation as Markdown (SARIF `help.markdown`)."""
        limits = self.known_limits
        return (
            f"**{self.code} {self.name}** (default severity: {self.severity.label}; category: {self.category}; "
            f"found by: {self.found_by})\n\n"
            f"{self.summary}\n\n"
            f"### What it detects\n\n{self.what}\n\n"
            f"### Why it hurts accuracy\n\n{self.why}\n\n"
            f"### Example\n\n```python\n{self.example}\n```\n\n"
            f"### Fix\n\n{self.fix}\n\n{self._automatic_text}\n"
            + (f"\n### Known limits (static analysis stays silent on)\n\n{limits}\n" if limits else "")
            + ("\n### Settings\n\n" + "".join(f"- {s.line()}\n" for s in self.settings) if self.settings else "")
            + (f"\n### In triage\n\n{self._run_only_text}\n" if self.run_only else "")
        )

    def to_json(self) -> dict[str, Any]:
        """One entry of `ddpdoctor rules --format json`."""
        return {
            "rule": self.code,
            "name": self.name,
            "severity": self.severity.label,
            "category": self.category,
            "static": self.static,
            "probe": self.probe,
            "summary": self.summary,
            "what": self.what,
            "why": self.why,
            "example": self.example,
            "fix": self.fix,
        }
