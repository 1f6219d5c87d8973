"""DD108 legacy-local-rank-arg: `--local_rank` taken from the command line only.

What it flags: an argparse `--local_rank`/`--local-rank` option when nothing in the file reads the LOCAL_RANK
environment variable. torchrun (and `torch.distributed.launch --use-env`, the default since 2.0) passes the local
rank only through LOCAL_RANK, so the option keeps its default on every process and they all pick the same GPU.

What stays silent: `int(os.environ.get("LOCAL_RANK", args.local_rank))`, `default=int(os.environ["LOCAL_RANK"])`,
any read of LOCAL_RANK anywhere in the file, and an option nothing reads that takes both spellings. An option
nothing reads with one spelling is low: its default picks nothing, but since torch 2.0 torch.distributed.launch
passes `--local-rank`, which a parser that only knows `--local_rank` rejects.

Confidence: certain when the script imports none of its own project's modules; likely when it does — a helper
module can read LOCAL_RANK after parsing (timm's `init_distributed_device`, DINO's `init_distributed_mode`), and the
probe, which sees that read, drops the finding with a note.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.levels import Severity
from ddpdoctor.rules.dd108_legacy_local_rank_arg import CODE
from ddpdoctor.static.model import ScriptModel


def check(script: ScriptModel) -> Iterator[Finding]:
    options = [a for a in script.cli_args.values() if any(f in ("--local_rank", "--local-rank") for f in a.flags)]
    if not options:
        return
    if any((ev.data.get("var") or "").upper().endswith("LOCAL_RANK") for ev in script.of("env_read")):
        return
    if any(_names_local_rank_key(s) for s in script.string_constants):
        return  # read through a helper or a variable key: the fallback exists
    opt = options[0]
    if not _read(script, opt.dest):
        # declared only to take what the legacy launcher passes: its default is never used
        if {"--local_rank", "--local-rank"} <= {f for a in options for f in a.flags}:
            return
        other = "--local-rank" if "--local_rank" in opt.flags else "--local_rank"
        yield script.finding(
            CODE,
            line=opt,
            message=f"`{opt.flags[0]}` (line {opt.line}) is declared but never read: it only takes the argument "
            f"the legacy launcher passes, and torch.distributed.launch passes it as `{other}` since torch 2.0, which "
            "this parser rejects (\"unrecognized arguments\"): the run stops before training (torchrun passes none)",
            confidence=Confidence.LIKELY,
            severity=Severity.LOW,
            fix_variant="unread",
            fix_args={"option": opt.flags[0], "other": other},
            evidence={"line": opt.line, "flags": list(opt.flags), "dest": opt.dest, "read": False},
        )
        return
    helpers = _project_modules(script)
    yield script.finding(
        CODE,
        line=opt,
        message=f"`{opt.flags[0]}` (line {opt.line}) is read from the command line only; torchrun passes the local "
        f"rank in the LOCAL_RANK environment variable, so every process keeps the default",
        confidence=Confidence.LIKELY if helpers else Confidence.CERTAIN,
        evidence={"line": opt.line, "flags": list(opt.flags), "default": script.text(_default_node(opt.node)),
                  "project_modules": helpers[:8]},
    )


def _read(script: ScriptModel, dest: str) -> bool:
    """Whether any file the walk read uses the option's value: an attribute of that name read anywhere
    (`args.local_rank`, conservatively any object's), or the name as a string (`vars(args)["local_rank"]`)."""
    return any(dest in f.index.loaded_names or dest in f.index.strings for f in script.sources.values())


def _project_modules(script: ScriptModel) -> list[str]:
    """Modules the script imports that live beside it (its own project), not installed packages."""
    base = Path(script.filename).resolve().parent
    out = []
    for name in sorted(script.imported):
        top = name.split(".")[0]
        if top and ((base / f"{top}.py").is_file() or (base / top / "__init__.py").is_file()):
            out.append(name)
    return out


def _default_node(call: ast.AST) -> ast.AST | None:
    for kw in getattr(call, "keywords", []):
        if kw.arg == "default":
            return kw.value
    return None


def _names_local_rank_key(text: str) -> bool:
    """A string that is an environment key ending in LOCAL_RANK (`"LOCAL_RANK"`, `"OMPI_COMM_WORLD_LOCAL_RANK"`), not
    prose that mentions it (a docstring saying the script "never reads LOCAL_RANK")."""
    key = text.strip()
    return key.endswith("LOCAL_RANK") and not any(c.isspace() for c in key)
