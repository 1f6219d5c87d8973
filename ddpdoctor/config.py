"""Options of a `check` run: command-line values layered over `[tool.ddpdoctor]` in the nearest pyproject.toml."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpdoctor.errors import UsageError
from ddpdoctor.levels import Severity
from ddpdoctor.rules.dd202_small_bn_batch import SMALL_BN_BATCH

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

OUTPUT_FORMATS = ("text", "json", "sarif")
DEVICES = ("auto", "cpu", "cuda")
LR_SCALINGS = ("auto", "linear", "sqrt", "none")
PYPROJECT_KEYS = {
    "select",
    "ignore",
    "fail_on",
    "base_lr",
    "base_batch",
    "lr_scaling",
    "nproc",
    "small_bn_batch",
}


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    script: Path
    script_args: tuple[str, ...] = ()
    static_only: bool = False
    nproc: int = 2
    epochs: int = 2
    steps: int = 4
    timeout: float = 120.0
    device: str = "auto"
    base_lr: float | None = None
    base_batch: int | None = None
    lr_scaling: str = "auto"
    output_format: str = "text"
    output: Path | None = None
    fail_on: Severity = Severity.MEDIUM
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    keep_run: Path | None = None
    small_bn_batch: int = SMALL_BN_BATCH
    pyproject: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


def find_pyproject(start: Path) -> Path | None:
    """The nearest pyproject.toml at or above `start` (a file's directory or a directory)."""
    here = start if start.is_dir() else start.parent
    for d in (here.resolve(), *here.resolve().parents):
        candidate = d / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_tool_table(pyproject: Path | None) -> dict[str, Any]:
    """`[tool.ddpdoctor]` of a pyproject.toml, validated; {} when absent."""
    if pyproject is None:
        return {}
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{pyproject}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{pyproject}: invalid TOML: {exc}") from None
    table = data.get("tool", {}).get("ddpdoctor", {})
    if not isinstance(table, dict):
        raise UsageError(f"{pyproject}: [tool.ddpdoctor] must be a table")
    table = {k.replace("-", "_"): v for k, v in table.items()}
    unknown = set(table) - PYPROJECT_KEYS
    if unknown:
        raise UsageError(
            f"{pyproject}: unknown key(s) in [tool.ddpdoctor]: {', '.join(sorted(unknown))}"
        )
    for key in ("select", "ignore"):
        if key in table:
            value = table[key]
            if isinstance(value, str):
                value = [v for v in value.replace(",", " ").split() if v]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise UsageError(f"{pyproject}: [tool.ddpdoctor] {key} must be a list of rule codes")
            table[key] = value
    return table


def split_codes(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """`--select DD1,DD3 --select DD501` → ("DD1", "DD3", "DD501")."""
    out: list[str] = []
    for v in values or ():
        out.extend(p for p in v.replace(",", " ").split() if p)
    return tuple(out)
