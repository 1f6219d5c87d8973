"""Attach mode: `python -m ddpdoctor.probe --out DIR SCRIPT [ARGS...]` under any launcher.

    torchrun --nproc_per_node 8 -m ddpdoctor.probe --out run train.py --epochs 90
    srun python -m ddpdoctor.probe --out run/node$SLURM_NODEID train.py ...
    ddpdoctor report run                    # one directory, several (run/node0 run/node1) or their parent

Each process runs the script instrumented (real devices, the launcher's own env contract, no CUDA emulation unless
--device cpu) and writes its events into DIR (one directory per node, or a shared one: file names carry host and
pid). The world (rank, world size, node) comes from torchrun's variables, or from SLURM's under `srun` without
torchrun (ddpdoctor.world). The first
processes copy the script into DIR/source/, so DIR can be analysed on another machine. Without --no-limit the
run ends itself after --epochs × --steps, as `ddpdoctor check` does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from ddpdoctor.errors import UsageError
from ddpdoctor.events import META_FILE, SCHEMA, STATIC_FILE, default_host
from ddpdoctor.probe.plan import LOCAL_RANK_OPTIONS, plan_for_file
from ddpdoctor.probe.rundir import RunDirClaim, claim_for_attach
from ddpdoctor.probe.settings import RUN_DIR_ENV, ProbeSettings
from ddpdoctor.probe.sources import snapshot
from ddpdoctor.records import LaunchMode, RunMeta, StaticRecord
from ddpdoctor.rules import setting
from ddpdoctor.sourcefile import check_source_path
from ddpdoctor.world import place_from_env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ddpdoctor.probe",
        description="Run a training script instrumented under your own launcher; analyse with `ddpdoctor report DIR`.",
    )
    p.add_argument("--out", required=True, type=Path, help="run directory (created; one per node or shared)")
    p.add_argument("--epochs", type=_count, default=2, help="epochs observed before the run ends itself (default 2)")
    p.add_argument("--steps", type=_count, default=4, help="optimizer steps kept per epoch (default 4)")
    p.add_argument("--no-limit", action="store_true", help="observe the whole run; never cut epochs or end it early")
    p.add_argument("--timeout", type=_seconds(1.0), default=600.0,
                   help="how long a finished rank waits for its peers")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto/cuda: the devices the launcher gives (default); cpu: emulate CUDA on CPU with one "
                   "virtual GPU per local rank, to rehearse a GPU job (one node or several) on a machine without GPUs")
    p.add_argument("--stall-timeout", type=_seconds(0.0), default=300.0,
                   help="dump every thread's stack when no optimizer step happened for this long (0 = off)")
    # torch.distributed.launch puts --local-rank=N right after the module; pass it on to the script
    p.add_argument(*LOCAL_RANK_OPTIONS, dest="local_rank", default=None, help=argparse.SUPPRESS)
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def _seconds(low: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < low or value > 7 * 24 * 3600:
            raise argparse.ArgumentTypeError(f"{text} is not a number of seconds between {low:g} and 604800")
        return value

    return parse


def _write_once(path: Path, data: object) -> None:
    """First process of the run writes it; the others find it there."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, default=str)


def _static_findings(script: Path) -> dict | None:
    """static.json of an attached run (StaticRecord), or None when static analysis is unavailable or failed."""
    try:
        from ddpdoctor.static import analyze_file
    except ImportError:
        return None
    try:
        return StaticRecord(findings=tuple(analyze_file(script))).to_json()
    except Exception:
        return None


def main(argv: list[str] | None = None) -> None:
    ns = _parser().parse_args(argv)
    try:
        claim = _prepare(ns)
    except UsageError as exc:  # bad input: one line and exit 2, before the script runs
        sys.stderr.write(f"ddpdoctor.probe: error: {exc}\n")
        raise SystemExit(2) from None
    _attach(ns, claim)


def _prepare(ns: argparse.Namespace) -> RunDirClaim:
    check_source_path(Path(ns.script))
    return claim_for_attach(ns.out.resolve(), default_host())


def _attach(ns: argparse.Namespace, claim: RunDirClaim) -> None:
    script = Path(ns.script)
    out = claim.path
    place = place_from_env(os.environ)  # torchrun's variables, else SLURM's (srun without torchrun), else MPI's
    world = place.world_size or 1
    plan = plan_for_file(script)
    limited = not ns.no_limit
    sources: dict[str, str] = {}
    if not (out / META_FILE).exists():
        # the first processes copy the script (atomically: several may do it at once), so the run directory can
        # be analysed where this checkout does not exist; the others find meta.json written
        sources = snapshot(out, [os.path.abspath(script), str(script.resolve())], cwd=os.getcwd())
    _write_once(
        out / META_FILE,
        RunMeta(
            schema=SCHEMA,
            mode=LaunchMode.ATTACH,
            script=str(script),
            script_abs=str(script.resolve()),
            args=tuple(ns.args),
            cwd=os.getcwd(),
            nproc=world,
            epochs=ns.epochs if limited else 0,
            steps=ns.steps if limited else 0,
            timeout=ns.timeout,
            device=ns.device,
            lr_scaling="auto",
            small_bn_batch=setting("small_bn_batch").default,
            plan=plan.to_json(),
            sources=sources,
            python=sys.version.split()[0],
            host=default_host(),
            started=time.time(),
        ).to_json(without=("keep_run",)),  # attach mode never removes its run directory: nothing to keep
    )
    if (place.rank or 0) == 0 and not (out / STATIC_FILE).exists():
        static = _static_findings(script)
        if static is not None:
            _write_once(out / STATIC_FILE, static)
    args = list(ns.args)
    if ns.local_rank is not None:
        spelling = plan.local_rank_option or "--local-rank"
        args = [f"{spelling}={ns.local_rank}", *args]
    settings = ProbeSettings(
        run_dir=str(out),
        run_tag=os.environ.get("TORCHELASTIC_RUN_ID", "attach"),
        mode=LaunchMode.ATTACH,
        epochs=ns.epochs if limited else 0,
        steps=ns.steps if limited else 0,
        device=ns.device,
        nproc=world,
        timeout=ns.timeout,
        script=str(script),
        stall_timeout=ns.stall_timeout,
    )
    os.environ[RUN_DIR_ENV] = str(out)
    from ddpdoctor.probe.bootstrap import run_script

    run_script(settings, str(script), args)


if __name__ == "__main__":
    main()
