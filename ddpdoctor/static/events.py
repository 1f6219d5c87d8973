"""The static event schema: every kind of event the interpreter records, with the meaning of each field.

Static rules read a script's `ScriptModel.events` (in execution order) and nothing else from the interpreter, so
this list is their contract with it, as `ddpdoctor.events.EVENT_KINDS` is the probe's contract with the analyses.
A model that records a new kind documents it here first; tests/test_static_events.py checks that every kind the
interpreter emits on the fixtures is documented with exactly its fields, and that every documented field is
produced somewhere.

Every event (`semantic.Event`) has, besides its `data` fields below:

    kind     one of STATIC_EVENT_KINDS
    node     the AST node it happened at (a call, an assignment, a loop)
    file     the path of the file that node is in (the script, or a project module it imports)
    line     that node's line
    seq      its position in execution order
    ctx      the contexts it happened in, outermost first (`semantic.Ctx`: branches, rank tests, loops, no_grad,
             no_sync, try), across the call stack
    frames   ids of the call frames it happened in, outermost first
    func     qualified name of the innermost function
    reached  False for code the walk entered only because nothing called it (see engine.interpreter)
    chain    the calls that led to it, outermost first: (file, line, function called) of each call site

Values in fields are the interpreter's abstract values: a *Value* is a tuple of `semantic.Obj` (every object the
expression may hold); *objects* are single `Obj`s; *nodes* are AST nodes of the call's arguments (for messages).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StaticEventKind:
    kind: str
    doc: str
    fields: dict[str, str]
    optional: frozenset[str] = field(default_factory=frozenset)  # fields only some events of the kind carry


def _k(kind: str, doc: str, /, optional: tuple[str, ...] = (), **fields: str) -> StaticEventKind:
    return StaticEventKind(kind, doc, fields, frozenset(optional))


STATIC_EVENT_KINDS: dict[str, StaticEventKind] = {
    k.kind: k
    for k in (
        # --- models (apis/nn.py)
        _k(
            "wrap",
            "a model wrapped in DistributedDataParallel or DataParallel (or a DDP subclass of the file instantiated)",
            wrapper="the wrapper object (kind wrapper; its family is the wrapped model's)",
            inner="Value: the module wrapped",
            wrapper_kind="'ddp' | 'dp'",
            args="the call's arguments (device_ids, broadcast_buffers...)",
            heuristic="the wrapper was recognised by a bare name never imported",
        ),
        _k(
            "convert_syncbn",
            "convert_sync_batchnorm (or apex's convert_syncbn_model) applied to a model",
            target="Value: the module or wrapper converted",
            arg_node="node of the converted argument",
            qual="canonical name of the converter",
            heuristic="recognised by its name only",
        ),
        _k(
            "syncbn_layer",
            "an nn.SyncBatchNorm layer built directly",
            obj="the layer (kind module, family with syncbn_line)",
        ),
        _k(
            "move",
            "a model moved or cast: .to() .cuda() .cpu() .half() ... (torchnames.MODULE_MOVES)",
            target="Value: the modules moved",
            method="the method name",
            args="the call's arguments",
        ),
        _k(
            "mode",
            "train()/eval() on a model (or on an object that may be one)",
            optional=("unresolved",),
            target="Value: the objects",
            mode="'train' | 'eval' | None (train(flag) with a flag not known)",
            unresolved="True when the receiver is not known to be a model (only eval() then sets 'eval')",
        ),
        _k(
            "forward",
            "a model called: its forward runs",
            target="Value: the modules/wrappers called",
            modes="tuple of the families' modes at that point",
            args="the call's arguments",
            detached="the result is .detach()ed right away",
            inside_forward="the call happens inside another model's forward",
        ),
        _k(
            "load_state_dict",
            "load_state_dict on a model or another object",
            target="Value: the receivers",
            state="Value: the state dict loaded",
            strict="Value of strict=, or None",
            strict_node="node of strict=, or None",
            result_used="the returned missing/unexpected keys are used",
        ),
        _k(
            "bn_stats_reset",
            "BatchNorm statistics about to be recomputed: reset_running_stats(), `m.momentum = None` (a cumulative "
            "average of what follows) or `m.momentum = 1.0` (the next batch's statistics, collected by the caller): "
            "precise BN",
            target="Value: the modules (or objects that may be modules)",
            how="'reset_running_stats', 'momentum = None' or 'momentum = 1'",
        ),
        _k("strip_prefix", "consume_prefix_in_state_dict_if_present: a 'module.' prefix is removed from a state dict"),
        # --- optimisation (apis/optim.py)
        _k(
            "optimizer",
            "an optimizer built (torch.optim, apex, or an Optimizer subclass of the file)",
            obj="the optimizer object (props: cls, params, lr, lr_node)",
        ),
        _k("scheduler", "an lr scheduler built", obj="the scheduler object (props: cls, args)"),
        _k("backward", "x.backward() on anything", target="Value: the receiver"),
        _k(
            "opt_step",
            "an optimizer step: optimizer.step(), scaler.step(optimizer), or .step() on something named like an "
            "optimizer",
            optional=("heuristic",),
            target="Value: the optimizers stepped",
            heuristic="True when the receiver is an optimizer only by its name",
        ),
        _k("sched_step", "scheduler.step()", target="Value: the scheduler"),
        _k(
            "lr_assign",
            "an assignment to a learning-rate name (`lr = ...`, `args.lr *= ...`)",
            target="source text of the assigned name",
            value="Value assigned",
            tags="tags of the value",
        ),
        _k(
            "loss_scaled",
            "an assignment to a loss name of a value that grows with the world size (`loss *= world_size`)",
            target="source text of the assigned name",
            tags="tags of the value",
        ),
        # --- data (apis/data.py)
        _k(
            "loader",
            "a DataLoader built",
            obj="the loader (fields: dataset, sampler, batch_sampler; props: batch_size, shuffle, drop_last)",
        ),
        _k(
            "sampler",
            "a sampler built (DistributedSampler, another torch sampler, or a Sampler subclass of the file)",
            obj="the sampler (props: distributed, custom, shuffle, drop_last, num_replicas, dataset)",
        ),
        _k(
            "iterate",
            "iteration over data loaders starts: a for loop, a comprehension, or iter(loader), or a framework's own "
            "loop (apis/frameworks.py: Lightning's fit loop, its hooks called inside)",
            optional=("engine",),
            loaders="tuple of the loader objects iterated",
            loop="the loop node (For or comprehension), or None for iter()",
            iterable="source text of the iterable",
            engine="the framework whose loop it is ('lightning'): its hooks (validation_step...) run in frames "
            "called from the loop's",
        ),
        _k(
            "set_epoch",
            "x.set_epoch(...) on anything",
            target="Value: the receiver",
            arg="Value of the epoch argument",
            arg_node="its node",
        ),
        # --- process groups and processes (apis/distributed.py)
        _k(
            "init_pg",
            "init_process_group (or hvd.init(), which sets up the job's process group)",
            optional=("via",),
            params="parameter name → Value or None: backend, init_method, timeout, world_size, rank, store, "
            "group_name, "
            "pg_options, device_id",
            nodes="parameter name → node or None",
            args="the call's arguments",
            via="'horovod.torch.init' for hvd.init(), 'accelerate.Accelerator' for Accelerator() (their parameters are "
            "all None)",
        ),
        _k(
            "collective",
            "a collective of torch.distributed (torchnames.COLLECTIVES), or of Horovod (op 'hvd.<name>')",
            optional=("library", "discarded"),
            op="its name",
            args="the call's arguments",
            library="'horovod' for Horovod's collectives",
            discarded="Horovod: a collective that returns a new tensor (allreduce, allgather, broadcast...) called as "
            "a statement, so its result is thrown away",
        ),
        _k(
            "grad_averaging",
            "an optimizer wrapped so that it averages gradients across ranks (hvd.DistributedOptimizer)",
            optimizer="Value: the wrapped optimizer (the call returns it)",
            args="the call's arguments",
            wrapper="'horovod.torch.DistributedOptimizer'",
        ),
        _k(
            "hvd_broadcast",
            "hvd.broadcast_parameters / hvd.broadcast_optimizer_state: rank 0's weights or state sent to every rank",
            what="'parameters' | 'optimizer_state'",
            args="the call's arguments",
        ),
        _k(
            "p2p",
            "a point-to-point op (send, recv, isend, irecv, batch_isend_irecv)",
            op="its name",
            args="the call's arguments",
        ),
        _k(
            "spawn",
            "torch.multiprocessing.spawn / start_processes: the script starts its own ranks (the target is entered "
            "with a per-process rank right after this event)",
            fn="Value: the target",
            nprocs="Value of nprocs, or None",
            nprocs_node="its node",
            qual="canonical name of the call",
        ),
        _k(
            "process",
            "a multiprocessing.Process built with a target (entered right after this event)",
            target="Value: the target",
            qual="canonical name of the call",
        ),
        # --- devices, checkpoints, reporting (apis/tensors.py)
        _k("set_device", "torch.cuda.set_device", arg="Value of the device", arg_node="its node"),
        _k("save", "torch.save", obj="Value saved", path="Value of the path or file", path_node="its node"),
        _k(
            "report",
            "a metric or message reported: print, logging, a writer's add_scalar, a logger's log...",
            args="the call's arguments",
            name="the function or method name",
        ),
        # --- environment (apis/environ.py)
        _k(
            "env_read",
            "an environment variable read",
            var="the variable, or None when the key is not a literal",
            how="'[]' (os.environ[...]) or the function: 'get', 'getenv', 'setdefault', '__getitem__'",
        ),
        _k("env_write", "os.environ[...] = value", var="the variable (None when not a literal)", value="Value written"),
        _k("env_check", 'a membership test `"RANK" in os.environ`', var="the variable, or None when not a literal"),
        # --- paths (apis/paths.py)
        _k(
            "sys_path",
            "sys.path.append / insert: a directory put on the import path",
            dir="the directory as computed, or None when it is not a literal the interpreter can compute",
            added="it became an import root of the project (an existing directory, not an installed one)",
        ),
        # --- command line (apis/cli.py)
        _k(
            "add_argument",
            "parser.add_argument with literal option strings",
            arg="the CliArg (flags, dest, default, line, node, args)",
        ),
        _k("set_defaults", "parser.set_defaults(...)", args="the call's arguments"),
        # --- training frameworks (apis/frameworks.py)
        _k(
            "engine",
            "a training framework that runs the loop for the script: Lightning's Trainer, Accelerate, the Hugging Face "
            "Trainer (modelled), or one static analysis does not follow (DeepSpeed...)",
            name="the engine, in words",
            modelled="whether apis/frameworks.py models what it does (False: its loop was not analysed)",
            how="canonical name of the call that builds it",
        ),
        # --- anything else (engine/calls.py)
        _k(
            "call",
            "a call nobody models (a user function is entered instead): the name and arguments stay visible to rules",
            name="the called name's last part",
            qual="canonical name when the callee is an imported name, else None",
            args="the call's arguments",
            func="the callee object, or None",
        ),
    )
}

EVENT_FIELDS = ("kind", "node", "file", "line", "seq", "ctx", "frames", "func", "reached", "chain")
