"""The rule catalog: the one place where every ddpdoctor code is defined and documented.

`ddpdoctor rules`, `ddpdoctor explain`, the README rule table and SARIF `tool.driver.rules` are all generated
from `RULES`. Codes are stable forever; a retired code is never reused.

Each rule is documented in four parts, in the spirit of ruff's rule pages: `what` it detects (what static analysis
looks for, what the probe measures), `why` it hurts accuracy (the mechanism), an `example` (the bad code, then the
corrected code, as one Python snippet) and the `fix` (a short imperative, used as a finding's fix and as the SARIF
fix title). Prose is written as wrapped paragraphs in the source and re-flowed by `_prose`, so the stored text has
one line per paragraph and every renderer wraps it to its own width.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from ddpdoctor.findings import Severity

CATEGORIES = {
    "1": "setup",
    "2": "batchnorm",
    "3": "data",
    "4": "optimisation",
    "5": "checkpoints",
    "9": "probe",
}


def _prose(text: str) -> str:
    """Dedent a triple-quoted block and join each paragraph's source lines into one line."""
    paragraphs = textwrap.dedent(text).strip().split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def _code(text: str) -> str:
    """Dedent a triple-quoted code snippet, keeping its lines."""
    return textwrap.dedent(text).strip("\n")


@dataclass(frozen=True, kw_only=True)
class Rule:
    code: str
    name: str
    severity: Severity
    summary: str
    static: bool
    probe: bool
    what: str
    why: str
    example: str
    fix: str

    @property
    def category(self) -> str:
        return CATEGORIES[self.code[2]]

    @property
    def found_by(self) -> str:
        """"static analysis", "probe" or "static analysis, probe": how a finding of this rule can arise."""
        return ", ".join(label for label, on in (("static analysis", self.static), ("probe", self.probe)) if on)

    def documentation(self, width: int = 100) -> str:
        """The four-part documentation as plain text (`ddpdoctor explain`, SARIF `help.text`)."""

        def wrap(text: str) -> str:
            return "\n\n".join(
                textwrap.fill(p, width=width, break_long_words=False, break_on_hyphens=False)
                for p in text.split("\n\n")
            )

        return (
            f"{self.code} {self.name}\n"
            f"default severity: {self.severity.label}; category: {self.category}; found by: {self.found_by}\n\n"
            f"{wrap(self.summary)}\n\n"
            f"What it detects\n{wrap(self.what)}\n\n"
            f"Why it hurts accuracy\n{wrap(self.why)}\n\n"
            f"Example\n{textwrap.indent(self.example, '    ')}\n\n"
            f"Fix\n{wrap(self.fix)}\n"
        )

    def markdown(self) -> str:
        """The same documentation as Markdown (SARIF `help.markdown`)."""
        return (
            f"**{self.code} {self.name}** (default severity: {self.severity.label}; category: {self.category}; "
            f"found by: {self.found_by})\n\n"
            f"{self.summary}\n\n"
            f"### What it detects\n\n{self.what}\n\n"
            f"### Why it hurts accuracy\n\n{self.why}\n\n"
            f"### Example\n\n```python\n{self.example}\n```\n\n"
            f"### Fix\n\n{self.fix}\n"
        )

    def to_json(self) -> dict[str, Any]:
        """One entry of `ddpdoctor rules --format json`."""
        return {
            "rule": self.code,
            "name": self.name,
            "severity": self.severity.label,
            "category": self.category,
            "static": self.static,
            "probe": self.probe,
            "summary": self.summary,
            "what": self.what,
            "why": self.why,
            "example": self.example,
            "fix": self.fix,
        }


RULES: tuple[Rule, ...] = (
    Rule(
        code="DD101",
        name="sync-bn-after-ddp",
        severity=Severity.MEDIUM,
        summary=(
            "convert_sync_batchnorm applied to a model after it was wrapped in DDP; the probe reports whether "
            "the layers really sync on this torch"
        ),
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for `nn.SyncBatchNorm.convert_sync_batchnorm(m)` (or apex's
            `convert_syncbn_model(m)`) where `m` is a module that was already passed to
            `DistributedDataParallel(...)` earlier in the same function, the DDP wrapper itself, or its `.module`.

            The probe measures what the late conversion did on the installed torch: whether the BatchNorm layers
            inside the DDP-wrapped module are SyncBatchNorm when the training forward runs, whether their batch
            statistics agree across ranks, whether DDP's `mixed_precision` is in use, and whether the optimizer
            holds the same parameter objects as the model. The finding's severity follows what was measured: low
            when the layers sync and nothing else was lost, higher when they do not.
            """
        ),
        why=_prose(
            """
            The folklore says that converting after wrapping means BatchNorm never syncs. On torch >= 1.8 that is
            not what happens: `convert_sync_batchnorm` builds new SyncBatchNorm modules that reuse the same
            weight/bias Parameter objects and running-statistics tensors under the same child names, so DDP's
            gradient hooks (registered on those parameters) still reduce their gradients and the new layers do
            all-reduce their batch statistics. Training is correct.

            What the late conversion skips is what DDP's constructor does for SyncBatchNorm layers it can see: the
            refusal of SyncBN on CPU modules (so a CPU/gloo misconfiguration surfaces later, inside the forward),
            the `has_sync_bn` flag in DDP's logging data, and, with DDP's experimental `mixed_precision`
            option, the per-module forward pre-hooks that wait for the low-precision parameter copies and attach
            the gradient-reduction hooks to them: the replacement layers have neither.

            It did break training with older stacks. On torch <= 1.7, SyncBatchNorm.forward raised
            "SyncBatchNorm is only supported within torch.nn.parallel.DistributedDataParallel" unless DDP's
            constructor had registered the layer. apex's `convert_syncbn_model` clones weight and bias into new
            Parameters: an optimizer built before the conversion keeps updating the old tensors, so the BN affine
            weights the model uses never change, and DDP's hooks sit on the old parameters, so the new ones are
            never all-reduced and drift apart across ranks.
            """
        ),
        example=_code(
            """
            # Bad: converted after wrapping
            model = Net().cuda(local_rank)
            ddp = DDP(model, device_ids=[local_rank])
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)

            # Good: convert, then wrap, then build the optimizer
            model = nn.SyncBatchNorm.convert_sync_batchnorm(Net()).cuda(local_rank)
            ddp = DDP(model, device_ids=[local_rank])
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            """
        ),
        fix=(
            "Convert with nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping the model in "
            "DistributedDataParallel, and build the optimizer after both."
        ),
    ),
    Rule(
        code="DD102",
        name="forward-bypasses-ddp",
        severity=Severity.CRITICAL,
        summary="training forward runs through the unwrapped module; DDP forward never runs while steps happen",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for a model passed to `DistributedDataParallel(...)` and then called directly
            (`model(x)`, or `ddp.module(x)`) in the training loop, the code that also calls `backward()` and
            `optimizer.step()`, instead of calling the wrapper.

            The probe counts, per rank, training-mode forwards of the wrapped module that did not go through
            DDP's forward, and fires when optimizer steps happen while DDP's forward never ran in between.
            """
        ),
        why=_prose(
            """
            DDP reduces gradients from autograd hooks on the parameters, but the hooks only act after DDP's own
            forward has armed the reducer (`prepare_for_backward`). A forward through the inner module runs the
            same computation, its backward fills `.grad` with this rank's local gradient only, and nothing is
            all-reduced. Each rank then steps on its own shard's gradient: the replicas drift apart from the first
            step (measured on torch 2.13: parameter difference 0.14 after 3 steps), DDP's buffer broadcast never
            runs either, and the run exits 0 without a warning.

            The result is N independent models, each trained on 1/N of the data with a learning rate tuned for
            the global batch; the checkpoint saved from rank 0 is one of them.
            """
        ),
        example=_code(
            """
            # Bad: the wrapper is built, but the loop calls the inner module
            ddp = DDP(model, device_ids=[local_rank])
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()

            # Good: every training forward goes through the wrapper
            for x, y in loader:
                loss = criterion(ddp(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            """
        ),
        fix="Run the training forward through the DDP wrapper (ddp_model(x)), not through the module it wraps.",
    ),
    Rule(
        code="DD103",
        name="replicas-diverged",
        severity=Severity.CRITICAL,
        summary="parameters differ across ranks after optimizer steps (digest compare)",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe records, after every optimizer step, a digest of each parameter on each rank and compares
            them across ranks. It fires when any parameter differs, with the first step at which the ranks
            disagreed, the parameters that differ and the largest difference measured.
            """
        ),
        why=_prose(
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
        example=_code(
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
    ),
    Rule(
        code="DD104",
        name="hardcoded-rank",
        severity=Severity.CRITICAL,
        summary="init_process_group with a literal rank (or literal world_size) that cannot differ per process",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for `init_process_group(..., rank=<literal>)` or `world_size=<literal>`, directly
            or through a variable only ever assigned a constant, so the value cannot differ between processes or
            follow the launcher.

            The probe compares the rank and world size the script passed with the launcher's RANK and
            WORLD_SIZE. Where they disagree it overrides them with the launcher's values, says so in the finding,
            and goes on measuring the rest of the run.
            """
        ),
        why=_prose(
            """
            Every process of a job must join with a distinct rank and the same, true world size. Two processes
            claiming rank 0 cannot form a group: depending on the backend and the rendezvous store, init fails
            (address in use, duplicate rank) or waits until the timeout. A literal world size that does not match
            the launch leaves the group waiting for ranks that never come.

            The silent variant is a literal `world_size=1` (a single-GPU script wrapped in a launcher): every
            process forms its own one-rank group, DDP's all-reduce is a no-op, DistributedSampler hands every
            process the whole dataset, and N independent copies of single-GPU training run side by side and
            write the same files.
            """
        ),
        example=_code(
            """
            # Bad: every process claims rank 0 of a 4-process job
            dist.init_process_group("nccl", init_method="tcp://10.0.0.1:23456", rank=0, world_size=4)

            # Good: the launcher's environment decides (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
            dist.init_process_group("nccl")
            """
        ),
        fix=(
            "Take rank and world size from the launcher: call init_process_group(backend) with the env:// "
            "defaults, or pass int(os.environ[\"RANK\"]) and int(os.environ[\"WORLD_SIZE\"])."
        ),
    ),
    Rule(
        code="DD105",
        name="device-not-bound",
        severity=Severity.HIGH,
        summary="CUDA DDP without set_device/device_ids per local rank; ranks share one device",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for a CUDA DDP script (nccl backend, `.cuda()` or "cuda" devices) that neither
            calls `torch.cuda.set_device(local_rank)` nor places the model with an index derived from the local
            rank and passes `device_ids=[local_rank]` to DDP.

            The probe records each rank's current CUDA device and the device of the model's parameters when DDP
            is constructed (virtual devices under CPU emulation) and fires when two ranks on one node use the
            same device.
            """
        ),
        why=_prose(
            """
            `.cuda()`, "cuda" and tensors created without an index mean the current device, which is cuda:0 in
            every process until `set_device` changes it. Without it, all ranks of a node put their replica and
            their batches on GPU 0 while the other GPUs idle: recent NCCL versions refuse the setup ("Duplicate
            GPU detected"), otherwise it runs out of memory or crawls. The usual ways around that, a smaller
            per-GPU batch or fewer processes, silently change the normalisation batch and the global batch the
            learning rate was tuned for. A half-bound setup (model on `cuda:local_rank`, but `.cuda()` inputs or
            collectives without `set_device`) creates an extra context on GPU 0 in every process or fails with
            device-mismatch errors.
            """
        ),
        example=_code(
            """
            # Bad: every process uses the current device, cuda:0
            model = Net().cuda()
            ddp = DDP(model)

            # Good: one GPU per process, chosen by the local rank
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            model = Net().cuda(local_rank)
            ddp = DDP(model, device_ids=[local_rank])
            """
        ),
        fix=(
            "Call torch.cuda.set_device(local_rank) before any CUDA work, and wrap with "
            "DDP(model.cuda(local_rank), device_ids=[local_rank])."
        ),
    ),
    Rule(
        code="DD106",
        name="data-parallel",
        severity=Severity.MEDIUM,
        summary="nn.DataParallel used (single process; BN statistics from replica 0 only)",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for `nn.DataParallel(...)` (through any import alias), alone or inside a
            DistributedDataParallel script.

            The probe records DataParallel constructions and whether the wrapped module contains BatchNorm layers.
            """
        ),
        why=_prose(
            """
            DataParallel runs one process: every forward replicates the module onto each GPU, splits the batch
            along dimension 0 and gathers the outputs on device 0. The loss on the gathered outputs gives the
            full-batch gradient, so the optimisation itself is right; BatchNorm is not. Each replica normalises
            over its own chunk (batch / number of GPUs), exactly like per-GPU BatchNorm under DDP, and the
            replicas are thrown away after the forward: only the replica on device_ids[0] shares storage with the
            real module, so the running mean and variance are estimated from GPU 0's chunk alone, an N-times
            smaller sample than the batch. On top, the replicate/scatter/gather round trip through one Python
            process makes it slower than DDP, which PyTorch recommends instead.
            """
        ),
        example=_code(
            """
            # Bad: one process, four replicas; BN running stats come from replica 0 only
            model = nn.DataParallel(Net().cuda())

            # Good: torchrun --nproc_per_node 4 train.py, one process per GPU
            dist.init_process_group("nccl")
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            model = DDP(Net().cuda(local_rank), device_ids=[local_rank])
            """
        ),
        fix=(
            "Replace nn.DataParallel with one process per GPU and DistributedDataParallel (add SyncBatchNorm if "
            "the per-GPU batch is small)."
        ),
    ),
    Rule(
        code="DD107",
        name="moved-after-wrap",
        severity=Severity.MEDIUM,
        summary=".to()/.cuda() on the model after DDP wrapping",
        static=True,
        probe=False,
        what=_prose(
            """
            Static analysis looks for `.to(...)`, `.cuda(...)` (and dtype casts such as `.half()`) called on a
            model, or on its DDP wrapper, after the model was passed to `DistributedDataParallel(...)`.
            """
        ),
        why=_prose(
            """
            DDP's constructor fixes its view of the model: it broadcasts rank 0's parameters and buffers, records
            the device (`device_ids`, inputs are moved there in every forward) and builds the gradient buckets and
            autograd hooks for the parameters as they are at that moment. PyTorch documents changing the
            parameters afterwards as unsupported ("you should never try to change your model's parameters after
            wrapping"). Moving or casting the model later leaves the reducer and the recorded device describing a
            model that no longer exists: depending on torch version and backend it fails at the first forward or
            backward with device or dtype mismatches, or runs with inputs placed for the old device.
            """
        ),
        example=_code(
            """
            # Bad: moved after wrapping
            ddp = DDP(model)
            ddp.to(device)

            # Good: place (and cast) first, then wrap
            model = model.to(device)
            ddp = DDP(model, device_ids=[device.index])
            """
        ),
        fix=(
            "Move and cast the model to its device and dtype before wrapping it in DistributedDataParallel; do not "
            "call .to()/.cuda() on it afterwards."
        ),
    ),
    Rule(
        code="DD108",
        name="legacy-local-rank-arg",
        severity=Severity.MEDIUM,
        summary="--local_rank argument without LOCAL_RANK fallback (torchrun does not pass it)",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for an argparse option `--local_rank` (or `--local-rank`) in a script that never
            reads the LOCAL_RANK environment variable, typically with `default=0`.

            The probe launches the script as torchrun does (LOCAL_RANK in the environment, no argument) and
            records which device index each rank actually bound; it fires when ranks on one node ended up with
            the same local rank.
            """
        ),
        why=_prose(
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
        example=_code(
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
    ),
    Rule(
        code="DD109",
        name="single-node-world-size",
        severity=Severity.LOW,
        summary="world size taken from torch.cuda.device_count(): correct on one node only",
        static=True,
        probe=False,
        what=_prose(
            """
            Static analysis looks for `torch.cuda.device_count()` used as the world size: passed as
            `init_process_group(world_size=...)`, as DistributedSampler's `num_replicas`, or in the learning-rate
            or batch-size arithmetic of a distributed script.
            """
        ),
        why=_prose(
            """
            `device_count()` is the number of GPUs this process can see on this node. On one node with one
            process per visible GPU it happens to equal the world size; on two nodes it is half of it, and with
            CUDA_VISIBLE_DEVICES narrowed per process it is 1. Used in `init_process_group` the group never
            completes; used as `num_replicas`, DistributedSampler refuses ranks at or above it, and a script that
            then takes the local rank as the rank feeds every node the same shards; used for learning-rate
            scaling, the lr follows the GPUs of one node instead of the global batch (see DD401).
            """
        ),
        example=_code(
            """
            # Bad: 8 on every node, but the job has 16 processes on two nodes
            world_size = torch.cuda.device_count()
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)

            # Good: ask the process group
            world_size = dist.get_world_size()
            sampler = DistributedSampler(dataset)  # num_replicas and rank from the process group
            """
        ),
        fix=(
            "Use dist.get_world_size() (or WORLD_SIZE from the launcher) for the world size, not "
            "torch.cuda.device_count()."
        ),
    ),
    Rule(
        code="DD201",
        name="bn-stats-diverge",
        severity=Severity.MEDIUM,
        summary="local BN running stats differ across ranks at the end (broadcast_buffers=False)",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe records every BatchNorm layer's running_mean and running_var on each rank at the end of the
            observed run and fires when they differ across ranks beyond float round-off, with the layers, the
            largest relative difference and DDP's `broadcast_buffers` setting. With `broadcast_buffers=False`
            the difference builds up over the whole run. With the default `True` ranks still differ by their
            last update (rank 0's buffers are broadcast at the start of each forward, then every rank applies
            its own batch's update), which is why the setting is part of the evidence.
            """
        ),
        why=_prose(
            """
            Running statistics are what the model normalises with at evaluation time. Per-GPU BatchNorm updates
            them from each rank's own batches. With `broadcast_buffers=False` nothing ever reconciles them:
            every rank ends with a different eval-mode model, per-rank validation scores disagree, and the
            checkpoint (usually rank 0's) carries statistics estimated from rank 0's shard alone, noisier than
            the recipe's and biased if the shards differ (DD203). The default broadcast copies rank 0's buffers
            to all ranks at the start of each forward, which keeps ranks aligned but still means the statistics
            come from rank 0's batches only.
            """
        ),
        example=_code(
            """
            # Bad: buffers never reconciled; rank 0's checkpoint has rank 0's statistics
            ddp = DDP(model, device_ids=[local_rank], broadcast_buffers=False)

            # Good: average the running statistics before evaluating and saving (or use SyncBatchNorm)
            world_size = dist.get_world_size()
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    for buf in (m.running_mean, m.running_var):
                        dist.all_reduce(buf)
                        buf /= world_size
            """
        ),
        fix=(
            "Keep BatchNorm buffers identical across ranks: use SyncBatchNorm, keep broadcast_buffers=True, or "
            "all-reduce (average) the running statistics before evaluating and saving."
        ),
    ),
    Rule(
        code="DD202",
        name="small-bn-batch",
        severity=Severity.MEDIUM,
        summary="local BN normalises over a per-rank batch below 16 samples",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe records the input shape of every training-mode forward of a per-GPU (not synchronised)
            BatchNorm layer and fires when the per-rank batch it normalises over is below 16 samples (the
            threshold is `small_bn_batch` in `[tool.ddpdoctor]`), with the per-rank and global batch sizes.
            """
        ),
        why=_prose(
            """
            In training mode BatchNorm normalises with the mean and variance of the current batch. Splitting a
            single-GPU recipe's batch over N GPUs keeps the global batch, and so the gradient noise, the same,
            but BatchNorm now sees batch / N samples: its statistics are noisier, the running averages used at
            evaluation are built from them, and training and evaluation normalise differently. The loss is
            sharp below about 16 per GPU: ResNet-50 on ImageNet with per-GPU BatchNorm reaches 23.6% top-1 error
            at 32 images per GPU, 23.7% at 16, 24.8% at 8, 27.3% at 4 and 34.7% at 2 (Wu and He, Group
            Normalization, 2018).
            """
        ),
        example=_code(
            """
            # Bad: the recipe's batch of 64 spread over 8 GPUs; BN normalises over 8
            loader = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set))

            # Good: normalise over the global batch of 64
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            ddp = DDP(model.cuda(local_rank), device_ids=[local_rank])
            """
        ),
        fix=(
            "Raise the per-GPU batch to 16 or more, or normalise over more samples with nn.SyncBatchNorm "
            "(or use GroupNorm)."
        ),
    ),
    Rule(
        code="DD203",
        name="non-iid-shards",
        severity=Severity.HIGH,
        summary="per-rank BN input statistics differ beyond i.i.d. sampling noise (scipy test, p < 1e-3)",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe records the per-channel batch mean of every BatchNorm layer's input on each rank at every
            observed step, and a scipy test asks whether the ranks' batch means differ by more than i.i.d.
            sampling from one distribution would explain. It fires at
            p < 1e-3, with the layers, channels, test statistic and p-value in evidence.
            """
        ),
        why=_prose(
            """
            Per-GPU BatchNorm subtracts each rank's own batch mean and divides by its own batch spread. When the
            ranks see differently distributed data (contiguous slices of a dataset sorted by class or source, one
            file per rank, a different augmentation per rank) that normalisation removes exactly the
            shard-specific differences the network should learn from, and each replica's features are
            normalised differently while their gradients are averaged as if they were comparable. The running
            statistics, taken from rank 0's shard (DD201), then describe rank 0's data rather than the whole
            distribution, so evaluation normalises with the wrong statistics. Synchronised BatchNorm or a global
            shuffle removes the effect.
            """
        ),
        example=_code(
            """
            # Bad: contiguous slices of a dataset sorted by class (or one file per rank)
            n = len(train_set) // world_size
            shard = Subset(train_set, range(rank * n, (rank + 1) * n))
            loader = DataLoader(shard, batch_size=32, shuffle=True)

            # Good: shuffle globally, then interleave
            sampler = DistributedSampler(train_set, shuffle=True)
            loader = DataLoader(train_set, batch_size=32, sampler=sampler)
            """
        ),
        fix=(
            "Shuffle globally before sharding (DistributedSampler(dataset, shuffle=True) over the whole dataset); "
            "if the shards must differ, use SyncBatchNorm."
        ),
    ),
    Rule(
        code="DD204",
        name="syncbn-large-batch",
        severity=Severity.LOW,
        summary=(
            "SyncBN over a per-rank batch already >= 32: no statistical gain, lost BN noise (ghost-BN "
            "regularisation) — a known reason SyncBN runs score lower"
        ),
        static=False,
        probe=True,
        what=_prose(
            """
            The probe records every training-mode SyncBatchNorm forward and fires when the per-rank batch is
            already 32 samples or more, with the per-rank and global normalisation batch and the number of
            synchronised layers.
            """
        ),
        why=_prose(
            """
            SyncBatchNorm normalises with the statistics of the global batch (per-rank batch × ranks). That
            helps when per-GPU batches are small (DD202); at 32 or more per GPU the per-GPU estimate is already
            good (23.6% vs 23.7% ResNet-50 error at 32 vs 16 per GPU in the Group Normalization paper), so syncing
            buys no accuracy and takes away the noise of per-batch statistics. That noise regularises: "ghost"
            batch norm over small virtual batches improves the generalisation of large-batch training (Hoffer et
            al., 2017), and the large-batch ImageNet recipe (Goyal et al., 2017) deliberately computes BN
            statistics per worker over 32 images, noting that the BN batch size is part of the loss being
            optimised. A recipe tuned with per-GPU BatchNorm therefore tends to score lower after switching to
            SyncBN, and every BN layer adds a blocking all-gather to each forward.
            """
        ),
        example=_code(
            """
            # Bad (for this batch): 64 images per GPU, synchronised over 8 GPUs = BN over 512
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            ddp = DDP(model.cuda(local_rank), device_ids=[local_rank])

            # Good: keep the recipe's per-GPU BatchNorm
            ddp = DDP(model.cuda(local_rank), device_ids=[local_rank])
            """
        ),
        fix=(
            "Keep per-GPU BatchNorm when the per-GPU batch is 32 or more; use SyncBatchNorm (optionally over a "
            "small process_group) where per-GPU batches are small."
        ),
    ),
    Rule(
        code="DD205",
        name="syncbn-needs-cuda",
        severity=Severity.INFO,
        summary="SyncBatchNorm with a CPU/gloo setup raises in plain PyTorch",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for SyncBatchNorm (`nn.SyncBatchNorm(...)` or `convert_sync_batchnorm`) in a
            script whose process group uses gloo or whose model stays on CPU.

            The probe records SyncBatchNorm layers that ran on CPU tensors. Under ddpdoctor's CPU emulation they
            compute exact global-batch statistics over gloo, so the rest of the run can be measured; the finding
            says that plain PyTorch would have raised.
            """
        ),
        why=_prose(
            """
            Not an accuracy problem by itself: PyTorch's SyncBatchNorm only runs on CUDA (and XPU or PrivateUse1)
            devices. On CPU, DDP's constructor raises "SyncBatchNorm layers only work with GPU modules", and
            SyncBatchNorm.forward raises "SyncBatchNorm expected input tensor to be on GPU ..." once a process
            group with more than one rank exists. Without a process group it quietly behaves like plain
            BatchNorm, so a single-process CPU smoke test says nothing about the synchronised run. Scripts that
            swap SyncBN out for CPU tests train a different model there than on the cluster.
            """
        ),
        example=_code(
            """
            # Bad: SyncBN on CPU with gloo
            dist.init_process_group("gloo")
            model = nn.SyncBatchNorm.convert_sync_batchnorm(Net())
            ddp = DDP(model)  # ValueError: SyncBatchNorm layers only work with GPU modules

            # Good: SyncBN where it can run, the same code path otherwise
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            model = Net()
            if torch.cuda.is_available():
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(local_rank)
            """
        ),
        fix=(
            "Run SyncBatchNorm on CUDA with the NCCL backend; for CPU/gloo runs keep nn.BatchNorm, or let "
            "ddpdoctor's CPU emulation stand in for it."
        ),
    ),
    Rule(
        code="DD206",
        name="collective-on-subset",
        severity=Severity.HIGH,
        summary="DDP/SyncBN training-mode forward or a collective inside a rank-conditional branch (hang)",
        static=True,
        probe=True,
        what=_prose(
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
        why=_prose(
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
        example=_code(
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
        fix=(
            "Call collectives and DDP/SyncBN training forwards on every rank; for rank-0-only work use "
            "model.module in eval mode under torch.no_grad(), and keep barriers outside the branch."
        ),
    ),
    Rule(
        code="DD207",
        name="eval-in-train-mode",
        severity=Severity.MEDIUM,
        summary="evaluation forward (no_grad) with BN layers in training mode: stats polluted, SyncBN syncs",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for an evaluation loop (model calls under `torch.no_grad()` or
            `torch.inference_mode()`, or in a function named like evaluate/validate/test) reached without a
            `model.eval()` on the model or its wrapper.

            The probe counts forwards of BatchNorm layers in training mode while gradients are disabled, and
            whether their running statistics changed or SyncBatchNorm synchronised during them.
            """
        ),
        why=_prose(
            """
            `torch.no_grad()` turns off gradient recording, not training behaviour. BatchNorm in training mode
            normalises each evaluation batch with that batch's own statistics, so scores depend on the
            evaluation batch size and composition, and it updates running_mean and running_var with evaluation
            data: with the default momentum of 0.1, after ten evaluation batches 65% of the running statistics
            the model is saved with come from evaluation data. Dropout stays active too.
            SyncBatchNorm also synchronises during such an evaluation; if only some ranks evaluate, it hangs
            (DD206).
            """
        ),
        example=_code(
            """
            # Bad: no_grad does not switch BatchNorm to eval mode
            with torch.no_grad():
                for x, y in val_loader:
                    correct += (ddp(x).argmax(1) == y).sum().item()

            # Good
            ddp.eval()
            with torch.no_grad():
                for x, y in val_loader:
                    correct += (ddp(x).argmax(1) == y).sum().item()
            ddp.train()
            """
        ),
        fix="Call model.eval() before evaluation and model.train() after it.",
    ),
    Rule(
        code="DD208",
        name="conversion-changed-function",
        severity=Severity.CRITICAL,
        summary=(
            "converting BN to SyncBN changed what a layer computes (a BatchNorm subclass with its own forward, "
            "e.g. a fused activation, replaced by plain SyncBatchNorm)"
        ),
        static=False,
        probe=True,
        what=_prose(
            """
            The probe notices every plain BatchNorm layer that a converter (torch's `convert_sync_batchnorm`,
            timm's, mmengine's, apex-style or the script's own) replaces by a SyncBN-like layer, keeps a copy of
            the original, and at the replacement's first forward runs both on that same input, at identical
            weights and running statistics, in train and in eval mode, with the replacement normalising over the
            rank's own batch (what `ddpdoctor triage` calls arm L against arm P). eps and momentum are equalised
            first, so only the forward code is compared. A relative difference above float rounding is a changed
            function; the finding names the layer, both classes and the difference in each mode.
            """
        ),
        why=_prose(
            """
            `nn.SyncBatchNorm.convert_sync_batchnorm` replaces every `_BatchNorm` instance by a plain
            `SyncBatchNorm` built from its attributes. A subclass that does more than batch norm in its forward —
            timm's `BatchNormAct2d` applies the activation (and drop) inside the norm layer, fused or multi-step
            BN variants, BN with a custom eval path — loses that behaviour: its activation child is still
            registered, but SyncBatchNorm's forward never calls it (pytorch/pytorch#187298, timm#1254). The model
            then trains a different network (no ReLU after the norm, for instance) and scores lower for a reason
            that has nothing to do with statistics.
            """
        ),
        example=_code(
            """
            # Bad: torch's converter turns BatchNormAct2d into a SyncBatchNorm without the activation
            model = timm.create_model("resnet50")
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)

            # Good: the library's converter keeps the fused layer (SyncBatchNormAct)
            from timm.layers import convert_sync_batchnorm
            model = convert_sync_batchnorm(timm.create_model("resnet50"))
            """
        ),
        fix=(
            "Convert with a converter that knows the subclass (timm.layers.convert_sync_batchnorm for timm "
            "models), or give the subclass a SyncBN counterpart that keeps its forward."
        ),
    ),
    Rule(
        code="DD209",
        name="bn-type-check-misses-syncbn",
        severity=Severity.HIGH,
        summary=(
            "code that finds norm layers by exact class stops matching after conversion: weight-decay "
            "exclusions, momentum schedules, freezing, precise-BN helpers silently change"
        ),
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks, in a script that converts to SyncBatchNorm, for code that picks BatchNorm
            layers by a class that SyncBatchNorm is not: `type(m) is nn.BatchNorm2d`, `type(m) ==
            nn.BatchNorm2d`, `isinstance(m, nn.BatchNorm2d)` (1d/3d alike), `m.__class__.__name__ ==
            "BatchNorm2d"`.

            The probe compares every BatchNorm layer between the arms of `ddpdoctor triage`, at the same
            optimizer step: with the conversion (A) and without it (P), the layer's momentum, eps, training mode,
            requires_grad, the lr and weight decay of the optimizer group holding its parameters, and how many
            train-mode forwards without gradients (precise-BN recalibration) it ran. A difference the conversion
            itself did not make is code that stopped recognising the layer. Within one run, a converter that
            did not carry momentum or eps over to the new layer is reported too.
            """
        ),
        why=_prose(
            """
            `isinstance(nn.SyncBatchNorm(8), nn.BatchNorm2d)` is False: SyncBatchNorm derives from `_BatchNorm`,
            not from the BatchNorm*d classes. Code written for the plain model silently stops matching the
            converted layers: weight-decay exclusions for norm parameters (BN weights decay again), BN-momentum
            schedules, freezing of early stages, precise-BN or EMA recalibration helpers and custom
            initialisation all skip them. Likewise a hand-written converter that builds the new layer with
            default arguments loses a tuned momentum or eps. Each of these changes training as much as a
            hyper-parameter change would, and only the SyncBN run has it.
            """
        ),
        example=_code(
            """
            # Bad: SyncBatchNorm is not an nn.BatchNorm2d, so BN weights get weight decay after conversion
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            no_decay = [p for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()]

            # Good: match every BatchNorm, SyncBatchNorm included
            from torch.nn.modules.batchnorm import _BatchNorm
            no_decay = [p for m in model.modules() if isinstance(m, _BatchNorm) for p in m.parameters()]
            """
        ),
        fix=(
            "Select norm layers with isinstance(m, torch.nn.modules.batchnorm._BatchNorm) (or _NormBase), and "
            "carry momentum and eps over in custom converters."
        ),
    ),
    Rule(
        code="DD210",
        name="frozen-bn-unfrozen",
        severity=Severity.HIGH,
        summary="BN layers frozen before conversion (eval mode and/or requires_grad False) train again after it",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe records, for every BatchNorm layer a converter replaces, the original's training mode and
            the requires_grad of its weight and bias, and the same of the replacement when it is registered and at
            the first optimizer step. In `ddpdoctor triage` it also compares the layer between the arm with the
            conversion (A) and the arm without it (P) at the same step. A layer frozen without the conversion and
            training with it is the finding.
            """
        ),
        why=_prose(
            """
            Detection and segmentation recipes freeze BatchNorm in pretrained backbones (eval mode, parameters
            without gradients), because their per-GPU batches are too small to re-estimate the statistics. A
            converter that builds fresh SyncBatchNorm layers without copying `training` and `requires_grad` —
            torch's own before 2.2, mmengine's (mmengine#1624), many hand-written ones — unfreezes them: the
            pretrained statistics get overwritten and the affine parameters start moving, which is exactly what
            freezing was there to prevent.
            """
        ),
        example=_code(
            """
            # Bad: a converter that drops requires_grad and eval mode
            def to_syncbn(m):
                new = nn.SyncBatchNorm(m.num_features, m.eps, m.momentum)
                new.weight.data.copy_(m.weight.data)
                new.bias.data.copy_(m.bias.data)
                return new

            # Good: keep the frozen state
            new.weight.requires_grad_(m.weight.requires_grad)
            new.bias.requires_grad_(m.bias.requires_grad)
            new.train(m.training)
            """
        ),
        fix=(
            "Copy training and requires_grad in the converter (torch >= 2.2 does), or freeze after converting."
        ),
    ),
    Rule(
        code="DD211",
        name="syncbn-stats-wrong",
        severity=Severity.HIGH,
        summary=(
            "the statistics a SyncBN layer applied differ from the exact global-batch statistics (a custom or "
            "buggy implementation, e.g. equal-weight averaging of unequal batches)"
        ),
        static=False,
        probe=True,
        what=_prose(
            """
            The probe records, for the first optimizer steps, the per-channel mean, variance and covariance of
            every SyncBN-like layer's input and output on each rank, and its weight and bias. Training-mode batch
            norm is an affine map per channel, so the mean and variance the layer applied follow from them; the
            analysis compares them with the exact statistics of the layer's process group (Chan's combination of
            the ranks' counts, means and variances) and of the rank's own batch, with a tolerance derived from
            the output's floating-point rounding. Channels whose output carries no information about the
            statistics (weight near zero) and layers whose output is not affine (a fused activation) are not
            measured, and the finding says how many were.
            """
        ),
        why=_prose(
            """
            SyncBN exists to normalise with the statistics of the union of the ranks' batches. Implementations
            that average per-rank means and variances with equal weights are exact only when every rank has the
            same batch size and the same mean; with unequal batches (the last batch of an epoch, uneven shards)
            or non-i.i.d. ranks the applied statistics are biased, and naive sum-of-squares variants lose
            precision when activations sit far from zero. Old and third-party implementations
            (pytorch#22192-era bugs, hand-rolled NaiveSyncBN ports) shift every layer's normalisation in a way
            plain DDP never does.
            """
        ),
        example=_code(
            """
            # Bad: equal-weight average of per-rank statistics
            mean = x.mean((0, 2, 3)); dist.all_reduce(mean); mean /= world

            # Good: torch's SyncBatchNorm combines counts, means and variances exactly
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            """
        ),
        fix=(
            "Use torch.nn.SyncBatchNorm, or weight each rank's mean and variance by its count and add the "
            "between-rank term (Chan's formula)."
        ),
    ),
    Rule(
        code="DD212",
        name="syncbn-scope",
        severity=Severity.HIGH,
        summary=(
            "SyncBN layers sync over a different set of ranks than intended (a singleton or wrong "
            "process_group): statistics are local"
        ),
        static=False,
        probe=True,
        what=_prose(
            """
            The probe records each SyncBN layer's process group on every rank (its global ranks) and, from the
            layer's input and output, which ranks' statistics it applied. It fires when a layer on a run with
            several ranks syncs over a group of one rank, over a group that does not contain the rank itself, or
            over groups the ranks disagree about.
            """
        ),
        why=_prose(
            """
            `convert_sync_batchnorm(model, process_group=...)` scopes synchronisation to that group. Building
            one group per rank (`new_group([rank])`), passing another rank's group, or building groups with
            different rank lists on different ranks leaves every layer normalising over its own batch: the run
            pays for SyncBN and gets per-GPU statistics, or synchronises over a partition nobody intended.
            """
        ),
        example=_code(
            """
            # Bad: every rank syncs with itself only
            groups = [dist.new_group([r]) for r in range(world)]
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=groups[rank])

            # Good: one group over the ranks meant to share statistics (here: all of them)
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            """
        ),
        fix=(
            "Pass the process group of the ranks meant to share statistics (None for all); every rank must "
            "build the same groups in the same order."
        ),
    ),
    Rule(
        code="DD213",
        name="stale-running-stats",
        severity=Severity.INFO,
        summary=(
            "running statistics lag the population statistics at the current weights (EMA lag under a large lr "
            "or small momentum)"
        ),
        static=False,
        probe=True,
        what=_prose(
            """
            The probe, in each arm of `ddpdoctor triage`, recomputes at the end of its steps and at fixed
            weights PreciseBN-style population statistics: a copy of the model is run in train mode over the last few
            training batches with the running statistics reset to a cumulative average. The finding compares the
            running statistics the layers hold with them (the mean in units of the channel's standard deviation,
            the variance relatively), with the sampling error of the population estimate as an interval.
            """
        ),
        why=_prose(
            """
            Running statistics are an exponential moving average over past batches, computed by past weights.
            With a large learning rate (a scaled-up lr, a warmup peak) or a small momentum the weights move
            faster than the average forgets, so evaluation normalises with statistics of a network that no longer
            exists. It affects plain and SyncBN runs alike; PreciseBN (Wu & Johnson 2021) recomputes them at the
            final weights.
            """
        ),
        example=_code(
            """
            # Bad: evaluate with whatever the EMA holds after a high-lr epoch
            model.eval(); evaluate(model)

            # Good: recompute the statistics at the final weights first
            torch.optim.swa_utils.update_bn(train_loader_subset, model)
            model.eval(); evaluate(model)
            """
        ),
        fix="Recompute BN statistics at the final weights before evaluating (update_bn / PreciseBN).",
    ),
    Rule(
        code="DD214",
        name="bn-train-test-inconsistency",
        severity=Severity.LOW,
        summary=(
            "the statistics used in training and those used in evaluation differ enough to shift eval outputs"
        ),
        static=False,
        probe=True,
        what=_prose(
            """
            The probe, in each arm of `ddpdoctor triage`, next to the population statistics of DD213, runs the
            model's eval-mode forward on a held training batch twice, once with the running statistics and once with the
            population statistics, and reports the relative change of the output.
            """
        ),
        why=_prose(
            """
            A model trained with batch statistics is evaluated with running statistics. When they disagree —
            lagging running averages, a normalisation batch much smaller or larger than the data's real
            variation, non-i.i.d. batches — the eval-mode network is not the one that was trained, and accuracy
            drops although training looked fine. Measuring the shift of the outputs says how much that matters
            for this model, which the size of the statistics' error alone does not.
            """
        ),
        example=_code(
            """
            # Bad: running statistics from a few noisy per-GPU batches of 2
            model.eval(); evaluate(model)

            # Good: recalibrate, or normalise over a larger batch (SyncBN over a subgroup)
            torch.optim.swa_utils.update_bn(calibration_loader, model)
            """
        ),
        fix="Recalibrate BN statistics before evaluation, or normalise over batches that represent the data.",
    ),
    Rule(
        code="DD215",
        name="micro-batch-bn",
        severity=Severity.LOW,
        summary=(
            "with gradient accumulation, BN normalises (and updates running stats) per micro-batch, not over the "
            "batch the optimizer sees"
        ),
        static=False,
        probe=True,
        what=_prose(
            """
            The probe counts the gradient-enabled training forwards of each BatchNorm layer between optimizer
            steps and their batch sizes. Two or more per step is gradient accumulation: the finding gives the
            samples BN normalised over per forward (per rank, and with SyncBN per group) against the samples the
            optimizer step averages over.
            """
        ),
        why=_prose(
            """
            Gradient accumulation makes the optimizer see a large batch, but BatchNorm still normalises each
            micro-batch on its own and updates its running statistics once per micro-batch. A recipe ported to
            fewer GPUs with accumulation "to keep the batch size" therefore has the gradient of the large batch
            and the BN noise of the small one, and running statistics averaged over micro-batches. SyncBN
            recovers part of the normalisation batch across ranks; only a larger micro-batch recovers all of it.
            """
        ),
        example=_code(
            """
            # Bad (for BN): 4 micro-batches of 8 per step, BN sees 8
            for i, (x, y) in enumerate(loader):
                loss_fn(ddp(x), y).backward()
                if (i + 1) % 4 == 0:
                    opt.step(); opt.zero_grad()

            # Good: larger micro-batches, SyncBN across ranks, or GroupNorm
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            """
        ),
        fix=(
            "Prefer larger micro-batches (or SyncBN across ranks, or GroupNorm) when BN batches under "
            "accumulation are small."
        ),
    ),
    Rule(
        code="DD216",
        name="bn-params-not-trained",
        severity=Severity.CRITICAL,
        summary=(
            "after conversion the BN weight/bias the model uses are not the ones the optimizer updates (a cloning "
            "converter applied after the optimizer was built)"
        ),
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for an optimizer built over the model's parameters before a converter that
            makes new parameters (apex's `convert_syncbn_model`, or a function of the project that builds
            SyncBatchNorm layers and gives them new weight/bias tensors) is applied to that model.

            The probe checks, at the first optimizer step after a conversion, whether an optimizer holds the
            converted layers' weight and bias (and whether it holds the originals' instead), and at the first
            step of every DDP model whether its SyncBN parameters are in an optimizer at all.
            """
        ),
        why=_prose(
            """
            An optimizer holds references to Parameter objects. torch's `convert_sync_batchnorm` reuses the
            original weight and bias, so an optimizer built before it still updates them (FACTS: 2.13). Converters
            that clone — apex's `convert_syncbn_model`, many hand-written ones — register new Parameters: an
            optimizer built before the conversion keeps updating the old, now unused tensors while the model's
            BN affine parameters never change (CenterPoint#146, horovod#2183). Training still converges somewhat,
            so nothing crashes; accuracy is simply lower.
            """
        ),
        example=_code(
            """
            # Bad: the optimizer holds the pre-conversion parameters
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model = apex.parallel.convert_syncbn_model(model)

            # Good: convert first, then build the optimizer
            model = apex.parallel.convert_syncbn_model(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            """
        ),
        fix="Convert the model to SyncBN before building the optimizer (and the DDP wrapper).",
    ),
    Rule(
        code="DD301",
        name="sampler-not-reshuffled",
        severity=Severity.HIGH,
        summary="DistributedSampler(shuffle=True) whose order repeats across epochs (set_epoch missing/constant)",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for a DistributedSampler with `shuffle=True` (the default) iterated in an epoch
            loop where `sampler.set_epoch(...)` is never called, is called with a constant, or is called outside
            the loop.

            The probe records the index order each rank's sampler yields in every epoch and the epochs passed to
            `set_epoch`, and fires when two epochs produce the same order.
            """
        ),
        why=_prose(
            """
            DistributedSampler shuffles with a generator seeded with `seed + epoch`, where `seed` defaults to 0
            and `epoch` changes only when `set_epoch` is called. Without it every epoch uses the same
            permutation: each sample stays on the same rank, in the same batch with the same batch-mates, at the
            same position in the epoch. Training becomes a fixed cyclic pass over frozen batches instead of
            stochastic gradient descent over fresh ones; with per-GPU BatchNorm every sample is also always
            normalised with the same neighbours. Losing the reshuffle costs accuracy, and since a single-GPU
            DataLoader with `shuffle=True` reshuffles by itself, the problem appears only after the port.
            """
        ),
        example=_code(
            """
            # Bad: the same permutation every epoch
            sampler = DistributedSampler(train_set, shuffle=True)
            loader = DataLoader(train_set, batch_size=32, sampler=sampler)
            for epoch in range(epochs):
                for x, y in loader:
                    train_step(x, y)

            # Good: a new permutation per epoch, the same on every rank
            for epoch in range(epochs):
                sampler.set_epoch(epoch)
                for x, y in loader:
                    train_step(x, y)
            """
        ),
        fix="Call sampler.set_epoch(epoch) at the start of every epoch, before iterating the DataLoader.",
    ),
    Rule(
        code="DD302",
        name="missing-distributed-sampler",
        severity=Severity.HIGH,
        summary="ranks iterate overlapping samples (no DistributedSampler or equivalent sharding)",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for a training DataLoader in a distributed script built without a
            DistributedSampler (or another sampler given the rank and world size) and without manual sharding of
            the dataset by rank.

            The probe records the dataset indices each rank loads per epoch and fires when ranks overlap, with
            the overlap fraction (1.0: every rank reads the whole dataset) in evidence.
            """
        ),
        why=_prose(
            """
            Without sharding every rank iterates the whole dataset. If the ranks draw the same order (same seed),
            they compute the same gradient: the all-reduce averages N copies of one batch, the effective batch is
            the per-rank batch, and a learning rate scaled for N times that batch is N times too large. If the
            orders differ, each epoch processes every sample N times, so the epoch count, warmup and decay
            milestones of the recipe all stretch N-fold in samples seen, and an epoch takes as long as on one
            GPU. Either way the run is not the recipe it was ported from.
            """
        ),
        example=_code(
            """
            # Bad: every rank iterates the whole dataset
            loader = DataLoader(train_set, batch_size=32, shuffle=True)

            # Good: each rank reads its own 1/N of every epoch
            sampler = DistributedSampler(train_set, shuffle=True)
            loader = DataLoader(train_set, batch_size=32, sampler=sampler)
            """
        ),
        fix=(
            "Shard the data: DataLoader(dataset, sampler=DistributedSampler(dataset), ...) instead of "
            "shuffle=True, and call sampler.set_epoch(epoch) every epoch."
        ),
    ),
    Rule(
        code="DD303",
        name="eval-sampler-padding",
        severity=Severity.LOW,
        summary="DistributedSampler on evaluation data pads duplicates (len % world != 0)",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for a DistributedSampler over an evaluation dataset (used under `no_grad()`, in
            an evaluation function, or named like val/test/eval).

            The probe fires when an evaluation sampler's dataset length is not a multiple of the world size, with
            the number of duplicated (or, with `drop_last=True`, dropped) samples.
            """
        ),
        why=_prose(
            """
            DistributedSampler gives every rank the same number of samples. With `drop_last=False` (the default)
            it pads the index list by repeating indices from its start until the length is divisible by the
            world size; with `drop_last=True` it drops the tail. Evaluated this way, up to N - 1 samples count
            twice (or are skipped): 50,000 validation images on 3 ranks are scored as 50,001. The reported
            accuracy then differs from a single-GPU evaluation and changes with the world size, and close model
            comparisons or best-checkpoint choices can flip on it.
            """
        ),
        example=_code(
            """
            # Bad: 50,000 images on 3 ranks: one image is scored twice
            val_sampler = DistributedSampler(val_set, shuffle=False)
            val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler)

            # Good: unpadded shards, then sum the counts over ranks
            val_shard = Subset(val_set, range(rank, len(val_set), world_size))
            val_loader = DataLoader(val_shard, batch_size=256)
            correct, count = evaluate(ddp.module, val_loader)
            totals = torch.tensor([correct, count], dtype=torch.float64, device=device)
            dist.all_reduce(totals)
            accuracy = (totals[0] / totals[1]).item()
            """
        ),
        fix=(
            "Evaluate without padding: shard with range(rank, len(dataset), world_size) and all-reduce the "
            "(correct, count) sums, or evaluate the full set on one rank."
        ),
    ),
    Rule(
        code="DD304",
        name="identical-rng-streams",
        severity=Severity.LOW,
        summary="augmentation/dropout random streams identical on every rank",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe compares, across ranks, the state of the random number generators that augmentation and
            dropout draw from (torch's default generator in the training process and the seeds of the DataLoader
            workers) at the same step, and fires when they are identical on every rank.
            """
        ),
        why=_prose(
            """
            Scripts seed every process with the same `torch.manual_seed(seed)` for reproducibility. DataLoader
            workers derive their seeds (torch, `random` and numpy) from a base seed drawn from that generator, so
            worker k produces the same random stream on every rank (with `num_workers=0` the augmentations draw
            from the training process's generator, equally shared), and dropout in the training process draws
            the same masks on every rank at the same step. Different images then receive the same crop, flip
            and colour jitter at the same position of every rank's batch, which cuts the augmentation diversity
            within a global batch N-fold and correlates the noise the ranks were meant to average. The effect on
            accuracy is usually small, hence the low severity. Initial weights do not need the shared seed: DDP
            broadcasts rank 0's parameters when it is constructed. DistributedSampler's own `seed` must stay the
            same on every rank.
            """
        ),
        example=_code(
            """
            # Bad: the same seed everywhere: the same crops, flips and dropout masks on every rank
            torch.manual_seed(0)

            # Good: per-rank streams; DDP broadcasts rank 0's initial weights anyway
            torch.manual_seed(0 + dist.get_rank())
            sampler = DistributedSampler(train_set, seed=0)  # the sampler seed stays shared
            """
        ),
        fix=(
            "Seed augmentation and dropout per rank (seed + rank); keep DistributedSampler's seed the same on "
            "every rank (DDP already broadcasts rank 0's initial weights)."
        ),
    ),
    Rule(
        code="DD305",
        name="dataset-differs-across-ranks",
        severity=Severity.HIGH,
        summary=(
            "the same index yields different samples on different ranks (unseeded synthetic data, per-rank files)"
        ),
        static=False,
        probe=True,
        what=_prose(
            """
            The probe compares digests of the samples the dataset returns for the same index on different ranks
            and fires when an index yields different content, with the indices and per-rank digests in evidence.
            """
        ),
        why=_prose(
            """
            DistributedSampler shards indices: it assumes that index i is the same sample on every rank. When each
            process builds its own version of the dataset (synthetic data from an unseeded or rank-seeded
            generator, a file list in directory order or shuffled per process, a `random_split` without a fixed
            generator) the union of the ranks' shards is not the dataset: some samples are trained on several
            times per epoch, others never. A per-process random train/validation split also leaks: one rank's
            validation images are another rank's training images, so validation scores are optimistic.
            """
        ),
        example=_code(
            """
            # Bad: each process draws its own random split
            train_set, val_set = random_split(full_set, [0.9, 0.1])

            # Good: the same split on every rank
            g = torch.Generator().manual_seed(42)
            train_set, val_set = random_split(full_set, [0.9, 0.1], generator=g)
            """
        ),
        fix=(
            "Build the dataset identically on every rank: generators seeded independently of the rank, sorted "
            "file lists, and splits made with a fixed generator."
        ),
    ),
    Rule(
        code="DD306",
        name="uneven-batches",
        severity=Severity.MEDIUM,
        summary="ranks run different numbers of batches or batch sizes (hang risk, biased BN)",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe records the number of training batches and the batch size of every step on each rank, and
            fires when ranks run different numbers of batches in an epoch or different batch sizes at the same
            step.
            """
        ),
        why=_prose(
            """
            DDP's backward is a collective. A rank that runs out of batches early leaves the others blocked in
            the all-reduce of their extra step until the timeout (unless the loop runs under `ddp.join()`).
            Unequal batch sizes at one step do not hang but bias the update: DDP averages gradients with equal
            weight per rank, so the samples in a smaller batch count more than those in a larger one, and per-GPU
            BatchNorm normalises a short last batch (a handful of samples) with very noisy statistics that also
            go into the running averages.
            """
        ),
        example=_code(
            """
            # Bad: manual shards of unequal length and a short last batch
            shard = Subset(train_set, range(rank, len(train_set), world_size))
            loader = DataLoader(shard, batch_size=32)

            # Good: equal-length shards and full batches only
            sampler = DistributedSampler(train_set, shuffle=True)
            loader = DataLoader(train_set, batch_size=32, sampler=sampler, drop_last=True)
            """
        ),
        fix=(
            "Give every rank the same number of full batches: DistributedSampler plus DataLoader(drop_last=True); "
            "run genuinely uneven loops under ddp.join()."
        ),
    ),
    Rule(
        code="DD401",
        name="lr-not-scaled",
        severity=Severity.HIGH,
        summary="lr does not follow the global batch vs the reference recipe (linear/sqrt rule)",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis flags an optimizer of a DDP-trained model whose learning rate is a literal, an
            argparse default or the optimizer's default while nothing in the file scales it by the world size:
            `possible` at low severity, since the value may already be tuned for this world size; `likely` and
            high where the file itself shows the single-process recipe (the lr scaled with the per-process batch
            only, or the same lr also training the script's non-DDP run).

            The probe, given the single-process recipe the script was ported from (`--base-lr` and
            `--base-batch`, or `base_lr`/`base_batch` in `[tool.ddpdoctor]`), measures the real global batch (per-rank
            batch × world size × accumulation) and the learning rate in the optimizer's param_groups at the first
            step; it confirms the static finding or clears it, and fires when the learning rate differs from
            base_lr × (global batch / base batch) under the linear rule or base_lr × sqrt(global batch / base
            batch) under the square-root rule (`--lr-scaling auto` picks sqrt for Adam-family, LAMB, Adagrad and
            RMSprop, linear otherwise), with the expected and actual values in evidence.
            """
        ),
        why=_prose(
            """
            DDP averages gradients over ranks, so one step with a per-rank batch b on N ranks is one step on a
            global batch of N × b. A recipe tuned at batch B with learning rate lr takes (N × b) / B times fewer
            steps per epoch after the port; keeping lr unchanged makes each epoch cover less distance and the run
            underfits in the recipe's epoch budget. The linear scaling rule for SGD (lr × N × b / B, Goyal et
            al., 2017) keeps the progress per sample; for adaptive optimisers the square-root rule is the one
            that preserves the update noise (Malladi et al., 2022). The opposite mistakes are as common:
            multiplying lr by the world size after dividing the per-GPU batch so that the global batch stayed B,
            and dividing lr by the world size in the belief that DDP sums gradients (it averages them).
            """
        ),
        example=_code(
            """
            # Bad: recipe tuned at batch 256 with lr 0.1; now 8 GPUs x 128 = 1024 per step
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

            # Good: linear scaling for SGD (square root of the ratio for Adam-family optimisers)
            global_batch = 128 * dist.get_world_size()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * global_batch / 256, momentum=0.9)
            """
        ),
        fix=(
            "Scale the learning rate with the global batch: lr = base_lr * global_batch / base_batch for SGD, "
            "the square root of that ratio for Adam-family optimisers."
        ),
    ),
    Rule(
        code="DD402",
        name="no-warmup",
        severity=Severity.LOW,
        summary="lr scaled up by >= 4x with no warmup schedule",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for a learning rate scaled to 4 or more times the recipe's (from `--base-lr` or
            an expression such as `lr * world_size`) with no warmup: no LinearLR, OneCycleLR, LambdaLR or
            SequentialLR ramp and no per-step assignment to `param_group["lr"]`.

            The probe reads the learning rate at each observed step and fires when it starts at 4x or more the
            recipe's and does not ramp up.
            """
        ),
        why=_prose(
            """
            The linear scaling rule breaks down at the start of training, when the network changes fast: a large
            learning rate from the first step can diverge or settle in a worse region that later epochs do not
            recover from. Goyal et al. (2017) matched batch 256 (23.6% ResNet-50 top-1 error) at batch 8192 only
            with a gradual warmup from the base rate to the scaled rate over the first 5 epochs (23.7%); without
            warmup the same run reached 24.8%.
            """
        ),
        example=_code(
            """
            from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

            # Bad: 8x the recipe's lr from the first step
            optimizer = torch.optim.SGD(model.parameters(), lr=0.8, momentum=0.9)
            scheduler = CosineAnnealingLR(optimizer, T_max=total_steps)

            # Good: 5 epochs of linear warmup from the recipe's lr (0.1), then the schedule
            warmup_steps = 5 * steps_per_epoch
            warmup = LinearLR(optimizer, start_factor=0.125, total_iters=warmup_steps)
            cosine = CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps)
            scheduler = SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])
            """
        ),
        fix="Warm up: ramp the lr linearly from the recipe's value to the scaled value over the first ~5 epochs.",
    ),
    Rule(
        code="DD403",
        name="accumulation-without-no-sync",
        severity=Severity.LOW,
        summary="gradient accumulation all-reduces on every micro-step",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for a DDP training loop that calls `backward()` every iteration but
            `optimizer.step()` only every k-th (gradient accumulation) without running the other micro-steps
            under `ddp.no_sync()`.

            The probe counts DDP gradient all-reduces per optimizer step and fires when there is more than one.
            """
        ),
        why=_prose(
            """
            Every backward through DDP all-reduces the gradients unless it runs under `no_sync()`, so k
            micro-steps cost k all-reduces per optimizer step instead of one. The result is numerically the same
            up to float round-off (averaging is linear), so this costs time rather than accuracy, hence the low
            severity: k times the gradient communication per update, which can dominate the step time of a
            large model on a slow interconnect.
            """
        ),
        example=_code(
            """
            # Bad: an all-reduce after every micro-batch
            for i, (x, y) in enumerate(loader):
                (criterion(ddp(x), y) / accum).backward()
                if (i + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()

            # Good: accumulate locally, reduce once per optimizer step
            for i, (x, y) in enumerate(loader):
                last = (i + 1) % accum == 0
                with contextlib.nullcontext() if last else ddp.no_sync():
                    (criterion(ddp(x), y) / accum).backward()
                if last:
                    optimizer.step()
                    optimizer.zero_grad()
            """
        ),
        fix="Run the forward and backward of every micro-step except the last under ddp.no_sync().",
    ),
    Rule(
        code="DD404",
        name="grads-reduced-twice",
        severity=Severity.HIGH,
        summary="gradients all-reduced by hand on top of DDP",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for `dist.all_reduce(p.grad, ...)` (or an `average_gradients` helper that does
            it) over the parameters of a model that is wrapped in DDP.

            The probe records collectives on parameter gradients after DDP's own reduction in the same step, and
            the ratio of the gradient the optimizer used to the one DDP produced.
            """
        ),
        why=_prose(
            """
            DDP already averages gradients during backward, so after `loss.backward()` every rank holds the same
            averaged gradient. A second `all_reduce` with the default SUM multiplies it by the world size, which
            multiplies the effective learning rate by N (8x on 8 GPUs): training diverges or converges to a
            worse solution, and the damage grows with the number of GPUs. Followed by a division by the world
            size it is numerically redundant but doubles the communication.
            """
        ),
        example=_code(
            """
            # Bad: DDP already averaged the gradients; this sums them again (x world size)
            loss.backward()
            for p in ddp.parameters():
                dist.all_reduce(p.grad)
            optimizer.step()

            # Good
            loss.backward()
            optimizer.step()
            """
        ),
        fix="Remove the manual all_reduce of gradients; DDP already averages them during backward.",
    ),
    Rule(
        code="DD405",
        name="no-learning-signal",
        severity=Severity.HIGH,
        summary="all gradients exactly zero, or loss constant, across the probe's steps",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe records the gradient norm of every parameter at each optimizer step and the loss value,
            and fires when every gradient is exactly zero (or None) at every observed step, or the loss is
            exactly the same at every step.
            """
        ),
        why=_prose(
            """
            A model whose parameters receive no gradient, or whose loss does not move, is not training at all;
            its accuracy stays where the initialisation put it. The usual causes are ordering and identity
            mistakes: `zero_grad()` between `backward()` and `step()`, a loss rebuilt from detached values
            (`torch.tensor(loss.item(), requires_grad=True)` backpropagates into nothing), an optimizer built over parameters the model no longer uses (a
            conversion that cloned them, a model rebuilt after the optimizer), frozen parameters
            (`requires_grad=False` after loading) or a learning rate of zero.
            """
        ),
        example=_code(
            """
            # Bad: gradients cleared between backward and step
            loss.backward()
            optimizer.zero_grad()
            optimizer.step()

            # Good
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            """
        ),
        fix=(
            "Make the loss reach the trained parameters: zero_grad, backward, then step, with an optimizer built "
            "over the model's current parameters and a non-zero learning rate."
        ),
    ),
    Rule(
        code="DD406",
        name="non-finite",
        severity=Severity.HIGH,
        summary="NaN/Inf in loss, gradients or BN running_var",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe checks the loss, the gradients and every BatchNorm running_mean and running_var for NaN
            or Inf at each observed step, and reports the first step, rank, and tensors where they appeared.
            """
        ),
        why=_prose(
            """
            One non-finite gradient on one rank becomes non-finite on every rank after DDP's all-reduce (NaN + x
            is NaN), so a single bad sample poisons all replicas at once. A NaN or Inf in a BatchNorm running
            variance is subtler: training normalises with batch statistics and can look healthy, but the model
            evaluates with the running statistics and outputs garbage, and under the default buffer broadcast a
            corrupt rank 0 copies its buffers to every rank. Occasional Inf gradients are expected under a
            GradScaler (it skips those steps and lowers the scale); a non-finite loss, parameters or statistics
            are not. Typical causes are an unstable loss (log of a softmax that underflowed), a learning rate
            scaled up without warmup (DD401, DD402), or float16 without loss scaling.
            """
        ),
        example=_code(
            """
            # Bad: softmax underflows to 0 and log(0) = -inf; -inf * 0 = nan
            loss = -(torch.log(torch.softmax(logits, dim=1)) * one_hot).sum(dim=1).mean()

            # Good: the fused, numerically stable form
            loss = F.cross_entropy(logits, targets)
            """
        ),
        fix=(
            "Look at the first step and rank where a value became non-finite (in the evidence): make the loss "
            "numerically stable, lower or warm up the learning rate, and use a GradScaler with float16."
        ),
    ),
    Rule(
        code="DD501",
        name="module-prefix-checkpoint",
        severity=Severity.MEDIUM,
        summary="checkpoint saved from the DDP wrapper (keys start with \"module.\")",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for `torch.save(...)` of `ddp.state_dict()` where `ddp` is the DDP wrapper
            rather than `ddp.module`.

            The probe inspects state dicts passed to `torch.save` and fires when their keys start with
            "module.".
            """
        ),
        why=_prose(
            """
            DDP holds the network as its child named `module`, so the wrapper's state dict keys read
            "module.conv1.weight" instead of "conv1.weight". Loading such a checkpoint into the plain network
            fails with missing and unexpected keys, and the common workaround, `strict=False`, loads nothing at
            all without complaint (DD503): evaluation, fine-tuning or a resumed run starts from random weights.
            """
        ),
        example=_code(
            """
            # Bad: keys are "module.conv1.weight", ...
            torch.save(ddp.state_dict(), "ckpt.pt")

            # Good: save the network itself
            if dist.get_rank() == 0:
                torch.save(ddp.module.state_dict(), "ckpt.pt")
            """
        ),
        fix=(
            "Save ddp.module.state_dict(); strip the prefix from existing checkpoints with "
            "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state_dict, \"module.\")."
        ),
    ),
    Rule(
        code="DD502",
        name="save-on-every-rank",
        severity=Severity.LOW,
        summary="torch.save reached by every rank (or by local rank 0 of every node)",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for `torch.save(...)` in a distributed script that is not guarded by a global
            rank check (`dist.get_rank() == 0`, `rank == 0`), including saves guarded by `local_rank == 0`, which
            run once per node.

            The probe records the ranks that called `torch.save` on the same path.
            """
        ),
        why=_prose(
            """
            Every rank writes the same file at the same time. On a shared filesystem the writes interleave or
            truncate each other, and the damage shows up later, when loading fails ("PytorchStreamReader failed
            reading zip archive") or a reader picks up a file that another rank is still rewriting.
            A `local_rank == 0` guard still gives one writer per node. It also costs N times the I/O, which
            slows down every checkpoint.
            """
        ),
        example=_code(
            """
            # Bad: every rank writes the same file
            torch.save(ddp.module.state_dict(), "ckpt.pt")

            # Good: one writer, and nobody reads before it is done
            if dist.get_rank() == 0:
                torch.save(ddp.module.state_dict(), "ckpt.pt")
            dist.barrier()
            """
        ),
        fix="Save on global rank 0 only, then dist.barrier() before any rank reads the file.",
    ),
    Rule(
        code="DD503",
        name="non-strict-load",
        severity=Severity.MEDIUM,
        summary="load_state_dict(strict=False) where keys mismatch (silently skipped weights)",
        static=True,
        probe=True,
        what=_prose(
            """
            Static analysis looks for `load_state_dict(..., strict=False)` whose result (the missing and
            unexpected keys) is not inspected.

            The probe records the keys `load_state_dict` reported as missing or unexpected, and fires when any
            parameter or buffer of the model was not loaded, with how many.
            """
        ),
        why=_prose(
            """
            With `strict=False`, `load_state_dict` skips every key that does not match and returns the mismatches
            instead of raising. With a "module." prefix mismatch (DD501) no key matches, nothing is loaded, and
            the model trains or evaluates from its random initialisation; with a partial mismatch some layers stay
            random. The returned (missing_keys, unexpected_keys) tuple is almost always ignored.
            """
        ),
        example=_code(
            """
            # Bad: nothing matches ("module." prefix) and nothing complains
            model.load_state_dict(torch.load("ckpt.pt"), strict=False)

            # Good: fix the key names, then load strictly
            from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

            state = torch.load("ckpt.pt", map_location="cpu")
            consume_prefix_in_state_dict_if_present(state, "module.")
            model.load_state_dict(state)  # strict=True: a mismatch raises
            """
        ),
        fix=(
            "Load with strict=True after fixing the key names; if partial loading is intended, check the "
            "missing_keys and unexpected_keys that load_state_dict returns."
        ),
    ),
    Rule(
        code="DD504",
        name="unreduced-metric",
        severity=Severity.LOW,
        summary="evaluation metric computed per rank and reported without a reduction",
        static=True,
        probe=False,
        what=_prose(
            """
            Static analysis looks for an evaluation metric (accuracy, loss, counts accumulated in an evaluation
            loop over a distributed loader) that is printed, logged or compared for checkpoint selection without
            an `all_reduce`, `all_gather` or `reduce` on it.
            """
        ),
        why=_prose(
            """
            With a DistributedSampler each rank evaluates 1/N of the validation set. A metric reported by rank 0
            is the score of rank 0's shard: N times fewer samples, so noisier, and not the number a single-GPU
            evaluation of the same model gives. Best-checkpoint selection and early stopping on it follow that
            noise; when each rank decides on its own metric, ranks can disagree about stopping and the job
            hangs.
            """
        ),
        example=_code(
            """
            # Bad: rank 0 reports the accuracy of its own shard
            if rank == 0:
                print(f"val acc {correct / total:.4f}")

            # Good: sum the counts over ranks first
            totals = torch.tensor([correct, total], dtype=torch.float64, device=device)
            dist.all_reduce(totals)
            if rank == 0:
                print(f"val acc {(totals[0] / totals[1]).item():.4f}")
            """
        ),
        fix="All-reduce the metric's sums (e.g. correct and count) across ranks before dividing, logging or comparing.",
    ),
    Rule(
        code="DD901",
        name="probe-hang",
        severity=Severity.CRITICAL,
        summary="ranks stopped making progress; per-rank Python stacks and the pending collective in evidence",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe fires when, at its `--timeout`, a rank has been silent (no step, collective or other event)
            much longer than its own step pace while blocked in a call that waits for the other ranks (a
            collective, a point-to-point receive, DDP's buffer broadcast or backward). Before it ends the ranks it
            records each rank's Python stack and the collective each rank entered and has not left. A run that
            was still making progress when the timeout expired is not a hang: the report says so in a note, with
            the observed step time and a --timeout that would fit, and analyses the steps it recorded.
            """
        ),
        why=_prose(
            """
            A hang means the ranks disagree about what comes next: some wait in a collective the others never
            call (DD206), have no more batches for (DD306), or a rendezvous waits for ranks that do not exist
            (DD104, DD109). Real jobs sit in that state until the process-group timeout, then crash or restart
            from the last checkpoint. The same disagreement is harmful when it does not hang: collectives that
            happen to match in size silently exchange the wrong tensors. The stacks show where each rank waits.
            """
        ),
        example=_code(
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
    ),
    Rule(
        code="DD902",
        name="rank-failed",
        severity=Severity.CRITICAL,
        summary="a rank raised or died; exception text and traceback in evidence",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe fires when a rank raised an exception or exited abnormally (non-zero status, signal) during
            the run, with the exception, its traceback, the exit status and which rank failed first in evidence.
            """
        ),
        why=_prose(
            """
            A rank that dies stops the job: the launcher tears down the others, or they wait in their next
            collective until the timeout. The first failure is the root cause; errors printed afterwards by the
            other ranks (connection reset by peer, watchdog timeouts) are consequences, which is why the first
            failing rank is reported. Failures that only happen distributed are common: one rank reading a file
            another has not finished writing, per-rank paths, device mismatches. Findings that need the rest of
            the run are missing from a report with this finding.
            """
        ),
        example=_code(
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
    ),
    Rule(
        code="DD903",
        name="not-distributed",
        severity=Severity.INFO,
        summary="the script never initialised a process group / never built DDP",
        static=False,
        probe=True,
        what=_prose(
            """
            The probe fires when the run ended without any rank initialising a process group or constructing
            DistributedDataParallel.
            """
        ),
        why=_prose(
            """
            Launched with N processes, a script that never joins a process group runs N independent single-GPU
            trainings on the whole dataset, all writing the same outputs; if it was meant to be distributed,
            nothing is. If the script is deliberately single-process, the distributed checks do not apply and
            the static findings are what remains; the probe's other findings describe N unrelated runs.
            """
        ),
        example=_code(
            """
            # Bad: launched with torchrun, but every process trains alone
            model = Net().cuda()
            loader = DataLoader(train_set, batch_size=32, shuffle=True)

            # Good: join the job, wrap the model, shard the data
            dist.init_process_group("nccl")
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            model = DDP(Net().cuda(local_rank), device_ids=[local_rank])
            loader = DataLoader(train_set, batch_size=32, sampler=DistributedSampler(train_set))
            """
        ),
        fix=(
            "Initialise the process group from the launcher's environment and wrap the model in "
            "DistributedDataParallel; for a single-process script use --static."
        ),
    ),
)


_BY_CODE = {r.code: r for r in RULES}


def get_rule(code: str) -> Rule:
    """The rule for a code (case-insensitive); KeyError for an unknown code."""
    try:
        return _BY_CODE[code.strip().upper()]
    except KeyError:
        raise KeyError(f"unknown rule code {code!r}") from None


def select_codes(patterns: list[str] | tuple[str, ...]) -> set[str]:
    """Codes matched by prefix patterns (`DD3` = all data rules). Raises ValueError on a pattern matching none."""
    chosen: set[str] = set()
    for pat in patterns:
        p = pat.strip().upper()
        if not p:
            continue
        hits = {c for c in _BY_CODE if c.startswith(p)}
        if not hits:
            raise ValueError(f"unknown rule or prefix {pat!r}")
        chosen |= hits
    return chosen


def _md_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def catalog_markdown_table() -> str:
    """The README's rule table (between `<!-- rules:start -->` and `<!-- rules:end -->`), generated from `RULES`
    so the two cannot drift apart; a test compares them."""
    lines = [
        "| code | name | default severity | static | probe | summary |",
        "|---|---|---|---|---|---|",
    ]
    for r in RULES:
        lines.append(
            f"| {r.code} | {_md_cell(r.name)} | {r.severity.label} | {'yes' if r.static else '–'} | "
            f"{'yes' if r.probe else '–'} | {_md_cell(r.summary)} |"
        )
    return "\n".join(lines) + "\n"
