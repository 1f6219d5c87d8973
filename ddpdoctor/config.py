"""What the user asked for: command-line values layered over `[tool.ddpdoctor]` in the nearest pyproject.toml.

`resolve_options` is the one place that layering happens, for `check` and `report` alike; `CheckConfig` is what
a `check` run needs on top of it (the script, the probe's limits).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import lru_cache
from os import PathLike
from pathlib import Path
from typing import Any, Sequence

from ddpdoctor import rules
from ddpdoctor.errors import UsageError
from ddpdoctor.levels import Severity
from ddpdoctor.rules import setting

OUTPUT_FORMATS = ("text", "json", "sarif", "github", "concise", "markdown")
DEVICES = ("auto", "cpu", "cuda")
LR_SCALINGS = ("auto", "linear", "sqrt", "none")
MAX_NPROC = 64  # ranks on one machine: each is a Python process with torch (~300 MB before the model)
MAX_TIMEOUT = 7 * 24 * 3600.0
# [tool.ddpdoctor] keys and the TOML types they take (a TOML float for an integer option is refused: nproc = 1e9)
_FIXED_TABLE_TYPES: dict[str, tuple[type, ...]] = {
    "fail_on": (str,),
    "lr_scaling": (str,),
    "base_lr": (int, float),
    "base_batch": (int,),
    "nproc": (int,),
}


@lru_cache(maxsize=None)
def _table_types() -> dict[str, tuple[type, ...]]:
    """The keys that take a value and its TOML types: the fixed ones and the rules' settings the user can change
    (`Setting.option`), read from the whole catalog when a table is read (not at import: `check --static`
    imports only the rules it runs)."""
    return {
        **_FIXED_TABLE_TYPES,
        **{
            s.name: (int,) if isinstance(s.default, int) else (int, float)
            for s in rules.SETTINGS.values()
            if s.option
        },
    }


_FIXED_KEYS = frozenset({"select", "ignore", "exclude", *_FIXED_TABLE_TYPES})


def _pyproject_keys() -> frozenset[str]:
    return _FIXED_KEYS | set(_table_types())


def __getattr__(attr: str) -> Any:
    """`PYPROJECT_KEYS`: every key [tool.ddpdoctor] takes."""
    if attr == "PYPROJECT_KEYS":
        return set(_pyproject_keys())
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


@dataclass(frozen=True, kw_only=True)
class Options:
    """The options `check` and `report` share, each from the command line, else `[tool.ddpdoctor]`, else unset.

    Unset (None) recipe values mean: `check` uses its default, `report` the value recorded with the run.
    """

    fail_on: Severity | None = Severity.MEDIUM  # None: `--fail-on none`, never exit 1 for findings
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    nproc: int | None = None
    base_lr: float | None = None
    base_batch: int | None = None
    lr_scaling: str | None = None
    small_bn_batch: int | None = None
    pyproject: Path | None = None  # where the table came from, for messages
    exclude: tuple[str, ...] = ()  # globs of files `check --static` skips, relative to the pyproject's directory


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """One `check` run: the script, the probe's limits, the single-process recipe, the rules shown."""

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
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    keep_run: Path | None = None
    quiet: bool = False  # no progress display on stderr while probing
    small_bn_batch: int = setting("small_bn_batch").default
    # `check --static PATH...`: the paths after the first (files or directories), the globs that drop files, and
    # the directory the globs are relative to
    paths: tuple[Path, ...] = ()
    exclude: tuple[str, ...] = ()
    exclude_base: Path | None = None


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
    if sys.version_info >= (3, 11):  # imported here: most runs find no pyproject.toml, and its parser costs
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
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
    # a table of the fixed keys only needs no rule's settings (nor the catalog imported for them)
    table_types = _table_types() if set(table) - _FIXED_KEYS else _FIXED_TABLE_TYPES
    unknown = set(table) - _FIXED_KEYS - set(table_types)
    if unknown:
        raise UsageError(
            f"{pyproject}: unknown key(s) in [tool.ddpdoctor]: {', '.join(sorted(unknown))}"
        )
    for key, types in table_types.items():
        value = table.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            kind = "an integer" if types == (int,) else "a number" if float in types else "a string"
            raise UsageError(f"{pyproject}: [tool.ddpdoctor] {key} must be {kind}, not {value!r}")
    if "exclude" in table:
        value = table["exclude"]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UsageError(f"{pyproject}: [tool.ddpdoctor] exclude must be a list of glob patterns")
        table["exclude"] = value
    for key in ("select", "ignore"):
        if key in table:
            value = table[key]
            if isinstance(value, str):
                value = [v for v in value.replace(",", " ").split() if v]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise UsageError(f"{pyproject}: [tool.ddpdoctor] {key} must be a list of rule codes")
            table[key] = value
    return table


def validate_recipe(base_lr: float | None, base_batch: int | None) -> None:
    """The single-process recipe: both or neither, a finite positive lr, a batch of at least one sample."""
    if (base_lr is None) != (base_batch is None):
        raise UsageError("--base-lr and --base-batch go together (the single-process recipe)")
    if base_lr is not None and not (math.isfinite(base_lr) and base_lr > 0):
        raise UsageError(f"--base-lr {base_lr}: must be a finite learning rate above 0")
    if base_batch is not None and base_batch < 1:
        raise UsageError(f"--base-batch {base_batch}: must be at least 1 (samples per optimizer step)")


def check_count(option: str, value: object, *, low: int = 1, high: int | None = None, why: str = "") -> int:
    """A whole number in [low, high] (one-line UsageError otherwise): the one test every command's counts pass
    (ranks, epochs, steps, batch sizes, whether from an option, [tool.ddpdoctor] or a library caller)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{option} {value}: must be a whole number of at least {low}{why}")
    if high is not None and value > high:
        raise UsageError(f"{option} {value}: at most {high}{why}")
    return value


def check_nproc(value: object, *, low: int = 1) -> int:
    """Ranks on one machine: between `low` and MAX_NPROC, for every command that launches them."""
    return check_count("--nproc", value, low=low, high=MAX_NPROC,
                       why=" ranks on one machine (each rank is a process with its own copy of torch and the model)")


MAX_SEED = 2**63 - 1  # torch.manual_seed takes at most 64 bits, numpy's default_rng no negative seed


def check_seed(value: object) -> int:
    """A seed every generator compare-bn's ranks seed accepts (numpy's default_rng, torch's): 0 to MAX_SEED."""
    return check_count("--seed", value, low=0, high=MAX_SEED)


def check_seconds(option: str, value: object) -> float:
    """A time limit: a finite number of seconds between 1 and MAX_TIMEOUT (nan, inf or 1e300 would mean no limit
    at all)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 1.0 <= value <= MAX_TIMEOUT):
        raise UsageError(f"--timeout {value}: must be a number of seconds between 1 and {MAX_TIMEOUT:.0f}")
    return float(value)


def validate_config(cfg: CheckConfig) -> CheckConfig:
    """Numbers a check (or each arm of a triage) can run with: one-line UsageError for anything else (whatever
    set them: options, [tool.ddpdoctor], a library caller)."""
    for name, value in (("--epochs", cfg.epochs), ("--steps", cfg.steps), ("small_bn_batch", cfg.small_bn_batch)):
        check_count(name, value)
    check_nproc(cfg.nproc)
    check_seconds("--timeout", cfg.timeout)
    validate_recipe(cfg.base_lr, cfg.base_batch)
    return cfg


def split_codes(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """`--select DD1,DD3 --select DD501` → ("DD1", "DD3", "DD501")."""
    out: list[str] = []
    for v in values or ():
        out.extend(p for p in v.replace(",", " ").split() if p)
    return tuple(out)


def choice(value: Any, allowed: tuple[str, ...], option: str) -> str:
    """`value` lower-cased if it is one of `allowed`, else a one-line UsageError naming `option`."""
    value = str(value)
    v = value.strip().lower()
    if v not in allowed:
        raise UsageError(f"{option}: {value!r} is not one of {', '.join(allowed)}")
    return v


def parse_fail_on(text: str) -> Severity | None:
    """`--fail-on`: a severity, or `none` (findings never fail the run, as `--exit-zero`)."""
    if text.strip().lower() == "none":
        return None
    try:
        return Severity.parse(text)
    except ValueError:
        raise ValueError(f"unknown --fail-on {text!r} (expected one of: "
                         f"{', '.join(s.label for s in Severity)}, none)") from None


def resolve_options(
    start: Path | None,
    *,
    fail_on: str | None = None,
    select: list[str] | tuple[str, ...] | None = None,
    ignore: list[str] | tuple[str, ...] | None = None,
    nproc: int | None = None,
    base_lr: float | None = None,
    base_batch: int | None = None,
    lr_scaling: str | None = None,
) -> Options:
    """The command line's values over `[tool.ddpdoctor]` of the pyproject.toml nearest to `start` (None: no
    table). `--select` replaces the table's list, `--ignore` adds to it. Bad values are one-line UsageErrors."""
    pyproject = find_pyproject(start) if start is not None else None
    table = load_tool_table(pyproject)

    def pick(cli_value: Any, key: str) -> Any:
        return cli_value if cli_value is not None else table.get(key)

    try:
        fail = parse_fail_on(str(pick(fail_on, "fail_on") or "medium"))
        scaling = pick(lr_scaling, "lr_scaling")
        n = pick(nproc, "nproc")
        blr = pick(base_lr, "base_lr")
        bbatch = pick(base_batch, "base_batch")
        small = table.get("small_bn_batch")
        options = Options(
            fail_on=fail,
            select=split_codes(select) or tuple(table.get("select", ())),
            ignore=split_codes(ignore) + tuple(table.get("ignore", ())),
            nproc=int(n) if n is not None else None,
            base_lr=float(blr) if blr is not None else None,
            base_batch=int(bbatch) if bbatch is not None else None,
            lr_scaling=choice(scaling, LR_SCALINGS, "--lr-scaling") if scaling is not None else None,
            small_bn_batch=int(small) if small is not None else None,
            pyproject=pyproject,
            exclude=tuple(table.get("exclude", ())),
        )
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if options.nproc is not None:
        check_nproc(options.nproc)
    if options.small_bn_batch is not None:
        check_count("small_bn_batch", options.small_bn_batch)
    validate_recipe(options.base_lr, options.base_batch)
    from ddpdoctor.rules import select_codes

    for option, codes in (("--select", options.select), ("--ignore", options.ignore)):
        try:
            select_codes(codes)  # an unknown code is refused now, not after a probe run or a triage's arms
        except ValueError as exc:
            raise UsageError(f"{option}: {exc}") from None
    return options


def check_config(
    script: str | PathLike,
    args: Sequence[str] = (),
    *,
    static: bool = False,
    paths: Sequence[str | PathLike] = (),
    nproc: int | None = None,
    epochs: int = 2,
    steps: int = 4,
    timeout: float = 120.0,
    device: str = "auto",
    base_lr: float | None = None,
    base_batch: int | None = None,
    lr_scaling: str | None = None,
    fail_on: str | None = None,
    select: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    keep_run: str | PathLike | None = None,
    quiet: bool = True,
) -> tuple[CheckConfig, Options]:
    """The validated `CheckConfig` of a check and the options it was layered from (command line values over
    `[tool.ddpdoctor]`): what `ddpdoctor check` and `ddpdoctor.check` both run."""
    script = Path(script)
    dev = choice(device, DEVICES, "--device")
    if not script.exists():
        raise UsageError(f"{script}: no such file")
    for p in paths:
        if not Path(p).exists():
            raise UsageError(f"{p}: no such file or directory")
    opts = resolve_options(
        script, fail_on=fail_on, select=list(select) if select else None, ignore=list(ignore) if ignore else None,
        nproc=nproc, base_lr=base_lr, base_batch=base_batch, lr_scaling=lr_scaling,
    )
    cfg = CheckConfig(
        script=script,
        script_args=tuple(str(a) for a in args),
        static_only=static,
        nproc=opts.nproc if opts.nproc is not None else 2,
        epochs=epochs,
        steps=steps,
        timeout=timeout,
        device=dev,
        base_lr=opts.base_lr,
        base_batch=opts.base_batch,
        lr_scaling=opts.lr_scaling or "auto",
        select=opts.select,
        ignore=opts.ignore,
        keep_run=Path(keep_run) if keep_run is not None else None,
        quiet=quiet,
        small_bn_batch=opts.small_bn_batch if opts.small_bn_batch is not None else setting("small_bn_batch").default,
        paths=tuple(Path(p) for p in paths),
        exclude=opts.exclude,
        exclude_base=opts.pyproject.parent if opts.pyproject is not None else None,
    )
    return validate_config(cfg), opts
