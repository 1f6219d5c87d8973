"""DD206 collective-on-subset: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD206"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="collective-on-subset",
    severity=Severity.HIGH,
    summary="DDP/SyncBN training-mode forward or a collective inside a rank-conditional branch (hang)",
    what=prose(
        """
        Static analysis looks, inside a branch whose condition depends on the rank (`rank == 0`,
        `dist.get_rank() == 0`, `local_rank == 0`, `is_main_process()`), for a torch.distributed collective
        (`barrier`, `all_reduce`, `broadcast`, `all_gather`, `reduce`, ...), a forward through the DDP wrapper,
        or a training-mode forward of a model with SyncBatchNorm.

        The probe records the sequence of collectives each rank enters and fires when the ranks' sequences
        differ: a collective some ranks never reach, or ranks pairing different collectives. A resulting hang
        also produces DD901.
        """
    ),
    why=prose(
        """
        A collective completes only when every rank of the group calls it, in the same order with matching
        tensors. Hidden collectives count too: SyncBatchNorm all-gathers statistics in every training-mode
        forward; DDP all-reduces gradients in backward and, with `broadcast_buffers=True` and a model with
        buffers (BatchNorm), broadcasts rank 0's buffers at the start of the first forward after a
        gradient-enabled one, even under `no_grad()` and in eval mode. Run on a subset of ranks, they block
        until the process-group timeout, or, worse, pair
        up with an unrelated collective on the other ranks: with matching sizes the ranks silently exchange
        the wrong tensors, otherwise the backend reports a mismatch (gloo: "Received data size doesn't
        match expected size").
        """
    ),
    example=snippet(
        """
        # Bad: only rank 0 evaluates through the DDP wrapper, then waits at a barrier
        if rank == 0:
            val_loss = evaluate(ddp, val_loader)
            dist.barrier()

        # Good: rank 0 uses the plain module in eval mode; every rank reaches the barrier
        if rank == 0:
            ddp.module.eval()
            with torch.no_grad():
                val_loss = evaluate(ddp.module, val_loader)
            ddp.module.train()
        dist.barrier()
        """
    ),
    example_context=snippet(
        """
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        rank = dist.get_rank()
        ddp = DDP(Net().to(device), device_ids=[local_rank])
        val_loader = []


        @torch.no_grad()
        def evaluate(model, loader):
            model.eval()
            correct = count = 0
            for x, y in loader:
                correct += (model(x).argmax(1) == y).sum().item()
                count += len(y)
            return correct, count
        """
    ),
    fix=(
        "Call collectives and DDP/SyncBN training forwards on every rank; for rank-0-only work use "
        "model.module in eval mode under torch.no_grad(), and keep barriers outside the branch."
    ),
    run_only="a collective on a subset of ranks hangs",
)
