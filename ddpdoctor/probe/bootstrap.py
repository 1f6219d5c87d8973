"""The probe inside a rank: `python -m ddpdoctor.probe.bootstrap SCRIPT [ARGS]`, started by torch.distributed.run
(one per rank) or once for a self-spawning script. Settings come from DDPDOCTOR_* environment variables.

Runs the user's script unmodified with runpy (argv, `__main__`, the script's directory on sys.path[0], the
user's working directory), instrumented. The script's exceptions are recorded and then propagate exactly as
they would; when the script returns, the run ends the probe's way (done, wait for peers, flush, os._exit).
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
import traceback

from ddpdoctor.probe import launch_check, launch_env
from ddpdoctor.probe.instrument import instrument_process
from ddpdoctor.probe.session import install_clean_excepthook, user_frame_of
from ddpdoctor.probe.settings import ProbeSettings
from ddpdoctor.probe.site import site_dir
from ddpdoctor.records import LaunchMode

ROLES = {LaunchMode.TORCHRUN: "rank", LaunchMode.SPAWN: "main", LaunchMode.SINGLE: "rank",
         LaunchMode.ATTACH: "attached"}


def _export_for_children(settings: ProbeSettings) -> None:
    """Children started by the script (mp.spawn, multiprocessing) inherit the settings and find the
    sitecustomize that instruments them."""
    os.environ.update(settings.to_env())
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if site_dir() not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([site_dir(), *entries])


def _join_threads(deadline: float) -> None:
    """The interpreter would wait for non-daemon threads (an asynchronous checkpoint writer) before exiting."""
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is me or t.daemon or not t.is_alive():
            continue
        t.join(max(0.0, deadline - time.monotonic()))


def run_script(settings: ProbeSettings, script: str, args: list[str], preloaded: list[str] = ()) -> None:
    """Run `script` instrumented in this process; never returns normally (os._exit) unless the script raises.
    `preloaded`: modules imported before the instrumentation (a forked child of ddpdoctor.probe.zygote)."""
    _export_for_children(settings)
    probe = instrument_process(settings, ROLES.get(settings.mode, "rank"))
    if preloaded and settings.mode is not LaunchMode.ATTACH:
        from ddpdoctor.probe import fsview

        probe.safely("file view", fsview.rebind, preloaded)
    install_clean_excepthook()
    contract = launch_env.apply(settings)
    if contract is not None:
        probe.emit("launch_env", **contract)
    script_abs = os.path.abspath(script)
    injected: list[str] = []
    if settings.local_rank_arg:
        # what torch.distributed.launch did for scripts that read their device from --local_rank
        injected = [f"{settings.local_rank_arg}={os.environ.get('LOCAL_RANK', '0')}"]
    sys.argv = [script, *injected, *args]
    # as `python script.py` gives it: the script's folder first, in place of the working directory `-m` put there
    # (which ddpdoctor's package or the probe's sitecustomize took out before importing anything of ours)
    try:
        if sys.path and sys.path[0] in ("", os.getcwd()):
            del sys.path[0]
    except OSError:
        pass
    sys.path.insert(0, os.path.dirname(script_abs))
    probe.emit("script_start", script=script_abs, args=sys.argv[1:], injected=injected)
    probe.arm_stall_watchdog()
    try:
        # keep the script's globals alive until the end hooks have run (runpy returns a copy)
        script_globals = runpy.run_path(script_abs, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            _finish(probe, "sys.exit(0)", site=user_frame_of(traceback.extract_tb(exc.__traceback__)))
        probe.record_exception(exc, "script")
        probe.patcher.undo()
        raise
    except BaseException as exc:
        why = launch_check.exception_needs_launcher(probe, exc)
        if why is not None:
            launch_check.relaunch_under_launcher(probe, why, user_frame_of(traceback.extract_tb(exc.__traceback__)))
        probe.record_exception(exc, "script")
        probe.patcher.undo()
        raise
    _finish(probe, "script returned", script_globals)


def _finish(probe, reason: str, script_globals: object = None, site: dict | None = None) -> None:  # noqa: ANN001
    _join_threads(time.monotonic() + max(5.0, probe.settings.timeout))
    probe.end_run(reason, run_atexit=True, site=site)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = ProbeSettings.from_env()
    if settings is None or not argv:
        sys.stderr.write("usage: DDPDOCTOR_RUN_DIR=... python -m ddpdoctor.probe.bootstrap SCRIPT [ARGS...]\n")
        raise SystemExit(2)
    run_script(settings, argv[0], argv[1:])


if __name__ == "__main__":
    main()
