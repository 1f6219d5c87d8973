"""The elastic agent's arguments on torchruns older than the one the suite runs: ddpdoctor passes a few options for
tidiness that older torch.distributed.run parsers lack (--shutdown-timeout is torch 2.12+; on torch 2.11, found on
a GPU node, every launch exited 2 and was reported as DD902). They are dropped there; anything else the parser
rejects is ddpdoctor's bug, said as such, never a rank failure."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from ddpdoctor.probe.agent import LaunchArgsError, compatible_args


def _parser(shutdown_timeout: bool) -> argparse.ArgumentParser:
    """This torch's torch.distributed.run parser, with or without --shutdown-timeout (torch 2.12+ has it, 2.11 not)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    action = next((a for a in parser._actions if "--shutdown-timeout" in a.option_strings), None)
    if action is not None and not shutdown_timeout:
        parser._handle_conflict_resolve(None, [(opt, action) for opt in action.option_strings])
    elif action is None and shutdown_timeout:
        parser.add_argument("--shutdown-timeout", type=int, default=30)
    return parser


AGENT_ARGS = ["--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", "29500",
              "--max-restarts", "0", "--shutdown-timeout", "3", "-m", "ddpdoctor.probe.bootstrap", "train.py",
              "--shutdown-timeout", "5"]


def test_an_option_this_torchrun_knows_is_kept() -> None:
    assert compatible_args(list(AGENT_ARGS), _parser(shutdown_timeout=True)) == AGENT_ARGS


def test_an_option_an_older_torchrun_lacks_is_dropped_and_the_scripts_arguments_are_untouched() -> None:
    parser = _parser(shutdown_timeout=False)
    assert "--shutdown-timeout" not in {o for a in parser._actions for o in a.option_strings}
    out = compatible_args(list(AGENT_ARGS), parser)
    assert out == AGENT_ARGS[:10] + ["-m", "ddpdoctor.probe.bootstrap", "train.py", "--shutdown-timeout",
                                                   "5"]


def test_a_rejected_launch_is_ddpdoctors_error_in_one_line_not_a_rank_failure(tmp_path) -> None:
    from torch.distributed.run import get_args_parser

    try:
        compatible_args(["--no-such-option", "-m", "x"], get_args_parser())
    except LaunchArgsError as exc:
        assert "unrecognized arguments: --no-such-option" in str(exc)
    else:
        raise AssertionError("accepted an option torchrun does not have")
    # the agent records it as such without starting a rank; the launcher turns the record into InternalError
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPDOCTOR_")}
    env["DDPDOCTOR_RUN_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "ddpdoctor.probe.agent", "--no-such-option", "-m", "x"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    record = json.loads((tmp_path / "agent.json").read_text())
    assert record["launch_args_rejected"] is True and "a ddpdoctor bug" in record["error"], record
    assert "unrecognized arguments: --no-such-option" in record["error"]
