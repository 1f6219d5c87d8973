"""`python -m ddpdoctor.probe.agent TORCHRUN_ARGS...`: torch.distributed.run's own launcher (elastic agent), plus
a record of how it ended (per-rank exit codes and signals) in the run directory's agent.json."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ddpdoctor.probe.procs import PARENT_ENV
from ddpdoctor.probe.settings import RUN_DIR_ENV

AGENT_FILE = "agent.json"
# options ddpdoctor passes for tidiness that older torchruns lack (--shutdown-timeout: torch 2.12+): dropped, with
# their value, where this torch's launcher does not know them; its own default applies
OPTIONAL = {"--shutdown-timeout": 1}


class LaunchArgsError(Exception):
    """This torch's torch.distributed.run rejected the arguments ddpdoctor built (a ddpdoctor bug, never the user's)."""


def compatible_args(argv: list[str], parser: Any) -> list[str]:
    """argv without the OPTIONAL options `parser` does not know; then checked against it, so that a rejection is
    a LaunchArgsError with argparse's message rather than a bare exit 2."""
    known = {opt for action in parser._actions for opt in action.option_strings}
    # only the launcher's own options, before `-m MODULE` (ddpdoctor always launches a module): what follows is the
    # user's script and its arguments, passed through untouched
    end = next((i for i, arg in enumerate(argv) if arg in ("-m", "--module")), len(argv))
    out, i = [], 0
    while i < len(argv):
        if i < end and argv[i] in OPTIONAL and argv[i] not in known:
            i += 1 + OPTIONAL[argv[i]]
            continue
        out.append(argv[i])
        i += 1

    def error(message: str) -> None:
        raise LaunchArgsError(message)

    parser.error = error
    parser.parse_args(out)
    return out


def _failures(exc: Any) -> list[dict[str, Any]]:
    out = []
    for rank, f in sorted(getattr(exc, "failures", {}).items()):
        try:
            signal_name = f.signal_name()
        except Exception:
            signal_name = None
        out.append(
            {
                "rank": int(rank),
                "local_rank": getattr(f, "local_rank", None),
                "pid": getattr(f, "pid", None),
                "exitcode": getattr(f, "exitcode", None),
                "signal": signal_name if signal_name and signal_name != "<N/A>" else None,
                "timestamp": getattr(f, "timestamp", None),
                "message": str(getattr(f, "message", "") or "")[:2000],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the ranks ask for SIGKILL when this agent dies, checked against its pid (site/sitecustomize.py)
    os.environ[PARENT_ENV] = str(os.getpid())
    run_dir = Path(os.environ.get(RUN_DIR_ENV, "."))
    started = time.time()
    outcome: dict[str, Any] = {"ok": False, "started": started}
    code = 1
    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser
        from torch.distributed.run import main as torchrun_main

        try:
            argv = compatible_args(argv, get_args_parser())
        except LaunchArgsError as exc:
            import torch

            outcome["error"] = (f"torch {torch.__version__}'s torch.distributed.run rejected ddpdoctor's launch "
                                f"arguments (a ddpdoctor bug, please report it): {exc}")
            outcome["launch_args_rejected"] = True
            raise SystemExit(2) from None
        try:
            torchrun_main(argv)
            outcome["ok"] = True
            code = 0
        except ChildFailedError as exc:
            outcome["failures"] = _failures(exc)
    except SystemExit as exc:
        outcome.setdefault("error", f"torch.distributed.run exited with {exc.code}")
    except BaseException as exc:  # the agent's own failure (rendezvous, port in use): recorded for the report
        outcome["error"] = f"{type(exc).__name__}: {exc}"[:4000]
    outcome["ended"] = time.time()
    tmp = run_dir / (AGENT_FILE + ".tmp")
    try:
        tmp.write_text(json.dumps(outcome), encoding="utf-8")
        os.replace(tmp, run_dir / AGENT_FILE)
    except OSError:
        pass
    return code


if __name__ == "__main__":
    sys.exit(main())
