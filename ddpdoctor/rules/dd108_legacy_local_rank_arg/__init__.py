"""DD108 legacy-local-rank-arg: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD108"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="legacy-local-rank-arg",
    severity=Severity.MEDIUM,
    summary="--local_rank argument without LOCAL_RANK fallback (torchrun does not pass it)",
    what=prose(
        """
        Static analysis looks for an argparse option `--local_rank` (or `--local-rank`) in a script that never
        reads the LOCAL_RANK environment variable, typically with `default=0`. An option whose value nothing
        reads is reported low, and only when it accepts one spelling: the legacy launcher's other spelling stops
        the run.

        The probe launches the script as torchrun does (LOCAL_RANK in the environment, no argument) and
        records the value every rank parsed and whether the script reads LOCAL_RANK itself; it fires when the
        ranks of a node all kept the option's default and did not each end up on a GPU of their own (a script
        that binds its device from the global rank is not misled by the default). A default that names no
        device (-1, None) would stop the run at the first device call: the probe then gives each rank its
        LOCAL_RANK instead, as the legacy launcher passed it, so the rest of the run is still measured, and
        says so.
        """
    ),
    why=prose(
        """
        The legacy launcher, `torch.distributed.launch`, passed the local rank on the command line; since
        torch 2.0 it passes `--local-rank` (dashed), so a parser that only knows `--local_rank` stops with
        "unrecognized arguments". torchrun, its replacement, passes nothing and sets LOCAL_RANK in the
        environment instead. A script that only reads the argument silently falls back to its default,
        usually 0, in every process: all ranks of a node bind GPU 0 (see DD105), `device_ids=[0]` everywhere,
        or the job fails in NCCL, and any per-GPU batch or learning-rate adjustment made to get it running
        changes the recipe.
        """
    ),
    example=snippet(
        """
        # Bad: torchrun never passes --local_rank, so every process gets 0
        parser.add_argument("--local_rank", type=int, default=0)
        args = parser.parse_args()
        torch.cuda.set_device(args.local_rank)

        # Good: accept both spellings, default to the launcher's environment
        parser.add_argument("--local-rank", "--local_rank", type=int,
                            default=int(os.environ.get("LOCAL_RANK", 0)))
        args = parser.parse_args()
        torch.cuda.set_device(args.local_rank)
        """
    ),
    fix=(
        "Read the local rank from os.environ[\"LOCAL_RANK\"]; keep --local-rank/--local_rank only as an "
        "override for the legacy launcher."
    ),
    fix_variants={
        "unread": (
            "Accept both spellings ({option} and {other}) or drop the option and launch with torchrun, which passes "
            "no argument."
        ),
        "probe": (
            "Read the local rank from the environment: int(os.environ['LOCAL_RANK']) (keep {option} only as a "
            "fallback)."
        ),
    },
    run_only="a launch-argument problem decides which device a rank uses",
)
