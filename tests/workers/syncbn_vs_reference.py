"""Worker of tests/test_gpu.py (run under torchrun on GPUs): real `nn.SyncBatchNorm` against ddpdoctor's reference
implementation on the same inputs.

A GPU per rank: NCCL. Fewer GPUs than ranks: the ranks share the visible GPUs and gloo carries SyncBN's all_gather
(NCCL refuses two ranks on one device); the statistics are still computed by the real CUDA SyncBN kernels, which
is what is compared.

Every rank builds every rank's inputs from one seed (uneven batches, channels offset far from zero), runs K training
steps of a CUDA nn.SyncBatchNorm and of a twin module through ddpdoctor.bn.syncbn.sync_batch_norm_forward on its
own slice, and rank 0 writes, as JSON to the path given: the relative errors of outputs, input and weight
gradients (ddpdoctor's SyncBN vs the real one) and of the running statistics (the real ones vs
ddpdoctor.bn.stats.replay_running_stats over the per-rank float64 moments).
"""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ddpdoctor.bn.stats import relative_error, replay_running_stats
from ddpdoctor.bn.syncbn import sync_batch_norm_forward

STEPS, CHANNELS = 4, 8


def main(out: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    local = rank % torch.cuda.device_count()
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    sizes = [3 + 2 * r for r in range(world)]  # uneven per-rank batches
    g = torch.Generator().manual_seed(1234)
    inputs = [[torch.randn(n, CHANNELS, 5, 5, generator=g, dtype=torch.float32) * 2.0 + 100.0 for n in sizes]
              for _ in range(STEPS)]
    real = nn.SyncBatchNorm(CHANNELS, momentum=0.1).to(device)
    ours = nn.BatchNorm2d(CHANNELS, momentum=0.1).to(device)
    with torch.no_grad():
        real.weight.copy_(torch.linspace(0.5, 1.5, CHANNELS))
        real.bias.copy_(torch.linspace(-1.0, 1.0, CHANNELS))
        ours.weight.copy_(real.weight)
        ours.bias.copy_(real.bias)
    errors = {"output": 0.0, "input_grad": 0.0, "weight_grad": 0.0, "bias_grad": 0.0}
    for step in range(STEPS):
        x = inputs[step][rank].to(device)
        upstream = torch.linspace(-1.0, 1.0, x.numel(), device=device).reshape(x.shape)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = real(xa), sync_batch_norm_forward(ours, xb)
        (ya * upstream).sum().backward()
        (yb * upstream).sum().backward()
        pairs = {"output": (yb, ya), "input_grad": (xb.grad, xa.grad),
                 "weight_grad": (ours.weight.grad, real.weight.grad), "bias_grad": (ours.bias.grad, real.bias.grad)}
        for key, (a, b) in pairs.items():
            errors[key] = max(errors[key], relative_error(a.detach().double().cpu().numpy(),
                                                          b.detach().double().cpu().numpy()))
        real.zero_grad()
        ours.zero_grad()
    # the reference running statistics, from every rank's exact float64 moments
    counts = np.array([[n * 25 for _ in range(STEPS)] for n in sizes], dtype=np.float64)
    means = np.array([[inputs[s][r].double().mean(dim=(0, 2, 3)).numpy() for s in range(STEPS)] for r in range(world)])
    variances = np.array([[inputs[s][r].double().var(dim=(0, 2, 3), unbiased=False).numpy() for s in range(STEPS)]
                          for r in range(world)])
    reference = replay_running_stats(counts, means, variances, momentum=0.1)
    result = {
        "world": world,
        "backend": backend,
        "errors_vs_ddpdoctor_syncbn": errors,
        "running_mean": relative_error(real.running_mean.double().cpu().numpy(), reference.running_mean),
        "running_var": relative_error(real.running_var.double().cpu().numpy(), reference.running_var),
        "ddpdoctor_running_mean": relative_error(ours.running_mean.double().cpu().numpy(), reference.running_mean),
        "ddpdoctor_running_var": relative_error(ours.running_var.double().cpu().numpy(), reference.running_var),
        "num_batches_tracked": int(real.num_batches_tracked),
    }
    if rank == 0:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
