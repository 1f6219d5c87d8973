"""The probe's event model: the run directory's layout and the one documented list of event kinds.

The data flows one way: code inside the ranks (ddpdoctor/probe) writes events; the analyses
(ddpdoctor/analyses) read them through `ddpdoctor.rundata.read_run` (the reader lives there). A recorded run
directory is a complete input, so `ddpdoctor report DIR` redoes the analysis without running anything. Nothing
here imports torch.

Run directory layout (schema `SCHEMA`):

    meta.json                  the probe's settings and the launch plan (see `META_KEYS`)
    static.json                static findings of the `check` that recorded the run (absent in attach mode)
    launcher.json              how the launch ended: exit codes per rank, timed out, interrupted, wall time
    events/<host>-p<pid>.jsonl one append-only JSON-lines log per process (ranks, mp.spawn children, the main
                               process of a self-spawning script)
    events/<host>-p<pid>.bin   binary side file of that process: index orders and parameter vectors, referenced
                               from events by a *blob reference* (see `BlobRef`)
    events/<host>-p<pid>.stack Python stacks of every thread, dumped by faulthandler when the probe timed out
    logs/                      the user's stdout/stderr per rank (launcher mode)
    writes/<absolute path>     the files the script wrote (launcher modes: ddpdoctor.probe.fsview redirects them
                               here; the user's tree is untouched); deleted/ records deletions (whiteouts)
    .ddpdoctor-run             ddpdoctor's marker: only a directory holding it is ever cleared or reused
                               (ddpdoctor.probe.rundir)
    (attach mode may record one run in several directories, one per node: `read_runs` reads them as one run)
    source/<path>              copies of the user's source files the run refers to (the script, and in launcher
                               modes every user file named by a recorded site, traceback or stack), at their path
                               relative to the user's working directory (`_outside/<name>` for files outside it);
                               meta.json `sources` maps recorded paths to them. Analyses read user source from
                               here first (analyses.context.RunContext.source_text), so a run directory copied to
                               another machine is analysed the same.

Every event is one JSON object on one line with at least `kind`, `t` (seconds since the epoch), `pid`, `seq`
(per process) and `rank` (null until the process knows it: a child of mp.spawn learns it in
init_process_group). Events are data: JSON values only; tensors are reduced when recorded.

Size: one module because `EVENT_KINDS` is one list by design (the contract between the recorders and the
analyses, a line per field, ~850 lines; tests hold every recorded kind and field to it); the run-directory reader is
`ddpdoctor.rundata`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

SCHEMA = "ddpdoctor.events/1"
META_FILE = "meta.json"
STATIC_FILE = "static.json"
LAUNCHER_FILE = "launcher.json"
EVENTS_DIR = "events"
RUN_MARKER = ".ddpdoctor-run"
LOGS_DIR = "logs"
SOURCE_DIR = "source"

# What meta.json holds (written by the launcher, or by the first rank in attach mode).
META_KEYS = {
    "schema": "SCHEMA",
    "mode": "'torchrun' (N ranks through torch.distributed.run), 'spawn' (script started once, spawns its own "
    "ranks) or 'attach' (python -m ddpdoctor.probe under the user's launcher)",
    "script": "the script path as the user gave it",
    "script_abs": "absolute script path",
    "args": "script arguments",
    "cwd": "the user's working directory (finding paths are relative to it)",
    "nproc": "ranks requested",
    "epochs": "epochs observed per run (0 = no limit)",
    "steps": "optimizer steps kept per epoch (0 = no limit)",
    "timeout": "seconds for the whole probe",
    "device": "requested device: auto | cpu | cuda",
    "base_lr": "lr of the single-process reference recipe, or null",
    "base_batch": "batch size of the reference recipe, or null",
    "lr_scaling": "auto | linear | sqrt | none",
    "small_bn_batch": "per-rank BN batch below which local BN is too small",
    "legacy_local_rank_arg": "option passed as --local_rank=N to legacy scripts, or null",
    "plan": "the launch plan (ddpdoctor.probe.plan.LaunchPlan.to_json): mode, spawn_line, reason, decided_at_runtime, "
    "...; `runtime_decision` {mode, reason, site} when a single launch asked to be relaunched under torchrun",
    "sources": "{recorded path: copy under source/, relative to the run directory} of the user's source files "
    "(the script always; in launcher modes also every user file named by the recorded sites, tracebacks and stacks, "
    "bounded in number and size); absent in runs recorded before snapshots existed",
    "python": "Python version of the launcher",
    "host": "host name",
    "started": "start time (seconds since the epoch)",
    "keep_run": "where `check --keep-run` kept the run, or null when the run directory was temporary (removed after "
    "the report); absent in attach mode",
    "arm": "`ddpdoctor triage` runs only: the arm's probe settings {arm, bn_mode, bn_convert, bn_group_size, seed} "
    "(ddpdoctor.probe.arms)",
}


@dataclass(frozen=True)
class EventKind:
    kind: str
    doc: str
    fields: dict[str, str]


def _k(kind: str, doc: str, /, **fields: str) -> EventKind:
    return EventKind(kind, doc, fields)


# The one list of event kinds. A recorder adding a kind documents it here first.
EVENT_KINDS: dict[str, EventKind] = {
    k.kind: k
    for k in (
        # --- process lifecycle (probe/session.py, probe/bootstrap.py)
        _k(
            "process_start",
            "first event of every process's log",
            role="'rank' (launched by torchrun), 'attached', 'main' (self-spawning script), 'spawned' (child of "
            "multiprocessing started by spawn/forkserver), 'forked' (child started by fork), 'child' (another "
            "Python process the script started: only its file writes are recorded)",
            ppid="parent pid",
            host="host name",
            argv="sys.argv",
            cwd="working directory",
            env="launcher variables: MASTER_ADDR, MASTER_PORT and those of ddpdoctor.world.WORLD_ENV (torchrun's "
            "RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, ...; SLURM's SLURM_PROCID, SLURM_NODEID, ...; Open MPI's)",
            python="Python version",
            schema="SCHEMA",
            main_thread="ident of the main thread as faulthandler prints it (0x...)",
            stack_file="file that receives faulthandler dumps",
            stacks_at="when (seconds since the epoch) the process dumps every thread's stack into stack_file, a "
            "moment before the probe's timeout (no signal: session.StackTimer); null when it does not",
            stack_signal="runs recorded before stacks_at: the signal number that made the process dump its stacks",
            mode="the probe's launch mode (meta.json `mode`)",
        ),
        _k(
            "torch_ready",
            "torch finished importing and the recorders are installed",
            torch="torch version",
            device="device the ranks run on: cpu | cuda",
            cuda_emulated="CUDA emulated on CPU (install_cuda_emulation was applied)",
            emulation_error="why emulation could not be installed, or null",
            distributed_debug_dropped="TORCH_DISTRIBUTED_DEBUG's value when it was DETAIL and the rank, emulating "
            "CUDA on CPU, ran without it (DETAIL segfaults DDP on CPU torch); null otherwise",
            recorders="names of the installed recorders",
            installed_now="those installed once torch was imported (the others needed no torch)",
            cuda_available="torch.cuda.is_available() as the script sees it",
            device_count="torch.cuda.device_count() as the script sees it",
            install_seconds="time spent installing the emulation and the recorders",
        ),
        _k("emulation", "the CUDA emulation mapped something for the first time (its notify(what, detail))",
           what="cuda_device | nccl_to_gloo | ddp_device_ids | syncbn_ddp_check | sync_batchnorm | autocast_cuda | ...",
           detail="JSON details"),
        _k(
            "script_start",
            "the bootstrap is about to run the user's script",
            script="absolute path",
            args="sys.argv[1:] as the script sees it",
            injected="arguments the probe added (legacy --local_rank)",
        ),
        _k(
            "done",
            "the process finished its work; later deaths are teardown, not failures",
            reason="'script returned' | 'sys.exit(0)' | 'epochs observed' | 'steps observed' "
            "| 'spawned function returned'",
            steps="optimizer steps taken",
            epochs="training epochs observed",
            backwards="backward passes of the whole process (with steps 0: parameters updated without torch.optim)",
            writes_waited="seconds the process waited for writes in progress (a checkpoint saved by a background "
            "thread) before leaving",
            writes_cut="paths still being written when it had to leave anyway (the run's copy is incomplete)",
            site="for 'sys.exit(0)': the user line that exited",
        ),
        _k(
            "exception",
            "the script (or a spawned function) raised; recorded before it propagates",
            type="exception class",
            message="str(exception)",
            traceback="formatted traceback text",
            frames="[[file, line, function], ...] innermost last",
            user_frame="innermost frame in user code: {file, line, function}",
            exit_code="for SystemExit",
            where="'script' | 'spawned function' | 'process'",
        ),
        _k("spawned_function", "a child of torch.multiprocessing.spawn starts the user's function",
           index="process index", function="qualified name"),
        _k("peers_wait", "a finished rank waited for its peers before leaving", world="world size", seconds="waited",
           complete="all peers arrived"),
        _k("exit", "the process is leaving with os._exit after flushing", code="exit status"),
        _k("internal_error", "the recorder itself failed; the user's run went on", where="recorder/patch",
           error="exception text", traceback="text"),
        # --- process group (probe/recorders/process_group.py)
        _k(
            "pg_init",
            "init_process_group returned or raised",
            site="{file, line} of the call in user code",
            backend_requested="backend argument as the script passed it",
            init_method="init_method argument",
            rank_arg="rank argument (null when not passed)",
            world_size_arg="world_size argument (null when not passed)",
            env_rank="the launcher's rank: RANK, else SLURM_PROCID (srun), else OMPI_COMM_WORLD_RANK (ddpdoctor.world)",
            env_world_size="the launcher's world size: WORLD_SIZE, else SLURM_NTASKS, else OMPI_COMM_WORLD_SIZE",
            overridden="{argument: [given, used]} where the probe used the launcher's values",
            rendezvous="{given, used} when the probe moved the script's own rendezvous (tcp://host:port, or "
            "MASTER_ADDR/MASTER_PORT set by a self-spawning script) to a free port on 127.0.0.1, else null",
            ok="returned normally",
            backend="backend in use (the rank in use is the event's `rank`)",
            world_size="world size in use",
            seconds="time spent in init_process_group",
            error="exception text when it raised",
        ),
        _k("pg_init_begin", "init_process_group is about to rendezvous (fields as pg_init)", site="call site",
           rank_arg="rank argument", world_size_arg="world_size argument", backend_requested="backend argument",
           init_method="init_method argument", env_rank="the launcher's rank", env_world_size="its world size",
           overridden="{argument: [given, used]}", rendezvous="{given, used} or null (see pg_init)"),
        _k("launch_decision", "the main process of a single launch (a script that may spawn its own ranks) showed "
           "which launch it needs (ddpdoctor.probe.launch_check)", mode="'spawn' (it started its ranks) | "
           "'torchrun' (it needs a launcher: the process leaves and the run is relaunched under torchrun)",
           reason="what it did, in words", site="user line that decided it"),
        _k(
            "collective",
            "a torch.distributed collective called from Python (first calls per site only)",
            op="all_reduce | broadcast | barrier | all_gather | ...",
            site="call site",
            call="per-process collective counter",
            numel="elements of the first tensor argument",
            dtype="its dtype",
            implicit="absent for the script's own calls; what made torch call it at this user line otherwise "
            "(ddp_buffers: DDP's broadcast of rank 0's buffers at the start of a forward)",
        ),
        _k("collectives_summary", "per call site counts of collectives at the end", sites="[{op, site, count}]"),
        # --- launch styles and stand-ins (probe/launch_env.py, probe/standins/)
        _k("launch_env", "the rank's environment was given the contract of the launcher the script is written for "
           "(ddpdoctor.probe.launch_env)", launcher="'horovodrun' | 'fabric-run'", set="{variable: value} set",
           removed="torchrun variables removed"),
        _k(
            "standin",
            "a package the script imports was not importable and ddpdoctor's stand-in was used (once per process)",
            package="'horovod' | 'apex'",
            imported_as="module name the script imported first",
            reason="why the real package was not used ('not installed', or an unrelated package of that name)",
            implementation="the stand-in's module",
            differences="where the stand-in differs from the original, in words",
            site="user line whose import loaded it",
        ),
        _k(
            "hvd_init",
            "hvd.init() joined the job (Horovod stand-in)",
            site="call site",
            launcher="where the slot came from: 'horovodrun' (HOROVOD_*) | 'mpirun' | 'pmi' | 'torchrun' | 'none'",
            backend="torch.distributed backend in use",
            size="hvd.size()",
            local_rank="hvd.local_rank()",
            local_size="hvd.local_size()",
            cross_rank="hvd.cross_rank()",
            cross_size="hvd.cross_size()",
            standin="always true (the stand-in records it)",
        ),
        _k("hvd_torch_distributed", "user code used torch.distributed's default process group in a Horovod run: "
           "the stand-in initialised one, Horovod never does (first sites)", site="the user line",
           standin="always true"),
        _k(
            "hvd_op",
            "a Horovod collective called straight from user code (first calls per site)",
            op="allreduce | allreduce_ | allgather | broadcast",
            site="call site",
            call="calls at this site so far",
            name="the operation's name argument",
            in_place="the op writes into its argument (allreduce_)",
            result_discarded="the caller threw the returned tensor away (an expression statement `hvd.allreduce(t)`): "
            "its own `t` is unchanged; null for in-place ops",
            reduce_op="Average | Sum | Min | Max | Product",
            numel="elements of the argument",
            dtype="its dtype",
            input_mean="mean of the argument before the op (this rank's value for a scalar metric)",
            result_mean="mean of the result (for in-place ops: of the argument after it)",
            standin="always true",
        ),
        _k(
            "hvd_broadcast",
            "hvd.broadcast_parameters / hvd.broadcast_optimizer_state called from user code",
            what="'parameters' | 'optimizer_state'",
            argument="type of the argument (OrderedDict for a state_dict, list, the optimizer class)",
            opt="probe id of the optimizer (optimizer_state)",
            tensors="tensors broadcast",
            numel="their elements (parameters)",
            root_rank="root",
            initialised_state="optimizer_state: a fresh optimizer's state was initialised by a zero-gradient step "
            "first (not counted as a training step)",
            site="call site",
            standin="always true",
        ),
        _k(
            "grad_averaging",
            "an optimizer that averages gradients across ranks without DDP was built (hvd.DistributedOptimizer)",
            wrapper="'horovod.torch.DistributedOptimizer'",
            opt="probe id of the returned optimizer (the one the script steps)",
            wrapped_opt="probe id of the optimizer it was built from",
            site="call site",
            backward_passes_per_step="argument",
            op="reduce op of the gradients",
            compression="compressor class",
            gradient_predivide_factor="argument",
            params="parameters it updates",
            world_size="ranks",
            standin="the stand-in recorded it",
        ),
        _k(
            "amp_init",
            "apex.amp.initialize prepared models and optimizers (apex stand-in)",
            opt_level="O0 | O1 | O2 | O3",
            loss_scale="'dynamic' or the static scale",
            autocast="the models' forward runs under autocast",
            models="models",
            optimizers="optimizers",
            site="call site",
            standin="always true",
        ),
        _k("amp_skipped_step", "apex amp found inf/NaN gradients: the next optimizer.step() is skipped and the loss "
           "scale halved (first occurrences)", loss_id="loss scaler", loss_scale="the new scale",
           standin="always true"),
        # --- DDP (probe/recorders/ddp.py, forward.py, sync_bn.py)
        _k(
            "ddp_init",
            "DistributedDataParallel constructor returned or raised",
            ddp="probe id of the DDP object",
            site="call site",
            module_class="class of the wrapped module",
            params="parameters of the wrapped module",
            numel="their elements",
            norm_layers="{class name: count} of normalisation layers inside",
            broadcast_buffers="argument",
            device_ids="argument (as text)",
            output_device="argument (as text)",
            find_unused_parameters="argument",
            static_graph="argument",
            mixed_precision="a mixed_precision config was passed",
            world_size="size of its process group",
            params_device="where the wrapped module's parameters are, as on a GPU machine: 'cuda:N' (real or "
            "emulated) | 'cpu'",
            current_device="torch.cuda.current_device() at construction (null without CUDA)",
            ok="constructed",
            error="exception text when it raised",
            wrapper="absent for torch's DDP; the class of another data-parallel wrapper recorded like DDP: "
            "'apex.parallel.DistributedDataParallel' (never broadcasts buffers)",
            standin="the wrapper is ddpdoctor's stand-in (the real package was not importable)",
            delay_allreduce="apex: argument",
            gradient_average="apex: argument (gradients divided by the world size)",
            gradient_predivide_factor="apex: argument",
        ),
        _k(
            "data_parallel_init",
            "an nn.DataParallel was built (probe/recorders/data_parallel.py)",
            dp="probe id",
            site="call site",
            module_class="class of the wrapped module",
            device_ids="devices it splits batches over ([] = none: it runs the module as is)",
            output_device="where outputs are gathered",
            dim="the dimension batches are split along",
            bn_layers="BatchNorm layers in the wrapped module",
        ),
        _k(
            "data_parallel_forward",
            "one of the first forwards of an nn.DataParallel: how the batch was split",
            dp="probe id",
            step="optimizer steps completed",
            training="the wrapper was in training mode",
            grad="gradients enabled",
            batch="size of the first tensor argument along dim",
            replicas="replicas that ran (chunks of the batch; 1 = the module ran on the whole batch)",
            chunk_sizes="samples per replica, replica 0 first",
            site="call site",
        ),
        _k(
            "ddp_input_digest",
            "the input of one of the first training forwards through a DDP, digested (a fixed batch fed every step "
            "gives equal digests: DD203 then has no data to test)",
            ddp="probe id of the DDP object",
            n="training forward number through this DDP (1-based)",
            step="optimizer steps completed",
            digest="blake2b of the first input tensor's shape, dtype and evenly strided values",
            rows="short digests of its first samples (rows along dim 0, at most ROW_DIGESTS): a sample that recurs "
            "in another forward was drawn from a finite set (a dataset), not generated fresh",
        ),
        _k(
            "ddp_inputs",
            "the first training forward through a DDP: where its input and its parameters are",
            ddp="probe id of the DDP object",
            device="device of the first tensor input, as on a GPU machine ('cuda:N' | 'cpu'; null: no tensor)",
            params_device="device of the wrapped module's parameters at that forward",
            site="call site",
        ),
        _k(
            "sharded_init",
            "a FullyShardedDataParallel was constructed or fully_shard applied: the ranks' model is kept consistent "
            "without DDP",
            wrapper="'FullyShardedDataParallel' | 'fully_shard'",
            site="call site",
        ),
        _k(
            "forward_bypass",
            "a training-mode forward (grad enabled) of a module owned by a DDP ran outside DDP's forward; "
            "first occurrence per (ddp, module, site)",
            ddp="probe id",
            module_class="class",
            module_path="qualified name inside the DDP module ('' = the wrapped module itself)",
            site="call site",
            step="optimizer steps taken before it",
        ),
        _k(
            "sync_bn_convert",
            "SyncBatchNorm.convert_sync_batchnorm returned",
            site="call site",
            arg_class="class of the argument",
            arg_is_ddp="the argument was a DistributedDataParallel",
            owned_by_ddp="probe id of a DDP that already owned the argument's parameters, or null",
            converted="BatchNorm layers converted",
            syncbn_layers="SyncBatchNorm layers in the result",
            converter="absent for torch's convert_sync_batchnorm; else the converter: "
            "'apex.parallel.convert_syncbn_model'",
            cloned_params="layers whose weight/bias the converter replaced by new Parameters (apex clones them)",
            replaced_params_in_optimizer="fraction of the replaced layers' parameters held by an optimizer that "
            "existed at the conversion (an optimizer built before a cloning conversion), or null",
            optimizers="optimizers that existed at the conversion",
        ),
        _k("syncbn_registered_in_ddp", "a SyncBatchNorm was registered under a module already wrapped by DDP",
           ddp="probe id", name="child name", parent_class="class of the parent module", site="call site"),
        _k(
            "model_check",
            "what each DDP model looks like at the first optimizer step (what DD101 needs)",
            ddp="probe id",
            step="global step",
            norm_layers="{class name: count} at this time",
            syncbn_layers="SyncBatchNorm layers",
            ddp_param_coverage="fraction of the module's current parameters that DDP registered for reduction",
            optimizer_param_coverage="fraction of the module's parameters held by some optimizer",
            syncbn_params_in_optimizer="fraction of SyncBN parameters held by some optimizer",
            syncbn_params_in_ddp="fraction of SyncBN parameters registered with DDP",
            mixed_precision="DDP mixed_precision in use",
        ),
        # --- optimizer (probe/recorders/optimizer.py)
        _k(
            "optimizer_init",
            "a torch.optim.Optimizer was constructed",
            opt="probe id",
            cls="class name",
            module="module defining the class",
            site="call site",
            groups="[{lr, params, numel, weight_decay, momentum, betas}]",
            params_in_ddp="fraction of its parameters owned by a DDP module",
        ),
        _k(
            "optimizer_step",
            "an optimizer step finished (global post-step hook)",
            opt="probe id",
            step="global step counter of this process (1-based)",
            opt_step="steps of this optimizer",
            lrs="lr of each param group at this step",
            ddp_forwards="training forwards through DDP since the previous step",
            bypass_forwards="training forwards bypassing DDP since the previous step",
            train_batches="batches drawn from training-mode loaders since the previous step",
            epoch="training loader iterations started so far (0-based epoch of this step)",
        ),
        # --- parameters (probe/recorders/params.py)
        _k(
            "params",
            "digest of the model parameters after an optimizer step, and once before the first one (step 0)",
            step="global step (0 = the initial weights, just before the first optimizer step)",
            digest="blake2b of the parameter bytes (or of a strided sample, see sampled); with on_device, of an "
            "exact int64 fingerprint of their bits computed on the device (probe.recorders.params)",
            numel="elements covered",
            sampled="digest covers a strided sample",
            values="a fixed sample of parameter values (same positions on every rank)",
            on_device="the digest and values were computed on the GPU and read back without a per-step "
            "synchronisation (absent on CPU runs)",
            source="'ddp' (the DDP module) or 'optimizer'",
            tensors="parameter tensors covered",
        ),
        _k("params_final", "the parameters after the last optimizer step (capped), written at the end",
           step="global step it was taken after", digest="digest", numel="elements", sampled="digest is sampled",
           vector="blob ref (float32): every vector_stride-th value of the concatenated parameters",
           vector_stride="stride of the vector", source="'ddp' or 'optimizer'",
           buffers="{layer name: digest} of the normalisation layers' running stats"),
        # --- data (probe/recorders/data.py)
        _k(
            "sampler_created",
            "a sampler was constructed",
            sampler="probe id",
            cls="class name",
            sampler_kind="distributed | random | sequential | other",
            site="call site",
            len="dataset length",
            num_replicas="DistributedSampler",
            sampler_rank="DistributedSampler's rank argument",
            shuffle="DistributedSampler",
            seed="DistributedSampler",
            drop_last="DistributedSampler",
            replacement="RandomSampler",
            num_samples="RandomSampler / DistributedSampler",
            generator="a generator was passed",
        ),
        _k("set_epoch", "DistributedSampler.set_epoch was called", sampler="probe id", epoch="value", site="call site"),
        _k(
            "sampler_iter",
            "a DistributedSampler produced its order for an epoch",
            sampler="probe id",
            iteration="iteration counter of this sampler (0-based)",
            epoch="sampler.epoch at iteration",
            count="indices in the order",
            digest="blake2b of the whole order (int64)",
            head="first indices",
            order="blob ref (int64): the whole order, or a consistent sample (see sample_mod); indices of the dataset "
            "under any Subset wrappers (see subset_depth)",
            sample_mod="null = whole order; K = only indices i with hash(i) % K == 0, in order",
            num_replicas="at iteration",
            sampler_rank="the sampler's rank at iteration",
            shuffle="at iteration",
            seed="at iteration",
            dataset_len="len(dataset) (the sampler's own dataset, Subset included)",
            subset_depth="Subset wrappers the indices were mapped through to the dataset underneath (0 = none)",
            base_len="length of the dataset the indices refer to (under the Subsets)",
        ),
        _k(
            "loader_created",
            "a DataLoader was constructed",
            loader="probe id",
            site="call site",
            batch_size="batch_size",
            drop_last="drop_last",
            num_workers="num_workers",
            sampler="probe id of what decides its indices (recorders/data.index_sampler)",
            sampler_cls="class of that sampler",
            sampler_kind="distributed | random | sequential | other",
            dataset_cls="dataset class",
            dataset_len="len(dataset) or null",
            subset="null, or for a Subset dataset (nested ones composed) {depth, base_len, len, indices: blob ref "
            "(int64) of the dataset indices under the Subsets it covers (a consistent sample, see sample_mod), "
            "sample_mod}",
        ),
        _k(
            "loader_iter",
            "iter(DataLoader): an epoch (or an evaluation pass) begins",
            loader="probe id",
            it="probe id of this iteration",
            loader_seq="iterations of this loader before this one",
            site="call site of the loop",
            site_seq="iterations started at this site",
            dataset_cls="dataset class",
            dataset_len="len(dataset) or null",
            batch_size="loader.batch_size",
            drop_last="loader.drop_last",
            num_workers="loader.num_workers",
            sampler="probe id of what decides the indices: loader.sampler, or the batch_sampler= it was given (its "
            "inner sampler for torch's BatchSampler); recorders/data.index_sampler",
            sampler_cls="class of that sampler",
            batch_sampler_cls="class of loader.batch_sampler or null",
            sampler_len="len() of that sampler (one rank's epoch), or null",
            sampler_yields="'indices' | 'batches' (a custom batch_sampler=: sampler_len counts batches)",
            grad_enabled="torch.is_grad_enabled() at iter()",
            sampler_kind="distributed | random | sequential | other",
            created_site="where the DataLoader was constructed",
        ),
        _k(
            "loader_iter_end",
            "a loader iteration ended",
            loader="probe id",
            it="iteration id",
            batches="batches yielded",
            sizes="run-length encoded batch sizes [[size, repeat], ...]",
            steps="optimizer steps during the iteration",
            training="optimizer steps happened during it",
            grad_batches="batches drawn with grad enabled",
            reason="'cut' (probe's step limit) | 'exhausted' | 'abandoned' | 'open at end'",
            indices="blob ref (int64) of the indices drawn from the index sampler, in order (capped), mapped through "
            "any Subset wrappers to the dataset underneath",
            indices_count="indices drawn",
            subset_depth="Subset wrappers the indices were mapped through (0 = none)",
        ),
        _k(
            "local_rank_arg",
            "the script's argparse parser declares --local_rank / --local-rank",
            option_strings="declared spellings",
            default="default value",
            required="required=True",
            value="value after parsing, as torchrun leaves it (before any override)",
            overridden_to="the rank's LOCAL_RANK the probe put in the parsed namespace instead of a default that names "
            "no device (-1, None), as torch.distributed.launch passed it, so the run goes on; null when not overridden",
            injected="the probe passed it (legacy launcher behaviour)",
            dest="argparse destination",
            site="where add_argument declared it",
            env_local_rank="LOCAL_RANK in this process's environment",
        ),
        _k(
            "parsed_args",
            "an argparse parser parsed the command line (first parse per parser): its numeric options, so analyses "
            "can evaluate what the script computed from them (the unscaled lr in `args.lr * args.batch_size / 256`)",
            values="{dest: value} of the int/float options after parsing (booleans left out; first 64)",
            site="the parse_args / parse_known_args call in user code",
        ),
        _k(
            "env_read",
            "user code read a launcher variable from the environment (first read per variable: LOCAL_RANK)",
            var="the variable",
            how="'getitem' (os.environ[...], .get, os.getenv) | 'contains' (`in os.environ`)",
            value="its value then (null for a membership test)",
            site="the user line that read it",
        ),
        # --- BatchNorm (probe/recorders/batchnorm.py; issue 4 "BatchNorm" area: DD201-DD207 and the BN table)
        _k(
            "bn_layer",
            "a BatchNorm layer of this process, described once (before its first bn_step)",
            layer="index of the layer in this process (what bn_step / bn_final refer to)",
            name="qualified name in the user's model (path inside the DDP-wrapped module, else inside the "
            "outermost module it was called through); the same on every rank",
            cls="class name",
            bn_kind="'plain' (per-rank BatchNorm) | 'sync' (SyncBatchNorm) | 'emulated_sync' (SyncBatchNorm run by "
            "ddpdoctor's CPU emulation: exact global statistics over gloo)",
            num_features="channels",
            momentum="momentum (null = cumulative average)",
            eps="eps",
            affine="affine",
            track_running_stats="track_running_stats",
            placed="device the script put the layer on as on a GPU machine: 'cuda:N' | 'cpu'",
            group_size="SyncBN: size of its process group (null until it first synchronised)",
            group_ranks="SyncBN: global ranks of its process group",
            would_raise="SyncBN that PyTorch itself would refuse: a process group exists and the script kept the "
            "layer on the CPU",
            site="user line that called the outermost module at the layer's first forward",
            initial="blob ref (float64): running_mean then running_var before the first forward, or null",
            initial_batches_tracked="num_batches_tracked before the first forward",
        ),
        _k(
            "bn_step",
            "BatchNorm forwards of one step: every training-mode forward since the previous optimizer step",
            step="optimizer steps completed before these forwards (0 = before the first step)",
            forwards="columns over the training-mode forwards, in call order: layer, grad (gradients enabled), "
            "samples (input.shape[0]), count (values per channel = samples x spatial), synced (SyncBN "
            "synchronised), channels",
            moments="blob ref (float64): for each forward in order, the input's per-channel mean then biased "
            "variance (channels values each)",
            modes="{layer: mode string} of the forwards since the previous flush: 'T' training with grad, 't' "
            "training without grad, 'E' eval mode (capped at 128 per layer)",
            dropped="{layer: training forwards whose moments were not kept (over 64 per step)} for the whole run",
        ),
        _k(
            "bn_train_no_grad",
            "a BatchNorm layer ran in training mode with gradients disabled (no_grad / inference_mode); first "
            "occurrence per call site",
            site="user line that called the model",
            step="optimizer steps completed",
            inference_mode="inside torch.inference_mode",
            direct="the model was called straight from user code (false: through a library helper such as "
            "torch.optim.swa_utils.update_bn, which recalibrates BN on purpose)",
            root_class="class of the module called",
            bn_layers_in_train_mode="BatchNorm layers of that module in training mode",
            syncbn_layers_in_train_mode="of which SyncBatchNorm",
            tracks_running_stats="the layer updates running statistics",
            untrained_module="{cls, path, params, requires_grad}: the outermost module on the call stack whose "
            "parameters no optimizer trains (a momentum/EMA/teacher encoder), or null",
            cumulative_average="the layer's momentum is None (a cumulative average: a precise-BN recalibration)",
        ),
        _k(
            "bn_final",
            "the running statistics every BatchNorm layer holds at the end of the run (or when recording stopped)",
            step="optimizer steps completed",
            reason="'end of run' | 'recording stopped'",
            layers="[{layer, name, channels, batches_tracked, momentum, training, dropped, train_forwards, "
            "no_grad_forwards, eval_forwards}] in bn_layer order; channels 0 = no running statistics",
            stats="blob ref (float64): per layer with channels > 0, running_mean then running_var",
            no_grad_sites="[{file, line, forwards}]: model forwards with BN in training mode and no grad, per site",
            eval_no_grad_sites="[{file, line, forwards}]: model forwards with BN in eval mode and no grad, per site "
            "(evaluation done right: what clears a static DD207 suspicion there)",
        ),
        # --- BN conversion and applied statistics (probe/recorders/bn_conversion.py, bn_applied.py; DD208-DD212, DD216)
        _k(
            "bn_conversion",
            "a plain BatchNorm layer was replaced by a SyncBN-like layer (any converter: torch's, a library's, the "
            "script's own); written at the first optimizer step after the replacement (or at the end)",
            n="conversion number in this process",
            name="qualified name of the layer in the DDP-wrapped module (else parent class.child)",
            parent_class="class of the module the layer was registered on",
            child="attribute name on the parent",
            site="user line that registered the replacement",
            before="attributes of the original layer: {cls, module, own_forward (the class defining a non-standard "
            "forward, or null), training, momentum, eps, affine, track_running_stats, weight_requires_grad, "
            "bias_requires_grad}",
            after="the same of the replacement when it was registered",
            at_step="the same of the replacement at this event",
            step="optimizer steps completed",
            at_first_step="written at an optimizer step (false: at the end of the run)",
            in_model="the parent still holds the replacement",
            same_params="{weight, bias}: the replacement uses the original's Parameter objects (false: cloned)",
            same_buffers="{running_mean, running_var}: the replacement uses the original's buffers",
            optimizer_new="{weight, bias}: {opt, group, lr, weight_decay, momentum} of the optimizer group holding "
            "the replacement's parameter, or null when no optimizer holds it",
            optimizer_original="the same for the original layer's parameters",
            optimizers="live optimizers",
            equivalence="ddpdoctor.probe.equivalence.compare_functions at the replacement's first forward: {status "
            "'measured' | 'not_measurable', reason, step, input_shape, dtype, train: {equal, max_abs, rel, "
            "tolerance}, eval: {...}, equal}, or null when the layer never ran",
        ),
        _k(
            "bn_applied",
            "per-channel input/output moments of the first gradient-enabled training forwards of every BatchNorm "
            "layer in the first optimizer steps, from which the statistics the layer applied are recovered",
            step="optimizer steps completed before these forwards",
            forwards="columns, one entry per forward: name, cls, channels, samples, count (values per channel), eps, "
            "affine, momentum, sync_like (SyncBN-like class), synced (its process group has more than one rank; "
            "null: unknown), group_ranks (global ranks of its process group, null for plain BN), local_mode "
            "(normalised with per-rank statistics: triage arm L or an in-process check), dtype (of the output)",
            moments="blob ref (float64): per forward, 7 x channels values: input mean, input biased variance, "
            "output mean, output biased variance, input/output covariance, weight (1 without affine), bias (0)",
        ),
        # --- triage arms (probe/arms.py, probe/recorders/bn_triage.py; `ddpdoctor triage`)
        _k("arm", "this process runs a triage arm", arm="arm name: A | L | P | G", bn_mode="'' | local | plain | group",
           bn_convert="plain BN converted to SyncBN when DDP wraps the model (mirror arms)",
           group_size="G arm: ranks per SyncBN subgroup", seed="seed + rank every generator started from (-1: none)"),
        _k("arm_switch", "the arm changed something the script did (first events per kind of change)",
           what="'conversion undone' | 'built as BatchNorm' | 'subgroups' | 'converted to SyncBatchNorm' | 'seed' "
           "(a spawned child seeded seed + rank once the process group gave its rank)",
           arm="arm name", count="occurrences of this kind so far", site="user line",
           converter="converter or class involved", layers="layers concerned", layer="child name",
           kept="class of the layer kept", num_features="channels", groups="subgroups (global ranks)",
           group_size="ranks per subgroup", seed="the seed a spawned child was given"),
        _k("bn_attr_set", "the script's own code changed a BatchNorm layer's momentum/eps, mode or requires_grad "
           "directly (triage arms; first time per line)", attr="'momentum' | 'eps' | 'training' | 'requires_grad'",
           cls="class of the layer", step="optimizer steps completed", site="the line that did it"),
        _k("triage_pairing", "digests that tell whether two arms started from the same weights and saw the same "
           "batches", what="'initial_params' (at the first training forward through DDP, else before the first "
           "optimizer step) | 'batch' (inputs of a training forward through DDP)",
           digest="blake2b of the tensors' bytes", source="'first_forward' | 'ddp' | 'optimizer'",
           tensors="parameter tensors", n="training DDP forward number (1-based)", step="optimizer steps completed",
           shapes="shapes of the first input tensors"),
        _k("bn_samples", "per-sample channel moments of the gradient-enabled training forwards of one step (triage)",
           step="optimizer steps completed before these forwards",
           forwards="columns: name, samples (batch size), count (values per channel), channels",
           moments="blob ref (float64): per forward, the input's biased variance per channel, then the unbiased "
           "variance across samples of the per-sample channel means"),
        _k("bn_attrs", "BatchNorm layer attributes and optimizer membership at an optimizer step (triage): every "
           "layer at the first step, then the layers that changed", step="optimizer steps completed",
           full="the event lists every layer", total="BatchNorm layers in the model",
           layers="{name: {cls, module, own_forward, training, momentum, eps, affine, track_running_stats, "
           "weight_requires_grad, bias_requires_grad, weight_optimizer, bias_optimizer}}; *_optimizer = {opt, "
           "group, lr, weight_decay, momentum} or null"),
        _k("bn_population", "PreciseBN-style population statistics at the final weights on the last training "
           "batches (triage, at the end)", ok="measured", reason="why not", step="optimizer steps completed",
           layers="[{name, channels, batches, eps, momentum, batches_tracked}]",
           stats="blob ref (float64): per layer, the running mean and variance the layer holds, this rank's "
           "population mean and variance (cumulative average of the batch means and unbiased variances), the "
           "population mean and variance over every rank's held batches (= this rank's when not pooled), then "
           "the batch means (batches x channels)",
           pooled="the population statistics of all ranks were exchanged (through the store, with a deadline)",
           batches="held batches", batch_samples="samples in each held batch",
           eval_output_shift="||y_running - y_population|| / ||y_population|| of the eval-mode output on the last "
           "held batch (first output tensor), with the population statistics of all ranks, or null"),
        _k("user_modules", "the user's own modules imported by the end of a triage or conversion-check arm (so the "
           "run keeps their source: a class test in a helper module is located by file and line)",
           modules="[{file, line: 0}] (at most USER_MODULES, sorted)"),
        # --- data, optimisation, checkpoints (probe/recorders/rng.py, dataset.py, optim_health.py, checkpoint.py;
        #     issue 4 areas "Data", "Optimisation", "Checkpoints": DD303-DD306, DD402-DD406, DD501-DD503)
        _k(
            "rng_forward",
            "generator states before one of the first training forwards through DDP (what dropout draws from)",
            n="training DDP forwards recorded so far in this process (1-based; the same forward on every rank)",
            step="optimizer steps completed before this forward",
            epoch="training epoch (0-based)",
            ddp="probe id of the DDP",
            generators="{torch: {digest, next}, device: {digest} or null}: torch's default CPU generator (digest "
            "of its state, next uniform draws computed on a copy) and the current CUDA device's generator",
            advanced="{torch: bool, device: bool}: the forward drew from that generator",
        ),
        _k(
            "rng_loader",
            "global generator states at a training DataLoader iteration (iter() with grad enabled; first 8)",
            loader="probe id",
            iteration="iterations of this loader before this one (0-based)",
            site="call site of the loop",
            num_workers="loader.num_workers",
            worker_base_seed="base seed the loader drew for its workers (worker k: base + k), null without workers",
            loader_generator="the loader was given its own generator",
            worker_init_fn="qualified name of worker_init_fn, or null",
            generators="{torch, numpy (null when never imported), random}: each {digest, next}",
        ),
        _k(
            "rng_seed",
            "the script seeded a global generator (first 12 calls from user code)",
            generator="torch (torch.manual_seed) | numpy (np.random.seed) | random (random.seed)",
            seed="the seed (null for a time-based reseed)",
            site="call site",
            step="optimizer steps completed",
        ),
        _k(
            "dataset_items",
            "digests of the items at fixed indices, read through the dataset's own __getitem__ at the first "
            "iteration of each map-style dataset, with the global generators seeded identically on every rank "
            "and restored afterwards",
            loader="probe id of the loader",
            dataset="probe id of the dataset",
            dataset_cls="class",
            base_cls="class of the dataset under Subset wrappers (the same as dataset_cls without them)",
            site="call site of the loop",
            len="len(dataset)",
            sampler_cls="class of the loader's index sampler",
            sharded="the sampler splits indices across ranks (DistributedSampler or look-alike)",
            subsets="[{len, digest, head}] of nested Subset index lists (random_split), outermost first",
            indices="indices read: 0, 1, len//2, len-1",
            items="[{index, digest, parts (digest per top-level element), tensors, opaque, first: {shape, dtype, "
            "mean}}]",
            deterministic="the first item read twice under the same seed gave the same digest (null: not tested)",
            seed_dependent="the first item read under another seed differs (the dataset draws randomness)",
            draws_from="global generators __getitem__ advanced: torch | numpy | random | device",
            error="exception text when __getitem__ raised",
            seconds="time spent reading",
        ),
        _k(
            "loader_plan",
            "what a DataLoader iteration will yield, as the loader reports it, at every iter() (first 64)",
            loader="probe id",
            iteration="iterations of this loader before this one (0-based)",
            site="call site of the loop",
            grad_enabled="torch.is_grad_enabled() at iter()",
            iterable="IterableDataset",
            batches="len(loader): batches this epoch (null when unknown)",
            sampler_len="len(loader.sampler)",
            dataset_len="len(dataset)",
            batch_size="loader.batch_size (null with a batch_sampler)",
            drop_last="loader.drop_last",
            sampler_cls="class of the index sampler",
            sharded="the sampler splits indices across ranks",
        ),
        _k(
            "train_step",
            "what an optimizer step was made of, recorded just before it (global step pre-hook)",
            step="the step about to be taken (matches optimizer_step.step)",
            opt="probe id of the optimizer",
            backwards="backward passes since the previous step",
            syncing_backwards="of which after a DDP training forward with gradient sync on (DDP all-reduced)",
            max_syncs_per_ddp="the most all-reducing backward passes of any one DDP model in this step (two DDP "
            "models, e.g. a GAN's, each reduce once)",
            nosync_backwards="of which after a DDP forward under no_sync()",
            plain_backwards="of which with no DDP forward before them",
            losses="[[value, float.hex(value)], ...] of the scalar tensors backward() was called on (first 8)",
            loss_numel="element counts of the tensors backward() was called on",
            backward_site="user line of the last backward call",
            loss_module="{cls, input_shape, reduction} of the first nn loss module called since the previous step, "
            "or null",
            grads="{params, none, zero, nonfinite, norm, max_abs, numel} of the optimizer's parameters' gradients",
            zero_grads="names of parameters whose gradient is exactly zero (first 8)",
            hand_reduced="null, or {params, numel, ops, sites, after_ddp, ratio_median, ratio_min, ratio_max}: "
            "gradients of DDP parameters passed to a collective by user code since the previous step; ratio = "
            "norm the optimizer uses / norm before the first hand collective (DDP's result)",
            lrs="lr of each param group",
            initial_lrs="initial_lr of each param group (set by an lr scheduler: its target lr), or null",
        ),
        _k(
            "grad_collective",
            "user code passed the .grad of a parameter DDP reduces to a collective (first 20 per process): called "
            "directly by user code; not inside DDP comm hooks",
            op="all_reduce | reduce | all_gather | all_gather_into_tensor",
            site="call site",
            param="the first parameter whose gradient the tensor covers (a flat buffer may cover several)",
            numel="elements",
            step="the optimizer step this belongs to",
            after_ddp="DDP had already all-reduced gradients in this step",
            syncing_backwards="all-reducing backward passes so far in this step",
            norm_before="gradient norm before the call",
            norm_after="gradient norm after the call (synchronous reductions), or null",
            async_op="async_op=True",
        ),
        _k(
            "nonfinite",
            "a NaN or Inf appeared (first 3 per kind of tensor)",
            tensor="loss | grad | param | running_var | running_mean",
            step="optimizer step it belongs to (loss, grad: the step being prepared; the others: the step taken)",
            names="names of the affected tensors (first 8)",
            count="affected tensors",
            total="tensors checked",
            value="the loss value (loss only)",
            site="user line (loss: the backward or loss-module call)",
        ),
        _k(
            "checkpoint_save",
            "torch.save was called (in a check, the file went to the run directory: see file_write)",
            site="call site",
            callers="[{file, line, function}]: the user frames further out (the script's call into its own save "
            "helper), innermost first, at most 3",
            path="path as the script gave it, or the file object's name, or null",
            abspath="absolute path, or null for an anonymous buffer",
            target="type of the save target (str, PosixPath, BufferedWriter, BytesIO...)",
            existed="the file existed before this save (the run overwrote it)",
            size_before="its size before, bytes",
            bytes="size after the save",
            object="type of the saved object",
            top_keys="first keys of a saved dict",
            state_dicts="[{key ('' = the object itself), keys, module_prefixed, first_keys}] of the state dicts in "
            "the object (itself or one level down)",
            local_rank="LOCAL_RANK",
            node="GROUP_RANK (node index) from the launcher",
            t_start="start time",
            seconds="duration",
            error="exception text when the save raised",
            step="optimizer steps completed",
        ),
        _k(
            "checkpoint_load",
            "torch.load of a file (first 20 per process)",
            site="call site",
            path="path as the script gave it",
            abspath="absolute path",
            users_file="the file read is the user's own, there before the probe (not one this run wrote): a resume",
            object="type of the loaded object",
            top_keys="first keys of a loaded dict",
            counters="{key: int} of the integer values at its top level (epoch, step, iteration...)",
            step="optimizer steps completed",
        ),
        # --- files (probe/fsview.py)
        _k(
            "file_write",
            "the script wrote, created, modified or deleted a file outside the run directory; the operation went to "
            "the run's copy (RUN/writes/<absolute path>), the user's file is untouched (first time per path, "
            "operation and process)",
            op="'write' (created or truncated) | 'create' (exclusive) | 'modify' (append, r+, chmod, utime...) | "
            "'mkdir' | 'delete' | 'rename' (the destination of a rename or replace)",
            path="the path as the script gave it",
            abspath="absolute path",
            stored="where the run keeps it, relative to the run directory",
            existed="the user had a file or folder at that path before the probe",
        ),
        _k(
            "state_dict_load",
            "Module.load_state_dict was called (outermost call)",
            site="call site",
            module_class="class of the module loaded into",
            is_ddp="the module is a DistributedDataParallel",
            strict="strict argument",
            given_keys="keys in the state dict passed",
            model_keys="keys of the module's own state dict",
            missing="missing keys reported (module keys not loaded)",
            unexpected="unexpected keys reported (checkpoint keys ignored)",
            missing_keys="first missing key names",
            unexpected_keys="first unexpected key names",
            given_prefixed="given keys starting with 'module.'",
            model_prefixed="module keys starting with 'module.'",
            matched="module keys present in the given state dict as they are (0 = nothing was loaded)",
            match_without_prefix="module keys matched once 'module.' is stripped from the given keys",
            match_with_prefix="module keys matched once 'module.' is added to the given keys",
            error="exception text when it raised (strict=True mismatch)",
            step="optimizer steps completed",
        ),
    )
}

BASE_FIELDS = ("kind", "t", "pid", "seq", "rank")


@dataclass(frozen=True)
class BlobRef:
    """Where a binary array lives: `{"file", "offset", "nbytes", "codec", "dtype", "count"}` in an event."""

    file: str
    offset: int
    nbytes: int
    codec: str
    dtype: str
    count: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BlobRef":
        return cls(
            file=str(data["file"]),
            offset=int(data["offset"]),
            nbytes=int(data["nbytes"]),
            codec=str(data.get("codec", "raw")),
            dtype=str(data["dtype"]),
            count=int(data["count"]),
        )


def file_name_for(host: str, pid: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", host) or "host"
    return f"{safe}-p{pid}"


def default_host() -> str:
    try:
        return os.uname().nodename
    except AttributeError:  # pragma: no cover - non-POSIX
        import socket

        return socket.gethostname()


# The run-directory reader moved to ddpdoctor.rundata; these names stay reachable from here, loaded on first use
# (no import cycle: rundata imports this module), for the code not yet changed to import them from there.
_READER_NAMES = frozenset({
    "ProcessLog",
    "RunData",
    "MAX_EVENT_LINE",
    "NotRegularFile",
    "read_bounded",
    "read_text_bounded",
    "check_regular_files",
    "is_run_dir",
    "read_run",
    "find_run_dirs",
    "read_runs",
    "parse_stack_dump",
    "rle_expand",
})


def __getattr__(name: str) -> Any:
    if name in _READER_NAMES:
        import ddpdoctor.rundata

        return getattr(ddpdoctor.rundata, name)
    raise AttributeError(f"module 'ddpdoctor.events' has no attribute {name!r}")
