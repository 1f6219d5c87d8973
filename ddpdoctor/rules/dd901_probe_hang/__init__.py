"""DD901 probe-hang: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD901"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="probe-hang",
    severity=Severity.CRITICAL,
    summary="ranks stopped making progress; per-rank Python stacks and the pending collective in evidence",
    what=prose(
        """
        The probe fires when, at its `--timeout`, a rank has been silent (no step, collective or other event)
        much longer than its own step pace while blocked in a call that waits for the other ranks (a
        collective, a point-to-point receive, DDP's buffer broadcast or backward). Before it ends the ranks it
        records each rank's Python stack and the collective each rank entered and has not left. A run that
        was still making progress when the timeout expired is not a hang: the report says so in a note, with
        the observed step time and a --timeout that would fit, and analyses the steps it recorded. So is a run
        slow to start (a loaded machine can spend minutes importing torch): ranks waiting in the rendezvous for
        a peer that has not reached it yet, or no rank started at all when the timeout hit.
        """
    ),
    why=prose(
        """
        A hang means the ranks disagree about what comes next: some wait in a collective the others never
        call (DD206), have no more batches for (DD306), or a rendezvous waits for ranks that do not exist
        (DD104, DD109). Real jobs sit in that state until the process-group timeout, then crash or restart
        from the last checkpoint. The same disagreement is harmful when it does not hang: collectives that
        happen to match in size silently exchange the wrong tensors. The stacks show where each rank waits.
        """
    ),
    example=snippet(
        """
        # Bad: rank 1 never reaches the barrier rank 0 waits in
        if rank == 0:
            save_checkpoint(model)
            dist.barrier()

        # Good: every rank reaches the barrier
        if rank == 0:
            save_checkpoint(model)
        dist.barrier()
        """
    ),
    fix=(
        "Read the per-rank stacks and pending collectives in the evidence, and make every rank call the same "
        "collectives in the same order."
    ),
    fix_variants={
        "probe": (
            "Make every rank call the same collectives in the same order (no collective or DDP forward inside a "
            "rank-dependent branch); the blocked frames are in evidence."
        ),
        "rendezvous": (
            "The ranks never all joined the process group: give init_process_group the launcher's rank and world "
            "size (not literals), the same init_method/MASTER_ADDR/MASTER_PORT on every rank, and make sure every "
            "process reaches it."
        ),
        "point_to_point": (
            "Pair every send/recv (isend/irecv) with the matching call on the peer rank, in the same order; the "
            "blocked call is in evidence."
        ),
        "backward": (
            "Some ranks wait in DDP's gradient all-reduce that the others never reach: give every rank the same "
            "number of backward passes (drop_last, even shards, or DDP's join() context for uneven inputs)."
        ),
    },
    run_only="a hang stops the run",
)
