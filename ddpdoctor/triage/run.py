"""`ddpdoctor triage`: run the arms, analyse each, decide the verdicts, build one report.

The first arm is the script as written. What it recorded decides the question: SyncBN layers (converted or built
directly) make it arm A and the others L (same layers, per-rank statistics) and P (conversion undone); plain
BatchNorm only makes it arm P and asks the mirror question — would SyncBN help? — with A (converted by ddpdoctor
when DDP wraps the model) and L. G (SyncBN over subgroups of --group-size ranks) runs when asked for. Every arm
runs with the same seed (seed + rank), so an unseeded script is paired too; the digests say whether it was.

Each arm is a full probe run (its own run directory, its own timeout); `--keep-run DIR` keeps them as
DIR/arm-<name>/ next to DIR/triage.json, and `ddpdoctor report DIR` re-analyses them. The arms share one launch
(ddpdoctor.probe.armlaunch, probe.shared.SharedLaunch, ddpdoctor.probe.zygote: per rank, the interpreter, torch and
the probe imported once, one fork per arm) unless the script cannot (it starts its own ranks, --device cuda) or
the shared launch ended early (an arm timed out): those arms are launched one by one, and a note says so.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpdoctor.config import CheckConfig
from ddpdoctor.errors import UsageError
from ddpdoctor.findings import Finding
from ddpdoctor.probe.armlaunch import ArmLaunch
from ddpdoctor.report import Report

if TYPE_CHECKING:
    from ddpdoctor.probe.rundir import RunDirClaim

TRIAGE_FILE = "triage.json"
DEFAULT_EPOCHS = 3
DEFAULT_STEPS = 10


@dataclass(frozen=True, kw_only=True)
class TriageConfig:
    check: CheckConfig
    arms: tuple[str, ...] = ("A", "L", "P")
    group_size: int | None = None
    seed: int = 0


def parse_arms(text: str | None, group_size: int | None) -> tuple[str, ...]:
    """`--arms A,L,P[,G]`: A and P are required (the comparison), L and G optional."""
    if not text:
        arms = ["A", "L", "P"] + (["G"] if group_size else [])
    else:
        arms = [a.strip().upper() for a in text.replace(" ", ",").split(",") if a.strip()]
    bad = [a for a in arms if a not in ("A", "L", "P", "G")]
    if bad:
        raise UsageError(f"--arms: unknown arm(s) {', '.join(bad)} (A, L, P, G)")
    if "A" not in arms or "P" not in arms:
        raise UsageError("--arms must include A and P (the SyncBN run and the plain run it is compared with)")
    if "G" in arms and not group_size:
        raise UsageError("--arms G needs --group-size (ranks per SyncBN subgroup)")
    return tuple(dict.fromkeys(a for a in ("A", "L", "P", "G") if a in arms))


def arm_settings(name: str, mirror: bool, seed: int, group_size: int | None, as_written: bool) -> dict[str, Any]:
    """ProbeSettings fields of arm `name`; `mirror`: the script as written uses plain BatchNorm only."""
    s: dict[str, Any] = {"arm": name, "seed": seed}
    if as_written:
        return s
    if name == "L":
        s["bn_mode"] = "local"
    elif name == "P" and not mirror:
        s["bn_mode"] = "plain"
    elif name == "G":
        s["bn_mode"] = "group"
        s["bn_group_size"] = int(group_size or 0)
    if mirror and name in ("A", "L", "G"):
        s["bn_convert"] = 1
    return s


def _what(name: str, mirror: bool, group_size: int | None, sync_layers: int, plain_layers: int) -> str:
    if name == "A":
        return ("converted by ddpdoctor: convert_sync_batchnorm when DDP wraps the model (the mirror question)"
                if mirror else f"as written: {sync_layers} SyncBatchNorm layer{'s' if sync_layers != 1 else ''}")
    if name == "L":
        return "the same SyncBatchNorm layers normalising with per-rank statistics"
    if name == "P":
        return (f"as written: {plain_layers} plain BatchNorm layer{'s' if plain_layers != 1 else ''}" if mirror
                else "plain DDP: the conversion to SyncBatchNorm undone")
    return f"SyncBatchNorm over subgroups of {group_size} ranks"


def syncbn_layers(run_dir: Path) -> tuple[int, int]:
    """(SyncBN-like layers, plain BN layers) the as-written run used, from its events."""
    from ddpdoctor.rundata import read_run

    run = read_run(run_dir)
    procs = run.rank_processes
    if not procs:
        return 0, 0
    proc = procs[min(procs)]
    sync = plain = 0
    for e in proc.of("bn_layer"):
        if e.get("bn_kind") in ("sync", "emulated_sync") or "sync" in str(e.get("cls", "")).lower():
            sync += 1
        else:
            plain += 1
    if not sync:
        sync = max((int(e.get("syncbn_layers") or 0) for e in proc.of("sync_bn_convert")), default=0)
        sync = max(sync, len(proc.of("bn_conversion")))
    return sync, plain


def run_triage(cfg: TriageConfig) -> Report:
    from ddpdoctor.check import validate_script
    from ddpdoctor.static import analyze_file

    check = cfg.check
    script = validate_script(check.script)
    static: list[Finding] = list(analyze_file(script))
    from ddpdoctor.probe.supervisor import Supervisor

    guard = claim = None
    if check.keep_run is None:
        base, guard = Supervisor.guarded_tempdir("ddpdoctor-triage-")  # removed even if this process is killed
    else:
        base = check.keep_run
        claim = _prepare_triage_dir(base)
    total = len(cfg.arms)
    launch = ArmLaunch(check, total)
    try:
        written_dir = base / "arm-A"
        launch.run(written_dir, static, arm_settings("A", False, cfg.seed, cfg.group_size, as_written=True),
                   f"arm A 1/{total}: the script as written")
        sync, plain = syncbn_layers(written_dir)
        mirror = sync == 0 and plain > 0
        written_name = "P" if mirror else "A"
        if mirror:
            written_dir = written_dir.rename(base / "arm-P")
            _set_meta_arm(written_dir, "P")
        dirs = {written_name: written_dir}
        if sync or plain:
            for name in cfg.arms:
                if name == written_name:
                    continue
                d = base / f"arm-{name}"
                what = _what(name, mirror, cfg.group_size, sync, plain)
                launch.run(d, static, arm_settings(name, mirror, cfg.seed, cfg.group_size, as_written=False),
                           f"arm {name} {len(dirs) + 1}/{total}: {what}")
                dirs[name] = d
        launch.close()
        layout = {"written": written_name, "mirror": mirror, "syncbn_layers": sync, "plain_layers": plain,
                  "group_size": cfg.group_size, "arm_dirs": {k: v.name for k, v in dirs.items()},
                  "launch": launch.summary()}
        report, extra = assemble(base, layout, check, static, overrides=None)
        if check.keep_run is not None:
            (base / TRIAGE_FILE).write_text(json.dumps({"layout": layout, **extra}, indent=1, default=str),
                                            encoding="utf-8")
        return report
    finally:
        launch.close()
        if guard is not None:
            shutil.rmtree(base, ignore_errors=True)
            guard.stop()
        if claim is not None:
            claim.release()


def is_triage_dir(path: Path) -> bool:
    return (Path(path) / TRIAGE_FILE).is_file()


def report_triage(base: Path, check: CheckConfig, overrides: dict[str, Any] | None = None) -> Report:
    """`ddpdoctor report DIR` on a triage directory: redo every arm's analysis and the verdicts, the settings each
    arm recorded replaced by `overrides` (base_lr, base_batch, lr_scaling, small_bn_batch)."""
    from ddpdoctor.analyses import load_static_findings

    try:
        from ddpdoctor.rundata import read_text_bounded

        layout = json.loads(read_text_bounded(base / TRIAGE_FILE, "strict"))["layout"]
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"{base / TRIAGE_FILE}: unreadable: {exc}") from None
    written = base / layout["arm_dirs"][layout["written"]]
    return assemble(base, layout, check, load_static_findings(written), overrides=overrides)[0]


def assemble(base: Path, layout: dict[str, Any], check: CheckConfig, static: list[Finding], *,
             overrides: dict[str, Any] | None) -> tuple[Report, dict]:
    """Analyse each arm's run directory (its recorded settings, replaced by `overrides`), decide the verdicts, and
    build the report; `check` gives the arms' settings (base_batch...) and --select/--ignore."""
    from ddpdoctor.analyses import analyze_context, build_context
    from ddpdoctor.causes import fold_consequences
    from ddpdoctor.check import filter_findings, merge_static_and_probe
    from ddpdoctor.triage.model import TRIAGE_RULES, Arm
    from ddpdoctor.triage.verdicts import cause_findings, triage

    written_name, mirror = layout["written"], bool(layout["mirror"])
    sync, plain = int(layout["syncbn_layers"]), int(layout["plain_layers"])
    arms: list[Arm] = []
    analyses: dict[str, Any] = {}
    for name in ("A", "L", "P", "G"):
        if name not in layout["arm_dirs"]:
            continue
        d = base / layout["arm_dirs"][name]
        ctx = build_context(d, overrides)
        analysis = analyze_context(ctx)
        analyses[name] = analysis
        arms.append(Arm(name=name, what=_what(name, mirror, layout.get("group_size"), sync, plain),
                        ctx=ctx, findings=list(analysis.findings),
                        as_written=name == written_name, mirror=mirror))
    written = next(arm for arm in arms if arm.as_written)
    result = triage(arms, written.ctx.settings) if (sync or plain) else None
    wa = analyses[written_name]
    probe = [f for f in wa.findings if f.rule not in TRIAGE_RULES or mirror]
    if result is not None and not mirror:
        probe += cause_findings(result, written)
    merged, cleared = merge_static_and_probe(static, probe, wa.clearances, select=check.select, ignore=check.ignore)
    kept = fold_consequences(filter_findings(merged, select=check.select, ignore=check.ignore,
                                             base_dir=wa.base_dir, sources=wa.sources))
    notes = list(wa.notes) + cleared + (list(result.notes) if result is not None else []) + _launch_notes(layout)
    triage_json = _triage_json(result, written, arms, mirror)
    report = Report(script=wa.script, args=tuple(wa.args), environment=dict(wa.environment),
                    findings=tuple(kept), notes=tuple(notes), tables=wa.tables, base_dir=wa.base_dir,
                    triage=triage_json, triage_text=_text_extras(result, arms),
                    measured=result.measured if result is not None else not _stopped(written))
    return report, {"triage": triage_json, "pairing": result.pairing if result is not None else None}


def _launch_notes(layout: dict[str, Any]) -> list[str]:
    """Where arms could not share one launch (ArmLaunch): which ones were launched on their own, and why."""
    launch = layout.get("launch") or {}
    separate = [a for a in launch.get("separate") or () if a in layout.get("arm_dirs", {})]
    if len(layout.get("arm_dirs", {})) < 2 or not separate or not launch.get("why"):
        return []
    return [f"triage: arm{'s' if len(separate) > 1 else ''} {', '.join(separate)} launched separately, each paying "
            f"the script's start-up (interpreter, torch import) again: {launch['why']}"]


def _stopped(written: Any) -> bool:
    """The as-written arm failed (or stopped) without a step: nothing was measured."""
    return written.steps == 0 and any(f.rule in ("DD901", "DD902", "DD904") for f in written.findings)


def _triage_json(result: Any, written: Any, arms: list[Any], mirror: bool) -> dict[str, Any]:
    if result is None:
        failed = [f for f in written.findings if f.rule in ("DD901", "DD902")]
        if failed:
            headline = (f"Nothing measured: the run as written failed before any BatchNorm layer was recorded "
                        f"({failed[0].rule} {failed[0].name}), so no arm could be compared and triage claims "
                        "nothing — fix that first.")
        else:
            headline = ("The script uses no BatchNorm layer: there is nothing for SyncBN to change, so triage does "
                        "not apply.")
        return {"arms": [{"name": a.name, "what": a.what, "steps": a.steps} for a in arms], "paired": False,
                "headline": headline, "causes": []}
    return result.to_json()


def _text_extras(result: Any, arms: list[Any]) -> dict[str, Any]:
    """What the text report shows beyond the JSON `triage` object: emulation and pairing details."""
    if result is None:
        return {"emulated": any(e.get("cuda_emulated") for a in arms for _, e in a.ctx.run.events("torch_ready")),
                "pairing": None, "mirror": False}
    return {"emulated": result.emulated, "pairing": result.pairing, "mirror": result.mirror,
            "severity": {i: c.severity.label for i, c in enumerate(result.causes)}}


def _prepare_triage_dir(base: Path) -> RunDirClaim:
    """`triage --keep-run DIR`: new, empty, or one of ddpdoctor's own (its marker, ddpdoctor.probe.rundir); only
    the names a triage writes are cleared, and a folder without the marker is refused, whatever it holds. The
    folder stays locked until the triage ends: a second triage into it is refused instead of deleting its arms."""
    from ddpdoctor.probe.rundir import MARKER, claim_folder, has_marker

    if base.is_dir() and any(p.name != MARKER for p in base.iterdir()) and not has_marker(base):
        raise UsageError(
            f"--keep-run {base}: not empty and not a ddpdoctor triage directory; use a new or empty folder"
        )
    names = (TRIAGE_FILE, "arm-A", "arm-L", "arm-P", "arm-G")
    for name in names:  # a device, FIFO or socket under one of its names is nothing a triage wrote
        p = base / name
        if p.exists() and not p.is_symlink() and not p.is_file() and not p.is_dir():
            raise UsageError(f"--keep-run {base}: {name} is not a file or folder a triage writes (a device, FIFO or "
                             "socket); ddpdoctor never replaces one")
    claim = claim_folder(base, "--keep-run", "a triage writing into it")
    for name in names:
        p = base / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists() or p.is_symlink():
            p.unlink()
    return claim


def _set_meta_arm(run_dir: Path, name: str) -> None:
    from ddpdoctor.events import META_FILE
    from ddpdoctor.probe.launcher import write_json

    path = run_dir / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    meta["arm"] = {**(meta.get("arm") or {}), "arm": name}
    write_json(path, meta)


def with_triage_defaults(cfg: CheckConfig, epochs: int | None, steps: int | None) -> CheckConfig:
    return replace(cfg, epochs=epochs or DEFAULT_EPOCHS, steps=steps or DEFAULT_STEPS)
