"""Thin command line: parse options, build a config, call one library function, render, return an exit code.

Bad input of any kind ends as one line on stderr and exit code 2, never a traceback.

The parser is the standard library's argparse, built for the one command being run: `check --static` runs in
pre-commit hooks and CI on every change, and a CLI framework that validates each option through pydantic cost
a third of a large script's analysis before anything was read.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ddpdoctor import __version__
from ddpdoctor.errors import InternalError, UsageError

PROG = "ddpdoctor"
DESCRIPTION = "Find out why a DistributedDataParallel / SyncBatchNorm run trains worse than it should."


class Exit(Exception):
    """End the command with this exit code (what a command raises after rendering its report)."""

    def __init__(self, code: int = 0) -> None:
        super().__init__(code)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as a UsageError (one line, exit 2) and ends `--help` with Exit(0)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog.split(' ', 1)[-1]}: {message}" if " " in self.prog else message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            sys.stderr.write(message)
        raise Exit(status)


class _Help(argparse.HelpFormatter):
    """Help that shows an option's default where it has a meaningful one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " [default: %(default)s]"
        return text


def _at_least(low: float, kind: type) -> Callable[[str], float]:
    """An argparse type: `kind(text)`, refused below `low`."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is below the minimum {kind(low)}")
        return value

    convert.__name__ = kind.__name__
    return convert


def _command(options: Callable[[argparse.ArgumentParser], object], name: str | None = None):
    """Register a command: `options` declares its arguments on its parser, the values argparse gives them are the
    function's keyword arguments, and its docstring is its help."""

    def register(fn: Callable) -> Callable:
        COMMANDS[name or fn.__name__] = (fn, options)
        return fn

    return register


COMMANDS: dict[str, tuple[Callable, Callable[[argparse.ArgumentParser], object]]] = {}


def _report_options(p: argparse.ArgumentParser, formats: str, output: str = "Write the report to FILE.") -> None:
    p.add_argument("--format", dest="output_format", default="text", metavar="FORMAT", help=formats)
    p.add_argument("--output", "-o", type=Path, default=None, metavar="FILE", help=output)


def _selection_options(p: argparse.ArgumentParser, prefix: str = "prefix match, comma list") -> None:
    p.add_argument("--fail-on", default=None, metavar="LEVEL", help="info|low|medium|high|critical (default medium).")
    p.add_argument("--select", action="append", default=None, metavar="CODES", help=f"Only these rules ({prefix}).")
    p.add_argument("--ignore", action="append", default=None, metavar="CODES", help=f"Skip these rules ({prefix}).")


def _recipe_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-lr", type=float, default=None, help="lr of the single-process recipe.")
    p.add_argument("--base-batch", type=int, default=None, help="Batch size of the single-process recipe.")
    p.add_argument("--lr-scaling", default=None, help="auto | linear | sqrt | none.")


def _choice(value: str, allowed: tuple[str, ...], option: str) -> str:
    from ddpdoctor.config import choice

    return choice(value, allowed, option)


def _emit(text: str, output: Path | None, *, protect=(), run_dirs=()) -> None:
    if output is None:
        sys.stdout.write(text)
        if not text.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        return
    from ddpdoctor.output import check_output, write_output

    # checked again now that the findings name their files (a project module is no place for a report)
    write_output(text, output, check_output(output, protected=protect, run_dirs=run_dirs))


def _render_and_exit(report, fmt: str, output: Path | None, fail_on, *, protect=(), run_dirs=()) -> None:
    from ddpdoctor.report.render import render

    color = output is None and fmt == "text" and sys.stdout.isatty()
    _emit(render(report, fmt, color=color, base_dir=report.base_dir), output, protect=protect, run_dirs=run_dirs)
    raise Exit(report.exit_code(fail_on))


def _check_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", type=Path, help="The training script to diagnose (with --static: files or directories).")
    p.add_argument("extra", nargs="*", metavar="PATH", help="With --static, more files or directories (without it, "
                   "arguments for the script, as after `--`).")
    p.add_argument(
        "--static",
        action="store_true",
        help="AST analysis only (the script and the project modules it imports): never imports torch or runs "
        "anything. Takes several files or directories, as a pre-commit hook passes them.",
    )
    p.add_argument("--nproc", type=int, default=None, help="Ranks to launch (default 2).")
    p.add_argument("--epochs", type=_at_least(1, int), default=2, help="Epochs observed.")
    p.add_argument("--steps", type=_at_least(1, int), default=4, help="Steps kept per epoch.")
    p.add_argument("--timeout", type=_at_least(1.0, float), default=120.0, help="Seconds for the whole probe.")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda.")
    _recipe_options(p)
    _report_options(p, "text | json | sarif | github (workflow annotations).")
    _selection_options(p)
    p.add_argument("--keep-run", type=Path, default=None, metavar="DIR", help="Keep the probe's event logs in DIR.")
    p.add_argument("--quiet", "-q", action="store_true", help="No progress display on stderr while probing.")


@_command(_check_options)
def check(
    script: Path,
    extra: list[str],
    script_args: list[str],
    static: bool,
    nproc: int | None,
    epochs: int,
    steps: int,
    timeout: float,
    device: str,
    base_lr: float | None,
    base_batch: int | None,
    lr_scaling: str | None,
    output_format: str,
    output: Path | None,
    fail_on: str | None,
    select: list[str] | None,
    ignore: list[str] | None,
    keep_run: Path | None,
    quiet: bool,
) -> None:
    """Static analysis, then a multi-rank probe run of SCRIPT, then one ranked report.

    `check --static PATH...` lints files and directories (recursively, .py files, minus `exclude` in
    [tool.ddpdoctor]): each entry script with the project modules it imports.
    """
    from ddpdoctor.check import findings_files, output_guards, run_check
    from ddpdoctor.config import DEVICES, OUTPUT_FORMATS, CheckConfig, resolve_options, validate_config
    from ddpdoctor.output import check_output
    from ddpdoctor.rules.dd202_small_bn_batch import SMALL_BN_BATCH

    fmt = _choice(output_format, OUTPUT_FORMATS, "--format")
    dev = _choice(device, DEVICES, "--device")
    if not script.exists():
        raise UsageError(f"{script}: no such file")
    extra_paths, script_args = _paths_and_script_args(static, extra, script_args)
    for p in extra_paths:
        if not p.exists():
            raise UsageError(f"{p}: no such file or directory")
    opts = resolve_options(
        script, fail_on=fail_on, select=select, ignore=ignore, nproc=nproc, base_lr=base_lr, base_batch=base_batch,
        lr_scaling=lr_scaling,
    )
    cfg = CheckConfig(
        script=script,
        script_args=tuple(script_args or ()),
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
        keep_run=keep_run,
        quiet=quiet,
        small_bn_batch=opts.small_bn_batch if opts.small_bn_batch is not None else SMALL_BN_BATCH,
        paths=tuple(extra_paths),
        exclude=opts.exclude,
        exclude_base=opts.pyproject.parent if opts.pyproject is not None else None,
    )
    validate_config(cfg)
    protect, run_dirs = output_guards(cfg, opts.pyproject)
    if output is not None:
        check_output(output, protected=protect, run_dirs=run_dirs)  # refused before anything runs
    report = run_check(cfg)
    _render_and_exit(report, fmt, output, opts.fail_on, protect=[*protect, *findings_files(report)],
                     run_dirs=run_dirs)


def _triage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", type=Path, help="The training script to diagnose.")
    p.add_argument("extra", nargs="*", metavar="ARG", help="Arguments for the script (also after `--`).")
    p.add_argument("--arms", default=None, help="Arms to run: A,L,P[,G] (default A,L,P; G with --group-size).")
    p.add_argument("--group-size", type=_at_least(1, int), default=None, help="Ranks per SyncBN subgroup (arm G).")
    p.add_argument(
        "--seed", type=int, default=0, help="Seed every arm starts from (seed + rank), for scripts that set none."
    )
    p.add_argument("--nproc", type=int, default=None, help="Ranks to launch (default 2).")
    p.add_argument("--epochs", type=_at_least(1, int), default=None, help="Epochs observed per arm (default 3).")
    p.add_argument("--steps", type=_at_least(1, int), default=None, help="Steps kept per epoch (default 10).")
    p.add_argument("--timeout", type=_at_least(1.0, float), default=120.0, help="Seconds for each arm's probe.")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda.")
    _recipe_options(p)
    _report_options(p, "text | json | sarif.")
    _selection_options(p)
    p.add_argument(
        "--keep-run", type=Path, default=None, metavar="DIR", help="Keep every arm's run directory in DIR."
    )


@_command(_triage_options)
def triage(
    script: Path,
    extra: list[str],
    script_args: list[str],
    arms: str | None,
    group_size: int | None,
    seed: int,
    nproc: int | None,
    epochs: int | None,
    steps: int | None,
    timeout: float,
    device: str,
    base_lr: float | None,
    base_batch: int | None,
    lr_scaling: str | None,
    output_format: str,
    output: Path | None,
    fail_on: str | None,
    select: list[str] | None,
    ignore: list[str] | None,
    keep_run: Path | None,
) -> None:
    """Why does the DDP+SyncBN run score lower than plain DDP? Paired arms of SCRIPT, ranked causes."""
    from ddpdoctor.config import DEVICES, OUTPUT_FORMATS, CheckConfig, resolve_options
    from ddpdoctor.rules.dd202_small_bn_batch import SMALL_BN_BATCH
    from ddpdoctor.triage.run import DEFAULT_EPOCHS, DEFAULT_STEPS, TriageConfig, parse_arms, run_triage

    fmt = _choice(output_format, OUTPUT_FORMATS, "--format")
    dev = _choice(device, DEVICES, "--device")
    if not script.exists():
        raise UsageError(f"{script}: no such file")
    opts = resolve_options(
        script, fail_on=fail_on, select=select, ignore=ignore, nproc=nproc, base_lr=base_lr, base_batch=base_batch,
        lr_scaling=lr_scaling,
    )
    cfg = CheckConfig(
        script=script,
        script_args=(*extra, *script_args),
        nproc=opts.nproc if opts.nproc is not None else 2,
        epochs=epochs or DEFAULT_EPOCHS,
        steps=steps or DEFAULT_STEPS,
        timeout=timeout,
        device=dev,
        base_lr=opts.base_lr,
        base_batch=opts.base_batch,
        lr_scaling=opts.lr_scaling or "auto",
        select=opts.select,
        ignore=opts.ignore,
        keep_run=keep_run,
        small_bn_batch=opts.small_bn_batch if opts.small_bn_batch is not None else SMALL_BN_BATCH,
    )
    if group_size is not None and (group_size < 2 or cfg.nproc % group_size or group_size >= cfg.nproc):
        raise UsageError(f"--group-size {group_size}: needs 2 <= G < --nproc ({cfg.nproc}) with --nproc a multiple "
                         "of G (SyncBN over subgroups smaller than the world)")
    report = run_triage(TriageConfig(check=cfg, arms=parse_arms(arms, group_size), group_size=group_size, seed=seed))
    _render_and_exit(report, fmt, output, opts.fail_on)


def _report_command_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dirs", type=Path, nargs="+", metavar="RUN_DIR",
        help="A probe run directory (from --keep-run or attach mode); a run recorded per node: its directories, or "
        "their parent.",
    )
    _report_options(p, "text | json | sarif | github (workflow annotations).")
    _selection_options(p, "prefix match")
    _recipe_options(p)


@_command(_report_command_options)
def report(
    run_dirs: list[Path],
    output_format: str,
    output: Path | None,
    fail_on: str | None,
    select: list[str] | None,
    ignore: list[str] | None,
    base_lr: float | None,
    base_batch: int | None,
    lr_scaling: str | None,
) -> None:
    """Re-analyse a recorded probe run without running anything (several directories: one run, one per node)."""
    from ddpdoctor.check import findings_files, report_run, run_dir_files, run_project
    from ddpdoctor.config import OUTPUT_FORMATS, resolve_options
    from ddpdoctor.output import check_output

    fmt = _choice(output_format, OUTPUT_FORMATS, "--format")
    opts = resolve_options(
        run_project(list(run_dirs)), fail_on=fail_on, select=select, ignore=ignore, base_lr=base_lr,
        base_batch=base_batch,
        lr_scaling=lr_scaling,
    )
    protect = [named for d in run_dirs for named in run_dir_files(d)]
    if output is not None:
        check_output(output, protected=protect, run_dirs=run_dirs)  # refused before anything is read
    from ddpdoctor.probe.rundir import ensure_finished
    from ddpdoctor.triage.run import is_triage_dir, report_triage

    for d in run_dirs:
        ensure_finished(d)  # a run still being written is not analysed as if it were whole

    if len(run_dirs) == 1 and run_dirs[0].is_dir() and is_triage_dir(run_dirs[0]):  # `triage --keep-run DIR`
        from ddpdoctor.config import CheckConfig

        cfg = CheckConfig(script=Path("-"), select=opts.select, ignore=opts.ignore)
        overrides = {k: v for k, v in (("base_lr", opts.base_lr), ("base_batch", opts.base_batch),
                                       ("lr_scaling", opts.lr_scaling), ("small_bn_batch", opts.small_bn_batch))
                     if v is not None}
        _render_and_exit(report_triage(run_dirs[0], cfg, overrides), fmt, output, opts.fail_on, protect=protect,
                         run_dirs=run_dirs)
    rep = report_run(
        list(run_dirs),
        select=opts.select,
        ignore=opts.ignore,
        base_lr=opts.base_lr,
        base_batch=opts.base_batch,
        lr_scaling=opts.lr_scaling,
        small_bn_batch=opts.small_bn_batch,
    )
    _render_and_exit(rep, fmt, output, opts.fail_on, protect=[*protect, *findings_files(rep)], run_dirs=run_dirs)


@_command(
    lambda p: p.add_argument("--format", dest="output_format", default="text", metavar="FORMAT", help="text | json.")
)
def rules(output_format: str) -> None:
    """List the rule catalog."""
    from ddpdoctor.report.render import render_rules

    fmt = _choice(output_format, ("text", "json"), "--format")
    _emit(render_rules(fmt, color=sys.stdout.isatty()), None)


@_command(lambda p: p.add_argument("code", help="A rule code, e.g. DD101."))
def explain(code: str) -> None:
    """Print one rule's documentation: what it detects, why it hurts accuracy, an example, the fix."""
    from ddpdoctor.rules import get_rule

    try:
        rule = get_rule(code)
    except KeyError:
        raise UsageError(f"unknown rule {code!r} (see `ddpdoctor rules`)") from None
    _emit(rule.documentation(), None)


def _compare_bn_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="MODULE:FACTORY returning an nn.Module.")
    p.add_argument("--data", default=None, help="MODULE:FACTORY returning a map-style Dataset.")
    p.add_argument("--nproc", type=_at_least(1, int), default=2, help="Ranks.")
    p.add_argument("--batch-size", type=_at_least(1, int), default=16, help="Per-rank batch size.")
    p.add_argument("--steps", type=_at_least(1, int), default=20, help="Train-mode forwards.")
    p.add_argument("--shard", default="iid", help="iid | sorted | FILE (per-rank index lists, JSON).")
    p.add_argument("--seed", type=int, default=0, help="Seed for the shuffle and the demo data.")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda.")
    _report_options(p, "text | json.", output="Write the result to FILE.")
    p.add_argument("--timeout", type=_at_least(1.0, float), default=300.0, help="Seconds for the whole comparison.")


@_command(_compare_bn_options, name="compare-bn")
def compare_bn(
    model: str | None,
    data: str | None,
    nproc: int,
    batch_size: int,
    steps: int,
    shard: str,
    seed: int,
    device: str,
    output_format: str,
    output: Path | None,
    timeout: float,
) -> None:
    """Local BN vs SyncBN vs exact global-batch BN running statistics, per layer."""
    from ddpdoctor.bn.compare import CompareConfig, run_compare
    from ddpdoctor.errors import require_torch
    from ddpdoctor.report.compare_bn import render_compare

    require_torch("compare-bn")
    cfg = CompareConfig(
        model=model,
        data=data,
        nproc=nproc,
        batch_size=batch_size,
        steps=steps,
        shard=shard,
        seed=seed,
        device=_choice(device, ("auto", "cpu", "cuda"), "--device"),
        timeout=timeout,
    )
    fmt = _choice(output_format, ("text", "json"), "--format")
    result = run_compare(cfg)
    color = output is None and fmt == "text" and sys.stdout.isatty()
    _emit(render_compare(result, fmt, color=color), output)


@_command(
    lambda p: p.add_argument(
        "--format", dest="output_format", default="text", metavar="FORMAT", help="text (a fenced block to paste) | json."
    )
)
def env(output_format: str) -> None:
    """Describe this machine for a bug report: ddpdoctor, Python, torch (CUDA, cuDNN, NCCL), GPUs, backends,
    MASTER_*/NCCL_* variables (no other environment variable is shown)."""
    from ddpdoctor.envinfo import collect, render_env
    from ddpdoctor.report.jsonfmt import dumps

    fmt = _choice(output_format, ("text", "json"), "--format")
    info = collect()
    _emit(render_env(info) if fmt == "text" else dumps(info), None)


def _fail(message: str) -> int:
    sys.stderr.write(f"ddpdoctor: error: {message}\n")
    sys.stderr.flush()
    return 2


def _paths_and_script_args(static: bool, before: list[str], after: list[str]) -> tuple[list[Path], list[str]]:
    """`check`'s positional arguments after SCRIPT: with --static, those before `--` are more paths to lint and
    those after it are for the script; without, all of them are the script's."""
    if not static:
        return [], [*before, *after]
    return [Path(p) for p in before], list(after)


def _summary(fn: Callable) -> str:
    """A command's first docstring paragraph, on one line."""
    return " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())


def _root_help() -> str:
    width = max(len(name) for name in COMMANDS) + 2
    lines = [
        f"usage: {PROG} [--version] [-h] COMMAND [ARGS]...",
        "",
        DESCRIPTION,
        "",
        "commands:",
        *(f"  {name:<{width}}{_summary(fn)}" for name, (fn, _) in COMMANDS.items()),
        "",
        f"`{PROG} COMMAND --help` describes a command's options.",
    ]
    return "\n".join(lines) + "\n"


def _parameters(fn: Callable) -> tuple[str, ...]:
    code = fn.__code__
    return code.co_varnames[: code.co_argcount]


def parser_for(name: str) -> argparse.ArgumentParser:
    """The argument parser of one command (only the command being run is built)."""
    fn, options = COMMANDS[name]
    parser = _Parser(prog=f"{PROG} {name}", description=(fn.__doc__ or "").strip(), formatter_class=_Help,
                     allow_abbrev=False)
    if "script_args" in _parameters(fn):
        parser.epilog = "Arguments after `--` are the script's own."
    options(parser)
    return parser


def _run(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(_root_help())
        return 0
    if args[0] == "--version":
        sys.stdout.write(f"{PROG} {__version__}\n")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        what = "option" if name.startswith("-") else "command"
        raise UsageError(f"no such {what} {name!r} (commands: {', '.join(COMMANDS)})")
    parser = parser_for(name)
    # options may come between positional arguments, as click allowed; SCRIPT's own arguments follow `--`
    takes_script_args = "script_args" in _parameters(COMMANDS[name][0])
    cut_at = rest.index("--") if takes_script_args and "--" in rest else len(rest)
    values = vars(parser.parse_intermixed_args(rest[:cut_at]))
    if takes_script_args:
        values["script_args"] = rest[cut_at + 1 :]
    COMMANDS[name][0](**values)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the command with one-line errors and exit code 2 for every kind of bad input.

    As the process's entry point (no `argv`), the cyclic garbage collector stays off and the process ends without
    tearing down its heap: a command runs once and exits, and what it builds (the trees and the semantic model of
    a large project) stays alive until then, so the collector would only walk it again and again, and the
    interpreter's shutdown free it object by object (together a fifth of `check --static` on a 4,000-line
    script). Everything a command opens is closed by the command itself; no atexit handler is registered."""
    args = list(sys.argv[1:] if argv is None else argv)
    if argv is None:
        gc.disable()
    try:
        code = _run(args)
    except Exit as exc:
        code = exc.code
    except UsageError as exc:
        code = _fail(str(exc))
    except InternalError as exc:
        code = _fail(f"internal error: {exc}")
    except KeyboardInterrupt:
        code = _fail("interrupted")
    except BrokenPipeError:
        code = 0
    except Exception as exc:  # noqa: BLE001 - an internal failure still gets one line, never a traceback
        code = _fail(f"internal error: {type(exc).__name__}: {exc}")
    if argv is None:
        _exit(code)
    return code


def _exit(code: int) -> None:
    """End the process now, after what it wrote (see `main`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach the reader
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
