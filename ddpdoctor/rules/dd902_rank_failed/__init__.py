"""DD902 rank-failed: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD902"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="rank-failed",
    severity=Severity.CRITICAL,
    summary="a rank raised or died; exception text and traceback in evidence",
    what=prose(
        """
        The probe fires when a rank raised an exception or exited abnormally (non-zero status, signal) during
        the run, with the exception, its traceback, the exit status and which rank failed first in evidence.
        """
    ),
    why=prose(
        """
        A rank that dies stops the job: the launcher tears down the others, or they wait in their next
        collective until the timeout. The first failure is the root cause; errors printed afterwards by the
        other ranks (connection reset by peer, watchdog timeouts) are consequences, which is why the first
        failing rank is reported. Failures that only happen distributed are common: one rank reading a file
        another has not finished writing, per-rank paths, device mismatches. Findings that need the rest of
        the run are missing from a report with this finding.
        """
    ),
    example=snippet(
        """
        # Bad: rank 1 may read the file before rank 0 has written it
        if rank == 0:
            torch.save(model.state_dict(), "init.pt")
        model.load_state_dict(torch.load("init.pt"))

        # Good: wait for the writer
        if rank == 0:
            torch.save(model.state_dict(), "init.pt")
        dist.barrier()
        model.load_state_dict(torch.load("init.pt", map_location="cpu"))
        """
    ),
    fix=(
        "Fix the exception of the first rank that failed (its traceback is in the evidence); the other "
        "ranks' errors follow from it."
    ),
    fix_variants={
        "exception": (
            "Fix the error raised by the script (traceback in evidence); the probe's other findings hold up to the "
            "failure."
        ),
        "native_crash": (
            "Read the rank's stderr tail in evidence (native crash: collective mismatch, out of memory, segfault)."
        ),
        "emulated_devices": (
            "Run the probe with as many ranks as GPUs the script expects (--nproc N, N at least {needed}): on CPU the "
            "probe emulates one CUDA device per rank (a DataParallel script's one process sees them all)."
        ),
        "emulation_limit": (
            "Run the probe where the script's GPUs are (--device cuda, or `python -m ddpdoctor.probe` under your "
            "launcher): the CPU emulation does not reproduce this CUDA call, so the run stopped there."
        ),
        "launcher": (
            "Find what killed the launcher (dmesg for the OOM killer; a script that signals its parent process); "
            "with fewer ranks (--nproc) the probe needs less memory."
        ),
    },
    run_only="a failing rank stops the run",
)
