"""Running arms of one script — triage's A/L/P/G, and the conversion check `check` runs when it sees SyncBN: each
arm a complete probe run with its own settings and run directory, all of them in one shared launch where the script
allows it (ddpdoctor.probe.shared: the interpreter, torch and the probe imported once per rank, each arm a fork),
else one launch per arm. Below `check` and `triage`, so both use the same path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpdoctor.config import CheckConfig
from ddpdoctor.findings import Finding
from ddpdoctor.records import LaunchMode


def shared_launch_refusal(check: CheckConfig) -> str | None:
    """Why the arms of this script cannot share one launch (ddpdoctor.probe.zygote), or None when they can: they
    share it when torchrun starts the script's ranks; a script that starts its own ranks (mp.spawn) or runs as
    one process is launched once per arm, and so is a run on real CUDA devices."""
    from ddpdoctor.probe.plan import plan_for_file

    if check.device == "cuda":
        return "--device cuda: each arm's ranks start on the GPUs afresh"
    try:
        mode = plan_for_file(Path(check.script), check.script_args, check.nproc).mode
    except Exception as exc:  # noqa: BLE001 - the launch itself reports what is wrong with the script
        return f"the launch plan failed ({type(exc).__name__})"
    if mode is not LaunchMode.TORCHRUN:
        return ("the script starts its own ranks" if mode is LaunchMode.SPAWN else "the script runs as one process") + \
            " (each arm is launched as the script starts)"
    return None


class ArmLaunch:
    """How a triage's arms are launched: one shared launch for all of them (SharedLaunch: the interpreter, torch
    and the probe imported once per rank, each arm a fork) when the script allows it, else one launch per arm;
    `summary` says which, and why not, for triage.json and the report."""

    def __init__(self, check: CheckConfig, arms: int, *, shared: bool = True, what: str = "triage") -> None:
        self.check = check
        self.what = what  # what runs the arms, in the progress lines: "triage" or "conversion check"
        self.arms = arms
        self.refusal = "one arm" if arms < 2 else shared_launch_refusal(check) if shared else "asked for"
        self.shared: Any = None
        self.separate: list[str] = []
        self.ended: str | None = None

    def run(self, run_dir: Path, static: list[Finding], arm: dict[str, Any], label: str) -> None:
        if self.refusal is None and self.shared is None and self.ended is None:
            from ddpdoctor.probe.shared import SharedLaunch

            self.shared = SharedLaunch(self.check, self.arms).start()
        shared = self.shared if self.ended is None else None
        before = shared.k if shared is not None else 0
        try:
            run_arm(self.check, run_dir, static, arm, label, shared=shared, what=self.what)
        finally:
            if shared is None or shared.k == before:  # launched alone
                self.separate.append(str(arm.get("arm", "?")))
            if shared is not None and shared.ended is not None and self.ended is None:
                self.ended = shared.ended

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()

    def summary(self) -> dict[str, Any]:
        """{"shared": bool, "separate": [arms launched alone], "why": reason or None}"""
        why = self.refusal if self.refusal != "one arm" else None
        if why is None and self.ended not in (None, "closed"):
            why = f"the shared launch ended early: {self.ended}"
        return {"shared": self.shared is not None, "separate": list(self.separate), "why": why}


def run_arms(check: CheckConfig, arms: Sequence[tuple[Path, dict[str, Any]]], static: Sequence[Finding] = (),
             *, shared: bool = True, what: str = "triage") -> list[Path]:
    """Run arms of `check`'s script: each (run directory, ProbeSettings fields of the arm as `arm_settings` makes
    them, e.g. {"arm": "P", "seed": 0, "bn_mode": "plain"}), in order, in one shared launch where the script
    allows it (else, or with shared=False, one launch each). Returns their run directories, each a complete probe
    run (`ddpdoctor report DIR`); they must be new or empty. Progress lines as triage's unless check.quiet."""
    launch = ArmLaunch(check, len(arms), shared=shared, what=what)
    try:
        for i, (run_dir, arm) in enumerate(arms):
            launch.run(run_dir, list(static), arm, f"arm {arm.get('arm', '?')} {i + 1}/{len(arms)}")
    finally:
        launch.close()
    return [run_dir for run_dir, _ in arms]


def run_arm(check: CheckConfig, run_dir: Path, static: list[Finding], arm: dict[str, Any], label: str,
            shared: Any = None, what: str = "triage") -> None:
    """One arm's probe run, with check's progress display on stderr (unless quiet): a line naming the arm, then
    the ranks' live table or plain lines (ddpdoctor.probe.progress), so a triage of minutes is never silent."""
    from ddpdoctor.probe.launcher import run_probe
    from ddpdoctor.probe.progress import showing

    progress = None
    if not check.quiet:
        import sys

        from ddpdoctor.probe.progress import ProgressDisplay

        sys.stderr.write(f"ddpdoctor: {what} {label}\n")
        sys.stderr.flush()
        whose = "" if what == "triage" else f"{what}, "
        progress = ProgressDisplay(run_dir, script=f"{check.script} ({whose}arm {arm.get('arm', '?')})",
                                   nproc=check.nproc,
                                   epochs=check.epochs, steps=check.steps, timeout=check.timeout)
    with showing(progress):
        run_probe(check, run_dir, static_findings=static, arm=arm, progress=progress, shared=shared)
