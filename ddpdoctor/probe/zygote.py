"""One launch for several probe runs of the same script (`ddpdoctor triage`'s arms): each rank's process pays for
the interpreter, `import torch` and the rest of what every run of a DDP script imports once, then forks one child
per run, which runs the script instrumented exactly as a rank started by torchrun would (ddpdoctor.probe.bootstrap).

    ddpdoctor ──► supervisor ──► python -m ddpdoctor.probe.agent ... -m ddpdoctor.probe.zygote SCRIPT ARGS
                                     └─► N × zygote (RANK, LOCAL_RANK, ...: torchrun's contract)
                                             └─► one forked child per run order: the script, instrumented

Profile that chose it (fixtures/triage/clean.py, 2 ranks, 3 x 10 steps, ~20 s wall): per rank ~3.8 s CPU for
`import torch`, ~4.2 s for torch._dynamo (DistributedDataParallel imports it at construction), ~1.5 s for the
script's own body (dataset, model, 30 steps); the launcher's agent ~2.7 s (it imports torch too). The arms differ
only in the settings the launcher gives (ProbeSettings: bn_mode, bn_convert, ... and the run directory), so
everything before the script is the same for every arm and is done once here.

The protocol is files in the control folder CTRL (settings.run_dir of the zygote), written atomically:
- `order-<k>.json` (ddpdoctor): the k-th run's environment (every DDPDOCTOR_* setting, TMPDIR, MASTER_PORT), or
  {"stop": true}: the zygote writes `left-rank<r>.json` and exits 0 the children's way (threads joined, atexit
  run, os._exit): the interpreter's own teardown of a process holding torch and torch._dynamo takes 5-8 s of CPU
  on a loaded 2-core machine (0.3 s this way), and the launch waited for it at the end of every triage and
  conversion check.
- `started-<k>-rank<r>.json` (zygote): the child's pid; `done-<k>-rank<r>.json`: how it ended (exit code or
  signal), the record torchrun's agent keeps of its ranks.

Each child: a fresh process group and rendezvous on the port of its order (never the agent's store: its keys are
one run's), its own stdout/stderr files in the run's logs/, its own TMPDIR, PR_SET_PDEATHSIG on the zygote. The
zygote never runs user code and never computes with torch, so no OpenMP pool or CUDA context exists when it forks
(DataLoader's fork workers start from the same state). Module attributes the zygote's imports bound to functions
the run's file view patches afterwards (`from builtins import open as bltn_open` in tarfile) are re-bound in the
child (ddpdoctor.probe.fsview.rebind), as they would be had torch been imported after the view was installed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ddpdoctor.probe.settings import ENV_PREFIX, RUN_DIR_ENV

SHARED_ENV = "DDPDOCTOR_SHARED"  # set (to "1") in the zygote's environment: the launch runs orders
STOP = "stop"
_POLL = 0.02


def order_file(ctrl: Path, k: int) -> Path:
    return ctrl / f"order-{k}.json"


def started_file(ctrl: Path, k: int, rank: int) -> Path:
    return ctrl / f"started-{k}-rank{rank}.json"


def done_file(ctrl: Path, k: int, rank: int) -> Path:
    return ctrl / f"done-{k}-rank{rank}.json"


def left_file(ctrl: Path, rank: int) -> Path:
    return ctrl / f"left-rank{rank}.json"


def write_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def preload() -> list[str]:
    """What every run imports before the script's first line does anything (the probe's own modules, torch, the
    modules DDP imports at construction). Returns the names of the modules imported here."""
    before = set(sys.modules)
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import ddpdoctor.probe.bootstrap  # noqa: F401 - the instrumentation, imported once
    import ddpdoctor.probe.emulation  # noqa: F401

    try:
        import torch._dynamo  # noqa: F401 - DistributedDataParallel.__init__ imports it: ~4 s of every run
    except Exception:  # noqa: BLE001 - a torch without it: the child imports what it needs
        pass
    return sorted(set(sys.modules) - before)


def launch_env_file(ctrl: Path) -> Path:
    return ctrl / "launch-env.json"


def _child_environment(order_env: dict[str, str], launch_env: dict[str, str] | None) -> dict[str, str]:
    """The run's own environment (what a launch of its own would give its agent: its settings, TMPDIR, rendezvous
    port) with what torchrun's agent gave this rank on top: the variables the agent set or changed (RANK,
    LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_*...), told from the environment the launch started the agent with. The
    agent's store belongs to no run."""
    if launch_env is None:  # an older launch: its orders carry the run's settings alone
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env.update(order_env)
    else:
        env = dict(order_env)
        env.update({k: v for k, v in os.environ.items()
                    if launch_env.get(k) != v and not k.startswith(ENV_PREFIX) and k != SHARED_ENV})
        for key in ("TMPDIR", "TEMP", "TMP", "MASTER_PORT"):
            if key in order_env:
                env[key] = order_env[key]
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return env


def _run_child(order: dict[str, Any], rank: int, zygote: int, preloaded: list[str],
               launch_env: dict[str, str] | None) -> None:
    """In the forked child: become the rank of this run, run the script; never returns."""
    code = 1
    try:
        from ddpdoctor.probe import procs

        procs.die_with_parent(zygote)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        env = _child_environment(order["env"], launch_env)
        env[procs.PARENT_ENV] = str(zygote)
        os.environ.clear()
        os.environ.update(env)
        if order.get("cwd"):
            os.chdir(order["cwd"])
        logs = Path(order["logs"])
        for fd, name in ((1, f"rank{rank}.stdout"), (2, f"rank{rank}.stderr")):
            out = os.open(logs / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        import tempfile

        tempfile.tempdir = None  # the run's TMPDIR, read again
        from ddpdoctor.probe import bootstrap
        from ddpdoctor.probe.settings import ProbeSettings

        settings = ProbeSettings.from_env()
        if settings is None:
            raise RuntimeError("no settings in the run order")
        bootstrap.run_script(settings, order["script"], list(order["args"]), preloaded=preloaded)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback on stderr, exit 1
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:  # noqa: BLE001
            pass
        code = 1
    _exit(code)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:  # noqa: BLE001
        pass
    return 1


def _exit(code: int) -> None:
    """The interpreter's own way out of a process that is not going to return to the zygote's loop."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at interpreter exit
    except BaseException:  # noqa: BLE001
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _status(status: int) -> dict[str, Any]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {"exitcode": -sig, "signal": signal.Signals(sig).name if sig in signal.Signals._value2member_map_
                else str(sig)}
    return {"exitcode": os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1, "signal": None}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ctrl = Path(os.environ.get(RUN_DIR_ENV, ""))
    if not argv or not ctrl.is_dir() or not os.environ.get(SHARED_ENV):
        sys.stderr.write("usage: DDPDOCTOR_SHARED=1 DDPDOCTOR_RUN_DIR=CTRL python -m ddpdoctor.probe.zygote SCRIPT\n")
        return 2
    rank = int(os.environ.get("RANK", "0"))
    preloaded = preload()
    launch_env = read_json(launch_env_file(ctrl))
    me = os.getpid()
    k = 0
    while True:
        path = order_file(ctrl, k)
        order = read_json(path)
        if order is None:
            time.sleep(_POLL)
            continue
        if order.get(STOP):
            write_atomic(left_file(ctrl, rank), {"pid": me, "t": time.time()})
            _exit(0)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(order, rank, me, preloaded, launch_env)
        write_atomic(started_file(ctrl, k, rank), {"pid": pid, "t": time.time()})
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        write_atomic(done_file(ctrl, k, rank), {"pid": pid, "rank": rank, "t": time.time(), **_status(status)})
        k += 1


if __name__ == "__main__":
    sys.exit(main())
