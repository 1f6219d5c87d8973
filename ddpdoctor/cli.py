"""Thin command line: parse options, build a config, call one library function, render, return an exit code.

Bad input of any kind ends as one line on stderr and exit code 2, never a traceback.

No `from __future__ import annotations` here: typer reads the commands' annotations on every run, and string
annotations would have it evaluate each one again (0.7 % of `check --static` on the 4,000-line benchmark).
"""

import gc

# The cyclic collector is off while typer and click are imported (they allocate tens of thousands of objects that
# live as long as the process, so each collection only walks them: 0.7 % of `check --static` on the 4,000-line
# benchmark), then back as it was: a process that imports this module keeps its collector (see `main`).
_GC_WAS_ENABLED = gc.isenabled()
gc.disable()

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import List, Optional  # noqa: E402

import typer  # noqa: E402

from ddpdoctor import __version__  # noqa: E402
from ddpdoctor.errors import InternalError, UsageError  # noqa: E402

if _GC_WAS_ENABLED:
    gc.enable()

app = typer.Typer(
    name="ddpdoctor",
    help="Find out why a DistributedDataParallel / SyncBatchNorm run trains worse than it should.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)


_OUTPUT_HELP = "Write the report to FILE (-: stdout; a device, FIFO or socket is written into, never replaced)."


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ddpdoctor {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """ddpdoctor: ranked causes, with evidence and fixes, for DDP accuracy regressions."""


def _choice(value: str, allowed: tuple[str, ...], option: str) -> str:
    from ddpdoctor.config import choice

    return choice(value, allowed, option)


def _emit(text: str, output: Optional[Path], *, protect=(), run_dirs=()) -> None:
    from ddpdoctor.output import is_stdout

    if output is None or is_stdout(output):
        sys.stdout.write(text)
        if not text.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        return
    from ddpdoctor.output import check_output, write_output

    # checked again now that the findings name their files (a project module is no place for a report)
    write_output(text, output, check_output(output, protected=protect, run_dirs=run_dirs))


def _render_and_exit(report, fmt: str, output: Optional[Path], fail_on, *, protect=(), run_dirs=(),
                     shown: "Shown") -> None:
    if shown.statistics:
        from ddpdoctor.report.concise import render_statistics

        text = render_statistics(report, fmt)
    else:
        from ddpdoctor.output import is_stdout
        from ddpdoctor.report.render import render

        color = (output is None or is_stdout(output)) and fmt == "text" and sys.stdout.isatty()
        text = render(report, fmt, color=color, base_dir=report.base_dir, verbose=shown.verbose)
    _emit(text, output, protect=protect, run_dirs=run_dirs)
    raise typer.Exit(0 if shown.exit_zero else report.exit_code(fail_on))


class Shown:
    """How a report is shown and what it exits with: `--statistics`, `-v`, `--exit-zero` (the options every
    report-printing command shares)."""

    def __init__(self, fmt: str, *, statistics: bool = False, verbose: bool = False, exit_zero: bool = False) -> None:
        if statistics and fmt not in ("text", "json"):
            raise UsageError(f"--statistics: prints per-rule counts as text or json, not --format {fmt}")
        self.statistics, self.verbose, self.exit_zero = statistics, verbose, exit_zero


_FORMAT_HELP = "text | json | sarif | github (workflow annotations) | concise (one line per finding) | markdown."
_FAIL_ON_HELP = "info|low|medium|high|critical|none (default medium; none: as --exit-zero)."
_STATISTICS_HELP = "Print per-rule counts (count, code, severity, name) instead of the findings."
_VERBOSE_HELP = "Show every evidence item in the text report (by default long evidence is cut)."
_DIFF_HELP = ("Print the automatic fixes as a unified diff and change nothing (exit 1 when there is a diff, 0 when "
              "none).")
_FIX_HELP = "Write the automatically fixed script beside it as NAME.ddpdoctor-fixed.py (a new file, never over one)."
_VERIFY_HELP = "With --fix: analyse (probe) the fixed copy again and say, per fix, whether the measurement changed."
_UNSAFE_HELP = "With --diff/--fix: also fix findings of `possible` confidence (their fix could change a right script)."
_EXIT_ZERO_HELP = "Exit 0 even when findings are at or above --fail-on (2 still means it could not analyse)."


@app.command()
def check(
    script: Path = typer.Argument(..., help="The training script to diagnose (with --static: files or directories)."),
    script_args: Optional[List[str]] = typer.Argument(
        None, help="Arguments for the script, after `--`; with --static, more files or directories before it.",
        show_default=False,
    ),
    static: bool = typer.Option(
        False,
        "--static",
        help="AST analysis only (the script and the project modules it imports): never imports torch or runs "
        "anything. Takes several files or directories, as a pre-commit hook passes them.",
    ),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Ranks to launch (default 2)."),
    epochs: int = typer.Option(2, "--epochs", min=1, help="Epochs observed."),
    steps: int = typer.Option(4, "--steps", min=1, help="Steps kept per epoch."),
    timeout: float = typer.Option(120.0, "--timeout", min=1.0, help="Seconds for the whole probe."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    base_lr: Optional[float] = typer.Option(None, "--base-lr", help="lr of the single-process recipe."),
    base_batch: Optional[int] = typer.Option(None, "--base-batch", help="Batch size of the single-process recipe."),
    lr_scaling: Optional[str] = typer.Option(None, "--lr-scaling", help="auto | linear | sqrt | none."),
    output_format: str = typer.Option("text", "--format", help=_FORMAT_HELP),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help=_OUTPUT_HELP),
    fail_on: Optional[str] = typer.Option(None, "--fail-on", help=_FAIL_ON_HELP),
    exit_zero: bool = typer.Option(False, "--exit-zero", help=_EXIT_ZERO_HELP),
    statistics: bool = typer.Option(False, "--statistics", help=_STATISTICS_HELP),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=_VERBOSE_HELP),
    select: Optional[List[str]] = typer.Option(None, "--select", help="Only these rules (prefix match, comma list)."),
    ignore: Optional[List[str]] = typer.Option(None, "--ignore", help="Skip these rules (prefix match, comma list)."),
    keep_run: Optional[Path] = typer.Option(None, "--keep-run", help="Keep the probe's event logs in DIR."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display on stderr while probing."),
    diff: bool = typer.Option(False, "--diff", help=_DIFF_HELP),
    fix: bool = typer.Option(False, "--fix", help=_FIX_HELP),
    verify: bool = typer.Option(False, "--verify", help=_VERIFY_HELP),
    unsafe_fixes: bool = typer.Option(False, "--unsafe-fixes", help=_UNSAFE_HELP),
) -> None:
    """Static analysis, then a multi-rank probe run of SCRIPT, then one ranked report.

    `check --static PATH...` lints files and directories (recursively, .py files, minus `exclude` in
    [tool.ddpdoctor]): each entry script with the project modules it imports.
    """
    from ddpdoctor.check import findings_files, output_guards, run_check
    from ddpdoctor.config import OUTPUT_FORMATS, check_config
    from ddpdoctor.output import check_output

    fmt = _choice(output_format, OUTPUT_FORMATS, "--format")
    shown = Shown(fmt, statistics=statistics, verbose=verbose, exit_zero=exit_zero)
    extra_paths, script_args = _paths_and_script_args(static, list(script_args or ()))
    cfg, opts = check_config(
        script, script_args, static=static, paths=extra_paths, nproc=nproc, epochs=epochs, steps=steps,
        timeout=timeout, device=device, base_lr=base_lr, base_batch=base_batch, lr_scaling=lr_scaling,
        fail_on=fail_on, select=select, ignore=ignore, keep_run=keep_run, quiet=quiet,
    )
    protect, run_dirs = output_guards(cfg, opts.pyproject)
    if output is not None:
        check_output(output, protected=protect, run_dirs=run_dirs)  # refused before anything runs
    if diff or fix or verify or unsafe_fixes:
        from ddpdoctor.fixes.command import check_fix_options

        check_fix_options(cfg, diff=diff, fix=fix, verify=verify, unsafe=unsafe_fixes)  # refused before anything runs
    report = run_check(cfg)
    if diff:
        from ddpdoctor.fixes.command import run_diff

        raise typer.Exit(run_diff(report, unsafe=unsafe_fixes))
    if fix:
        from ddpdoctor.fixes.command import run_fix

        report = run_fix(report, cfg, verify=verify, unsafe=unsafe_fixes)
    _render_and_exit(report, fmt, output, opts.fail_on, protect=[*protect, *findings_files(report)],
                     run_dirs=run_dirs, shown=shown)


@app.command()
def triage(
    script: Path = typer.Argument(..., help="The training script to diagnose."),
    script_args: Optional[List[str]] = typer.Argument(
        None, help="Arguments for the script, after `--`.", show_default=False
    ),
    arms: Optional[str] = typer.Option(
        None, "--arms", help="Arms to run: A,L,P[,G] (default A,L,P; G with --group-size)."
    ),
    group_size: Optional[int] = typer.Option(None, "--group-size", min=1, help="Ranks per SyncBN subgroup (arm G)."),
    seed: int = typer.Option(0, "--seed", help="Seed every arm starts from (seed + rank), for scripts that set none."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Ranks to launch (default 2)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", min=1, help="Epochs observed per arm (default 3)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Steps kept per epoch (default 10)."),
    timeout: float = typer.Option(120.0, "--timeout", min=1.0, help="Seconds for each arm's probe."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    base_lr: Optional[float] = typer.Option(None, "--base-lr", help="lr of the single-process recipe."),
    base_batch: Optional[int] = typer.Option(None, "--base-batch", help="Batch size of the single-process recipe."),
    lr_scaling: Optional[str] = typer.Option(None, "--lr-scaling", help="auto | linear | sqrt | none."),
    output_format: str = typer.Option("text", "--format", help=_FORMAT_HELP),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help=_OUTPUT_HELP),
    fail_on: Optional[str] = typer.Option(None, "--fail-on", help=_FAIL_ON_HELP),
    exit_zero: bool = typer.Option(False, "--exit-zero", help=_EXIT_ZERO_HELP),
    statistics: bool = typer.Option(False, "--statistics", help=_STATISTICS_HELP),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=_VERBOSE_HELP),
    select: Optional[List[str]] = typer.Option(None, "--select", help="Only these rules (prefix match, comma list)."),
    ignore: Optional[List[str]] = typer.Option(None, "--ignore", help="Skip these rules (prefix match, comma list)."),
    keep_run: Optional[Path] = typer.Option(None, "--keep-run", help="Keep every arm's run directory in DIR."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display on stderr while the arms run."),
) -> None:
    """Why does the DDP+SyncBN run score lower than plain DDP? Paired arms of SCRIPT, ranked causes."""
    from ddpdoctor.check import findings_files, output_guards
    from ddpdoctor.config import DEVICES, OUTPUT_FORMATS, CheckConfig, resolve_options, validate_config
    from ddpdoctor.errors import require_analysis_packages
    from ddpdoctor.output import check_output
    from ddpdoctor.rules import setting

    require_analysis_packages("triage")
    from ddpdoctor.triage.run import DEFAULT_EPOCHS, DEFAULT_STEPS, TriageConfig, parse_arms, run_triage

    fmt = _choice(output_format, OUTPUT_FORMATS, "--format")
    shown = Shown(fmt, statistics=statistics, verbose=verbose, exit_zero=exit_zero)
    dev = _choice(device, DEVICES, "--device")
    if not script.exists():
        raise UsageError(f"{script}: no such file")
    opts = resolve_options(
        script, fail_on=fail_on, select=select, ignore=ignore, nproc=nproc, base_lr=base_lr, base_batch=base_batch,
        lr_scaling=lr_scaling,
    )
    cfg = CheckConfig(
        script=script,
        script_args=tuple(script_args or ()),
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
        quiet=quiet,
        small_bn_batch=opts.small_bn_batch if opts.small_bn_batch is not None else setting("small_bn_batch").default,
    )
    if group_size is not None and (group_size < 2 or cfg.nproc % group_size or group_size >= cfg.nproc):
        raise UsageError(f"--group-size {group_size}: needs 2 <= G < --nproc ({cfg.nproc}) with --nproc a multiple "
                         "of G (SyncBN over subgroups smaller than the world)")
    validate_config(cfg)  # the numbers every arm runs with, as `check` holds them
    tcfg = TriageConfig(check=cfg, arms=parse_arms(arms, group_size), group_size=group_size, seed=seed)
    protect, keep_dirs = output_guards(cfg, opts.pyproject)
    if output is not None:
        check_output(output, protected=protect, run_dirs=keep_dirs)  # refused before any arm runs
    report = run_triage(tcfg)
    _render_and_exit(report, fmt, output, opts.fail_on, protect=[*protect, *findings_files(report)],
                     run_dirs=keep_dirs, shown=shown)


@app.command()
def report(
    run_dirs: List[Path] = typer.Argument(
        ..., help="A probe run directory (from --keep-run or attach mode); a run recorded per node: its "
        "directories, or their parent."
    ),
    output_format: str = typer.Option("text", "--format", help=_FORMAT_HELP),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help=_OUTPUT_HELP),
    fail_on: Optional[str] = typer.Option(None, "--fail-on", help=_FAIL_ON_HELP),
    exit_zero: bool = typer.Option(False, "--exit-zero", help=_EXIT_ZERO_HELP),
    statistics: bool = typer.Option(False, "--statistics", help=_STATISTICS_HELP),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=_VERBOSE_HELP),
    select: Optional[List[str]] = typer.Option(None, "--select", help="Only these rules (prefix match)."),
    ignore: Optional[List[str]] = typer.Option(None, "--ignore", help="Skip these rules (prefix match)."),
    base_lr: Optional[float] = typer.Option(None, "--base-lr", help="lr of the single-process recipe."),
    base_batch: Optional[int] = typer.Option(None, "--base-batch", help="Batch size of the single-process recipe."),
    lr_scaling: Optional[str] = typer.Option(None, "--lr-scaling", help="auto | linear | sqrt | none."),
) -> None:
    """Re-analyse a recorded probe run without running anything (several directories: one run, one per node)."""
    from ddpdoctor.check import findings_files, report_run, run_dir_files, run_project
    from ddpdoctor.config import OUTPUT_FORMATS, resolve_options
    from ddpdoctor.output import check_output

    fmt = _choice(output_format, OUTPUT_FORMATS, "--format")
    shown = Shown(fmt, statistics=statistics, verbose=verbose, exit_zero=exit_zero)
    opts = resolve_options(
        run_project(list(run_dirs)), fail_on=fail_on, select=select, ignore=ignore, base_lr=base_lr,
        base_batch=base_batch,
        lr_scaling=lr_scaling,
    )
    protect = [named for d in run_dirs for named in run_dir_files(d)]
    if output is not None:
        check_output(output, protected=protect, run_dirs=run_dirs)  # refused before anything is read
    from ddpdoctor.errors import require_analysis_packages
    from ddpdoctor.rundata import find_run_dirs

    require_analysis_packages("`ddpdoctor report`")
    from ddpdoctor.probe.rundir import ensure_finished
    from ddpdoctor.triage.run import is_triage_dir, report_triage

    try:  # a parent of per-node directories: each one it holds, as the directory itself would be
        found = find_run_dirs(list(run_dirs))
    except ValueError:
        found = []  # not a run directory: the reading below says so in one line
    for d in [*run_dirs, *found]:
        ensure_finished(d)  # a run still being written is not analysed as if it were whole

    if len(run_dirs) == 1 and run_dirs[0].is_dir() and is_triage_dir(run_dirs[0]):  # `triage --keep-run DIR`
        from ddpdoctor.config import CheckConfig

        cfg = CheckConfig(script=Path("-"), select=opts.select, ignore=opts.ignore)
        overrides = {k: v for k, v in (("base_lr", opts.base_lr), ("base_batch", opts.base_batch),
                                       ("lr_scaling", opts.lr_scaling), ("small_bn_batch", opts.small_bn_batch))
                     if v is not None}
        _render_and_exit(report_triage(run_dirs[0], cfg, overrides), fmt, output, opts.fail_on, protect=protect,
                         run_dirs=run_dirs, shown=shown)
    rep = report_run(
        list(run_dirs),
        select=opts.select,
        ignore=opts.ignore,
        base_lr=opts.base_lr,
        base_batch=opts.base_batch,
        lr_scaling=opts.lr_scaling,
        small_bn_batch=opts.small_bn_batch,
    )
    _render_and_exit(rep, fmt, output, opts.fail_on, protect=[*protect, *findings_files(rep)], run_dirs=run_dirs,
                     shown=shown)


@app.command()
def rules(
    output_format: str = typer.Option("text", "--format", help="text | json."),
) -> None:
    """List the rule catalog."""
    from ddpdoctor.report.render import render_rules

    fmt = _choice(output_format, ("text", "json"), "--format")
    _emit(render_rules(fmt, color=sys.stdout.isatty()), None)


@app.command()
def explain(code: str = typer.Argument(..., help="A rule code (DD101) or a prefix (DD3: every data rule).")) -> None:
    """Print rules' documentation: what each detects, why it hurts accuracy, an example, the fix. A prefix
    explains every rule it matches, in code order."""
    from ddpdoctor.rules import RULES, select_codes

    try:
        codes = select_codes([code]) if code.strip() else set()
    except ValueError:
        codes = set()
    if not codes:
        raise UsageError(f"unknown rule or prefix {code!r} (see `ddpdoctor rules`)")
    from ddpdoctor.consequences import explain_section

    docs = [r.documentation() + explain_section(r) for r in RULES if r.code in codes]
    rule_line = "\n" + "-" * 100 + "\n\n"
    _emit(rule_line.join(docs), None)


@app.command("compare-bn")
def compare_bn(
    model: Optional[str] = typer.Option(None, "--model", help="MODULE:FACTORY returning an nn.Module."),
    data: Optional[str] = typer.Option(None, "--data", help="MODULE:FACTORY returning a map-style Dataset."),
    nproc: int = typer.Option(2, "--nproc", min=1, help="Ranks."),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Per-rank batch size."),
    steps: int = typer.Option(20, "--steps", min=1, help="Train-mode forwards."),
    shard: str = typer.Option("iid", "--shard", help="iid | sorted | FILE (per-rank index lists, JSON)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the shuffle and the demo data."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    output_format: str = typer.Option("text", "--format", help="text | json | markdown."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help=_OUTPUT_HELP),
    timeout: float = typer.Option(300.0, "--timeout", min=1.0, help="Seconds for the whole comparison."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display on stderr while the ranks run."),
) -> None:
    """Local BN vs SyncBN vs exact global-batch BN running statistics, per layer."""
    from ddpdoctor.errors import require_analysis_packages, require_torch

    require_torch("compare-bn")
    require_analysis_packages("compare-bn")
    from ddpdoctor.comparebn.compare import CompareConfig, output_guards, run_compare, validate
    from ddpdoctor.output import check_output
    from ddpdoctor.report.compare_bn import render_compare

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
    fmt = _choice(output_format, ("text", "json", "markdown"), "--format")
    validate(cfg)
    protect = output_guards(cfg)
    if output is not None:
        check_output(output, protected=protect)  # refused before any rank starts
    result = run_compare(cfg, quiet=quiet)
    from ddpdoctor.output import is_stdout

    color = (output is None or is_stdout(output)) and fmt == "text" and sys.stdout.isatty()
    _emit(render_compare(result, fmt, color=color), output, protect=protect)
    raise typer.Exit(0)


@app.command()
def env(
    output_format: str = typer.Option("text", "--format", help="text (a fenced block to paste) | json."),
) -> None:
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


def _click_exception(exc: Exception) -> int:
    """Click's exceptions, recognised by shape: typer vendors click in recent releases and depends on it in
    older ones, so the classes live in different modules."""
    kind = type(exc).__name__
    if kind == "Exit":
        return int(getattr(exc, "exit_code", 0) or 0)
    if kind == "NoArgsIsHelpError":
        sys.stdout.write(exc.format_message().rstrip() + "\n")
        return 0
    if kind == "Abort":
        return _fail("aborted")
    if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
        lines = [ln for ln in exc.format_message().splitlines() if ln.strip()]
        return _fail(lines[0] if lines else kind)
    # an internal failure still gets one line, never a traceback
    return _fail(f"internal error: {kind}: {exc}")


_RAW_ARGS: list[str] = []


def _paths_and_script_args(static: bool, positional: list[str]) -> tuple[list[Path], list[str]]:
    """Split `check`'s positional arguments after SCRIPT: what follows `--` is for the script; with --static, what
    comes before it is more paths to lint (click does not say where `--` was, so the raw arguments do)."""
    after = _RAW_ARGS[_RAW_ARGS.index("--") + 1 :] if "--" in _RAW_ARGS else []
    before = positional[: len(positional) - len(after)] if after else positional
    if not static:
        return [], positional
    return [Path(p) for p in before], positional[len(before) :]


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app with one-line errors and exit code 2 for every kind of bad input.

    As the process's entry point (no `argv`), the cyclic garbage collector stays off and the process ends without
    tearing down its heap: a command runs once and exits, and what it builds (the trees and the semantic model of
    a large project) stays alive until then, so the collector would only walk it again and again, and the
    interpreter's shutdown free it object by object (together a fifth of `check --static` on a 4,000-line
    script). Everything a command opens is closed by the command itself; no atexit handler is registered."""
    if argv is None:
        gc.disable()
        _reopen_closed_std_streams()
        _stop_signals_interrupt()
    args = list(sys.argv[1:] if argv is None else argv)
    command = _click_command(args)
    _RAW_ARGS[:] = args
    try:
        rv = command.main(args=args, prog_name="ddpdoctor", standalone_mode=False)
        # non-standalone click returns (not raises) the code of Exit, and turns Ctrl-C into 130
        code = _fail("interrupted") if rv == 130 else (rv if isinstance(rv, int) else 0)
    except UsageError as exc:
        code = _fail(str(exc))
    except InternalError as exc:
        code = _fail(f"internal error: {exc}")
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort:
        code = _fail("aborted")
    except KeyboardInterrupt:
        code = _fail("interrupted")
    except BrokenPipeError:
        code = 0
    except Exception as exc:
        code = _click_exception(exc)
    if argv is None:
        _exit(code)
    return code


def _click_command(args: list[str]) -> "typer.core.TyperGroup":
    """The click group `app` is run as. typer converts each command's parameters on every run; a command line that
    starts with a command's name (`ddpdoctor check ...`, as the pre-commit hook runs it) gets a group of that command
    alone, which runs, parses, refuses and helps exactly as in the whole group (a command's own options and help
    never depend on the others). Anything else (no command, root options first, an unknown name that click
    answers with the names it knows) gets the whole group."""
    if args:
        for info in app.registered_commands:
            if args[0] == (info.name or typer.main.get_command_name(info.callback.__name__)):
                every = app.registered_commands
                app.registered_commands = [info]
                try:
                    return typer.main.get_command(app)
                finally:
                    app.registered_commands = every
    return typer.main.get_command(app)


def _reopen_closed_std_streams() -> None:
    """Started with stdin, stdout or stderr closed (`>&-`, `2>&-`): put /dev/null on that descriptor. Python leaves
    the stream None (every print would raise), and the first file ddpdoctor opened would otherwise take the free
    descriptor 1 or 2 and receive what is meant for the terminal, as would the ranks that inherit it. What would
    have been printed there is dropped, as the caller asked; the exit code still says how the run went."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            if getattr(sys, name) is not None:
                continue
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            except OSError:
                continue
            if null != fd:
                os.dup2(null, fd)  # inheritable, as the descriptor the ranks expect
                os.close(null)
            else:
                os.set_inheritable(fd, True)
        try:
            stream = open(fd, "r" if fd == 0 else "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        except OSError:
            continue
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _stop_signals_interrupt() -> None:
    """SIGTERM and SIGHUP end a command as Ctrl-C does: a KeyboardInterrupt, so every `finally` runs (a half-written
    --output file is removed, the run is stopped and its files removed) and the command exits 2, `interrupted`.
    Their default action would end the process at once, leaving that to the guards (ddpdoctor.probe.supervisor)."""
    import signal

    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, signal.default_int_handler)


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
