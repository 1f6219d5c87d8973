"""Models of the library APIs a training script calls, plugged into the generic interpreter (`engine`).

One module per area, each declaring its handlers keyed by canonical name (`CALLS`, `PATTERNS`) and by method name
(`METHOD_EVENTS`, `METHODS`, `LATE_METHODS`, `MODULE_METHODS`, `BUILTINS`), merged by `registry.ApiModels` in the
order `interpreter.API_MODULES` lists them:

    nn           modules, model families, DDP/DataParallel, SyncBatchNorm, model factories
    optim        optimizers, schedulers, backward and step, learning-rate assignments
    data         loaders, samplers, datasets, iteration
    distributed  init_process_group, ranks, collectives, spawn / Process
    horovod      Horovod's PyTorch API (hvd.init, size/rank, DistributedOptimizer, its collectives, broadcasts)
    frameworks   Lightning's Trainer/LightningCLI and hooks, Accelerate's Accelerator, the HF Trainer; engines not
                 modelled (DeepSpeed) recorded as such
    environ      os.environ reads, writes and membership tests
    cli          argparse options and the parsed namespace
    tensors      checkpoints, CUDA devices, autograd/autocast contexts, tensors, reporting
    ranks        what values mean about ranks (rank tests, node-local scope, naming conventions)

The events these models record are documented in `ddpdoctor.static.events`.
"""

from __future__ import annotations

from ddpdoctor.static.apis.cli import UNKNOWN, CliArg
from ddpdoctor.static.apis.interpreter import TorchInterpreter
from ddpdoctor.static.apis.optim import scaled_up_by_world

__all__ = ["UNKNOWN", "CliArg", "TorchInterpreter", "scaled_up_by_world"]
