"""DD103 replicas-diverged: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD103"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="replicas-diverged",
    severity=Severity.CRITICAL,
    summary="parameters differ across ranks after optimizer steps (digest compare)",
    what=prose(
        """
        The probe records, after every optimizer step, a digest of each parameter on each rank and compares
        them across ranks. It fires when any parameter differs, with the first step at which the ranks
        disagreed, the parameters that differ and the largest difference measured.
        """
    ),
    why=prose(
        """
        Data parallelism is only correct while every replica holds the same weights: DDP broadcasts rank 0's
        parameters and buffers at construction and then gives every rank the same averaged gradient, so
        identical optimizers keep the replicas bit-identical. Once they differ, each rank computes its
        gradient at a different point, the average is not the gradient of any one model, and the model you
        save or evaluate (usually rank 0's) has only partly been trained by the other ranks' data.

        Common causes: a forward that bypasses DDP (DD102); weights loaded or edited on one rank after DDP was
        constructed; parameters added or replaced after wrapping (their gradients are never reduced);
        rank-dependent learning rates or optimizer settings; a manual gradient reduction that differs per
        rank.
        """
    ),
    example=snippet(
        """
        # Bad: rank 0 loads weights after DDP broadcast the initial ones
        ddp = DDP(model, device_ids=[local_rank])
        if rank == 0:
            model.load_state_dict(torch.load("pretrained.pt"))

        # Good: load before wrapping; DDP then broadcasts the same weights to every rank
        model.load_state_dict(torch.load("pretrained.pt", map_location="cpu"))
        ddp = DDP(model, device_ids=[local_rank])
        """
    ),
    fix=(
        "Make every rank apply the same all-reduced update: remove what changes parameters on some ranks only "
        "(a forward that bypasses DDP, rank-local loads or edits after wrapping, rank-dependent optimizer "
        "settings)."
    ),
    fix_variants={
        "probe": (
            "Train through the DDP wrapper with the same initial weights on every rank; never step on unreduced "
            "gradients."
        ),
    },
)
