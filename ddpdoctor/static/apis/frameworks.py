"""Models of the training frameworks that build the DDP setup for the script: what they do by construction, so
the rules neither false-alarm on what the framework guarantees nor miss what it leaves to the user. Nothing here
imports a framework: the models are what the framework is documented (and was measured, README "Frameworks") to do.

Lightning (`lightning`, `lightning.pytorch`, `pytorch_lightning`; the names are folded by torchnames.canonical):

    Trainer(strategy=, devices=, num_nodes=, sync_batchnorm=)
                                  an `engine` event; the trainer is an object whose `fit` is modelled below
    trainer.fit(model, train, val, datamodule=)
                                  with sync_batchnorm=True, torch's converter on the model (`convert_syncbn`, as
                                  `torch.nn.SyncBatchNorm.convert_sync_batchnorm`: Lightning's TorchSyncBatchNorm
                                  plugin calls it); on a multi-process strategy the model wrapped in DDP (`wrap`);
                                  each loader re-built with a DistributedSampler whose epoch Lightning sets (a
                                  `loader` with a distributed sampler of its own order); then the hooks, as the fit
                                  loop calls them: configure_optimizers(), an epoch loop over the training loader
                                  calling training_step inside the wrapper's forward, the loss's backward and the
                                  optimizers' steps, then the validation loop (eval mode, no_grad) calling
                                  validation_step, then the epoch-end hooks
    trainer.validate / test       the evaluation loop alone
    self.log(name, value, sync_dist=True) / self.log_dict(...)
                                  a reduction across ranks (`collective`, op all_reduce) with sync_dist true, else a
                                  `report` of a rank-local value
    trainer.is_global_zero, self.global_rank, @rank_zero_only
                                  rank tests by their names (torchnames)

Accelerate:

    Accelerator(...)              the process group of the job (`init_pg` via accelerate.Accelerator) and an `engine`
    accelerator.prepare(*objs)    models wrapped in DDP (`wrap`), optimizers and schedulers as they were, loaders
                                  re-built sharded by rank and reshuffled every epoch (Accelerate's own batch sampler)
    accelerator.backward(loss)    the loss's backward (optim's backward event takes the loss as its target)
    accelerator.unwrap_model(m)   the module inside the wrapper
    accelerator.save_model / save / save_state
                                  a write on the main process only, of the unwrapped weights: nothing to report
    accelerator.gather_for_metrics / gather / reduce / wait_for_everyone
                                  collectives
    accelerator.accumulate(model) an accumulation context that skips the gradient reduction (no_sync) itself
    accelerator.is_main_process / process_index / num_processes
                                  rank tests and values by their names (torchnames)

Hugging Face Trainer: `transformers.Trainer(model, args=TrainingArguments(...))` and `.train()`: an `engine`
(recognised, its loop not walked: it wraps, shards and steps by construction).

Engines not modelled (`deepspeed.initialize`, Lightning's strategy="deepspeed", ColossalAI...): an `engine` event
with modelled False; DD904's static half says they were not analysed.
"""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor.static.apis import nn
from ddpdoctor.static.apis.distributed import _INIT_PARAMS
from ddpdoctor.static.apis.registry import Call, method
from ddpdoctor.static.apis.state import TorchState
from ddpdoctor.static.engine.support import Args
from ddpdoctor.static.semantic import EMPTY, Ctx, Obj, Value, constant_values, is_constant, union

LIGHTNING = "lightning.pytorch."
ACCELERATE = "accelerate."
SYNC_BN_CONVERTER = "torch.nn.SyncBatchNorm.convert_sync_batchnorm"
# Lightning strategies that run one process per device with DDP underneath
_DDP_STRATEGIES = ("ddp", "fsdp")
# engines whose training loop static analysis does not follow
UNMODELLED = {
    "deepspeed.initialize": "DeepSpeed (deepspeed.initialize)",
    "colossalai.initialize": "ColossalAI (colossalai.initialize)",
    "colossalai.launch": "ColossalAI (colossalai.launch)",
}
# hooks the fit loop calls around the batches, in its order (Lightning 1.x names included)
_TRAIN_EPOCH_START = ("on_train_start", "on_train_epoch_start")
_TRAIN_EPOCH_END = ("on_train_epoch_end", "training_epoch_end")
_VAL_EPOCH_END = ("on_validation_epoch_end", "validation_epoch_end")


def _const(value: Value | None) -> list[Any] | None:
    if not value or not is_constant(value):
        return None
    values = list(constant_values(value))
    return values if len(values) == len(value) else None  # `-1` is computed from a literal, not one


def _engine(state: TorchState, node: ast.AST, name: str, modelled: bool, how: str) -> None:
    state.emit("engine", node, name=name, modelled=modelled, how=how)


def _sharded_loader(state: TorchState, node: ast.AST, loaders: Value, by: str) -> Value:
    """Each loader re-built by the framework with a sampler that shards by rank and reshuffles every epoch (a
    `loader` event of its own: the script never iterates the loader it built)."""
    out: list[Obj] = []
    for ld in loaders:
        if ld.kind != "loader":
            out.append(ld)
            continue
        sampler = state.new(
            "sampler",
            node,
            label=f"{by}'s DistributedSampler",
            props={
                "distributed": True,
                "custom": True,
                "overrides_iter": True,  # the framework sets its epoch
                "shuffle": ld.props.get("shuffle"),
                "drop_last": ld.props.get("drop_last"),
                "num_replicas": None,
                "dataset": ld.fields.get("dataset", EMPTY),
                "by_framework": by,
            },
        )
        new = state.new("loader", node, qual=ld.qual, label=ld.label, props=dict(ld.props))
        new.props["bound_name"] = ld.props.get("bound_name")
        new.fields.update(ld.fields)
        new.fields["sampler"] = (sampler,)
        new.fields["batch_sampler"] = EMPTY
        new.props["prepared_from"] = ld
        state.emit("loader", node, obj=new)
        out.append(new)
    return tuple(out)


def _optimizers_in(value: Value, depth: int = 0) -> list[Obj]:
    """The optimizers a `configure_optimizers` return value holds (one, a list, a tuple of lists, a dict)."""
    out: list[Obj] = []
    if depth > 4:
        return out
    for o in value:
        if o.kind == "optimizer":
            out.append(o)
        elif o.kind == "tuple":
            for v in (o.items or ()) + ((o.props["elem"],) if "elem" in o.props else ()):
                out.extend(_optimizers_in(v, depth + 1))
        elif o.kind == "dict":
            out.extend(_optimizers_in(o.fields.get("optimizer", ()), depth + 1))
    return out


# ---------------------------------------------------------------------- Lightning


def _is_lightning_module(o: Obj) -> bool:
    cls = o.props.get("class")
    return o.kind == "module" and cls is not None and cls.props.get("framework") == "lightning"


def _lightning_trainer(state: TorchState, c: Call) -> Value:
    args = c.args
    strategy = _const(args.get(None, "strategy"))
    devices = _const(args.get(None, "devices"))
    nodes = _const(args.get(None, "num_nodes"))
    names = [s.lower() for s in strategy or () if isinstance(s, str)]
    if any("deepspeed" in s for s in names):
        _engine(state, c.node, "Lightning with strategy='deepspeed'", False, "DeepSpeed runs the optimizer steps")
    else:
        _engine(state, c.node, "Lightning Trainer", True, "lightning.pytorch.Trainer")
    one_device = devices is not None and all(d == 1 or d == [0] or d == "1" for d in devices)
    one_node = nodes is None or all(n == 1 for n in nodes)
    single = (one_device and one_node) or (
        strategy is not None and names and all(not any(k in s for k in _DDP_STRATEGIES) for s in names)
    )
    sync_bn = _const(args.get(None, "sync_batchnorm"))
    trainer = state.new(
        "instance",
        c.node,
        label="Trainer",
        props={
            "engine": "lightning",
            "distributed": not single,
            "sync_batchnorm": bool(sync_bn) and any(sync_bn),
            "sync_batchnorm_node": args.node(None, "sync_batchnorm"),
            "args": args,
        },
    )
    return (trainer,)


def _lightning_cli(state: TorchState, c: Call) -> Value:
    """`LightningCLI(ModelClass, DataModuleClass, trainer_defaults={...})`: it builds the Trainer from the defaults
    (and the command line) and runs `fit` on an instance of the model class, unless `run=False`."""
    run = _const(c.args.get(None, "run"))
    cli = state.new("instance", c.node, label="LightningCLI", props={"engine": "lightning_cli"})
    if run is not None and not any(run):
        return (cli,)
    defaults = c.args.get(None, "trainer_defaults") or EMPTY
    kw: dict[str, Value] = {}
    for d in defaults:
        if d.kind == "dict":
            for k, v in d.fields.items():
                kw[k] = union(kw.get(k, EMPTY), v)
    trainer = _lightning_trainer(state, Call("lightning.pytorch.Trainer", "Trainer", c.node, Args(kw=kw), False))

    def instances(value: Value | None) -> Value:
        out: list[Obj] = []
        for cls in value or EMPTY:
            if cls.kind == "class":
                out.extend(state.instantiate(cls, c.node, Args()))
        return tuple(out)

    model = instances(c.args.get(0, "model_class"))
    datamodule = instances(c.args.get(1, "datamodule_class"))
    if model:
        _fit(state, trainer[0], "fit", c.node, Args(pos=[model], pos_nodes=[c.node],
                                                kw={"datamodule": datamodule} if datamodule else {}))
    return (cli,)


def _call_hook(state: TorchState, receiver: Value, name: str, node: ast.AST, args: Args) -> Value | None:
    """Call a hook the user's class defines (None where none of the receivers has it)."""
    out: list[Obj] = []
    for m in receiver:
        if m.props.get("class") is None:
            continue
        found = state._attr_from_class(m, name)
        if found is not None:
            out.extend(state.call_value(found, node, args))  # type: ignore[arg-type]
    return tuple(out) if out else None


def _synthetic_loop(node: ast.AST, iterable: ast.AST | None) -> ast.For:
    loop = ast.For(target=ast.Name(id="batch", ctx=ast.Store()), iter=iterable or ast.Name(id="loader"), body=[],
                   orelse=[])
    return ast.copy_location(loop, node)


def _loop_over(
    state: TorchState, node: ast.AST, loaders: Value, text: str, model: Value, hook: str, train: bool,
    engine: str = "lightning",
) -> tuple[Value, ast.For]:
    """One loop of the framework over `loaders`: an `iterate` event, then `hook(batch, batch_idx)` inside the
    wrapper's forward, in a loop context (and, to evaluate, with gradients off)."""
    loop = _synthetic_loop(node, None)
    if loaders:
        state.emit("iterate", loop, loaders=loaders, loop=loop, iterable=text, engine=engine)
    pushed = 0
    if not train:
        state.ctx.append(Ctx("grad", node, "off", state.frame.id, file=state.frame.file))
        pushed += 1
    state.ctx.append(Ctx("loop", loop, {"loaders": loaders, "iter": text, "target": "batch", "kind": "loader"},
                     state.frame.id, file=state.frame.file))
    pushed += 1
    state._forward_depth += 1  # the strategy calls the step through the DDP wrapper's forward
    try:
        batch = (
            union(*(state.element_of((ld,), node) for ld in loaders))
            if loaders
            else (state.unknown(node, label="batch"),)
        )
        step_args = Args(pos=[batch, (state.unknown(node, label="batch_idx"),)], pos_nodes=[node, node])
        result = _call_hook(state, model, hook, node, step_args) or EMPTY
    finally:
        state._forward_depth -= 1
    return result, loop


def _pop(state: TorchState, n: int) -> None:
    del state.ctx[len(state.ctx) - n:]


def _loaders_from(state: TorchState, node: ast.AST, given: Value | None, model: Value, datamodule: Value | None,
                  hook: str) -> Value:
    if given:
        return given
    for source in (datamodule or EMPTY, model):
        found = _call_hook(state, source if isinstance(source, tuple) else (source,), hook, node, Args())
        if found:
            return found
    return EMPTY


def _fit(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value | None:
    if o.props.get("engine") != "lightning":
        return None
    model = tuple(m for m in (args.get(0, "model") or EMPTY) if m.is_module)
    if not model:
        return (state.const(None, node),)
    datamodule = args.get(None, "datamodule")
    if name == "fit":
        train_given, val_given = args.get(1, "train_dataloaders"), args.get(2, "val_dataloaders")
    else:
        train_given, val_given = None, args.get(1, "dataloaders")
    # `trainer.fit(model, datamodule)`: a LightningDataModule in the loaders' place
    given_dm = tuple(o for o in (train_given or val_given or EMPTY) if o.kind != "loader" and _has_hook(
        (o,), "train_dataloader" if name == "fit" else "val_dataloader"))
    if given_dm:
        datamodule = union(datamodule or EMPTY, given_dm)
        train_given = tuple(o for o in train_given or EMPTY if o not in given_dm) or None
        val_given = tuple(o for o in val_given or EMPTY if o not in given_dm) or None
    if datamodule:
        for dm in datamodule:
            for hook in ("prepare_data", "setup"):
                _call_hook(state, (dm,), hook, node, Args(pos=[(state.const("fit", node),)], pos_nodes=[node])
                           if hook == "setup" else Args())
    model_node = args.node(0, "model") or node
    if o.props.get("sync_batchnorm") and name == "fit":
        nn.convert_syncbn(state, node, Args(pos=[model], pos_nodes=[model_node]), SYNC_BN_CONVERTER, False)
    distributed = o.props.get("distributed")
    if distributed and name == "fit":
        nn.wrap(
            state, node, Args(pos=[model], pos_nodes=[model_node]), "ddp", "lightning.pytorch.strategies.DDPStrategy"
        )

    def prepared(loaders: Value) -> Value:
        return _sharded_loader(state, node, loaders, "Lightning") if distributed else loaders

    if name == "fit":
        optimizers = _optimizers_in(_call_hook(state, model, "configure_optimizers", node, Args()) or EMPTY)
        train = prepared(_loaders_from(state, node, train_given, model, datamodule, "train_dataloader"))
        for hook in _TRAIN_EPOCH_START:
            _call_hook(state, model, hook, node, Args())
        loss, loop = _loop_over(state, node, train, "the training loader", model, "training_step", True)
        try:
            # `self.automatic_optimization = False`: training_step calls manual_backward and the steps itself
            manual = any(False in (_const(m.fields.get("automatic_optimization")) or ()) for m in model)
            if not manual:
                state.emit("backward", node, target=loss or (state.unknown(node, label="loss"),))
                if optimizers:
                    state.emit("opt_step", node, target=tuple(optimizers))
        finally:
            _pop(state, 1)
        for hook in _TRAIN_EPOCH_END:
            _call_hook(state, model, hook, node, Args())
    hook = {"fit": "validation_step", "validate": "validation_step", "test": "test_step"}.get(name, "predict_step")
    val = prepared(_loaders_from(state, node, val_given, model, datamodule,
                                 hook.replace("_step", "_dataloader").replace("validation", "val")))
    if val or _has_hook(model, hook):
        nn._mode(state, model, "eval", node, Args())
        _, loop = _loop_over(state, node, val, "the validation loader", model, hook, False)
        _pop(state, 1)  # the loop
        ends = _VAL_EPOCH_END if hook == "validation_step" else ("on_test_epoch_end", "test_epoch_end")
        for end in ends:
            _call_hook(state, model, end, node, Args())
        _pop(state, 1)  # no_grad
        nn._mode(state, model, "train", node, Args())
    return (state.const(None, node),)


def _has_hook(model: Value, name: str) -> bool:
    for m in model:
        cls = m.props.get("class")
        if cls is not None and any(
            isinstance(st, ast.FunctionDef) and st.name == name for st in getattr(cls.props.get("node"), "body", ())
        ):
            return True
    return False


def _lightning_log(state: TorchState, modules: Value, name: str, node: ast.Call, args: Args) -> Value | None:
    """`self.log(name, value, sync_dist=...)`: with sync_dist true Lightning all-reduces the value across ranks;
    without, the value logged is this rank's own."""
    if not any(_is_lightning_module(m) for m in modules):
        return None
    value = args.get(1, "value") if name == "log" else args.get(0, "dictionary")
    if value and all(_is_metric(o) for o in value):
        return (state.const(None, node),)  # a torchmetrics Metric: Lightning logs its compute(), which syncs
    sync = _const(args.get(None, "sync_dist"))
    if sync is not None and any(sync):
        state.emit("collective", node, op="all_reduce", args=args, library="lightning")
    elif sync is None and args.get(None, "sync_dist") is not None:
        state.emit("collective", node, op="all_reduce", args=args, library="lightning")  # a flag known at run time
    else:
        state.emit("report", node, args=args, name=name)
    return (state.const(None, node),)


def _is_metric(o: Obj) -> bool:
    """A torchmetrics Metric object (or a dict of them, for log_dict)."""
    if o.kind == "dict":
        return bool(o.fields) and all(_is_metric(v) for vs in o.fields.values() for v in vs)
    qual = o.qual or o.props.get("qual") or ""
    return isinstance(qual, str) and qual.startswith("torchmetrics")


# ---------------------------------------------------------------------- Accelerate


def _accelerator(state: TorchState, c: Call) -> Value:
    state.emit("init_pg", c.node, params=dict.fromkeys(_INIT_PARAMS), nodes=dict.fromkeys(_INIT_PARAMS), args=c.args,
           via="accelerate.Accelerator")
    _engine(state, c.node, "Accelerate", True, "accelerate.Accelerator")
    return (state.new("instance", c.node, label="Accelerator", props={"engine": "accelerate", "args": c.args}),)


def _accel(handler):  # noqa: ANN001, ANN202
    def method_handler(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value | None:
        if o.props.get("engine") != "accelerate":
            return None
        return handler(state, o, name, node, args)

    return method_handler


def _prepare(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    items: list[Value] = []
    for i, value in enumerate(args.pos):
        modules = tuple(m for m in value if m.is_module and m.kind != "wrapper")
        loaders = tuple(ld for ld in value if ld.kind == "loader")
        if modules:
            items.append(nn.wrap(state, node, Args(pos=[modules], pos_nodes=[args.pos_nodes[i]]), "ddp",
                                 "accelerate.Accelerator.prepare"))
        elif loaders:
            items.append(_sharded_loader(state, node, value, "Accelerate"))
        else:
            items.append(value)
    if len(items) == 1:
        return items[0]
    return (state.new("tuple", node, items=tuple(items)),)


def _unwrap(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    value = args.get(0, "model") or EMPTY
    out: list[Obj] = []
    for m in value:
        out.extend(m.props.get("inner", (m,)) if m.kind == "wrapper" else (m,))
    return tuple(out) or (state.unknown(node),)


def _main_only_write(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    return (state.const(None, node),)


def _collective(op: str):  # noqa: ANN202
    def handler(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
        state.emit("collective", node, op=op, args=args, library="accelerate")
        if op == "barrier":
            return (state.const(None, node),)
        return args.get(0, None) or (state.unknown(node),)

    return handler


def _accumulate(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    # the gradient reduction is skipped on the accumulating steps by Accelerate itself (DDP's no_sync)
    return (state.new("ctx", node, props={"ctx": "no_sync"}),)


def _passthrough(state: TorchState, o: Obj, name: str, node: ast.Call, args: Args) -> Value:
    return args.get(0, None) or (state.unknown(node),)


# ---------------------------------------------------------------------- Hugging Face, unmodelled engines


def _hf_trainer(state: TorchState, c: Call) -> Value:
    _engine(state, c.node, "Hugging Face Trainer", True, c.qual)
    model = c.args.get(0, "model") or EMPTY
    modules = tuple(m for m in model if m.is_module)
    if modules:  # it wraps the model in DDP when launched on several processes, and shards with its own sampler
        nn.wrap(state, c.node, Args(pos=[modules], pos_nodes=[c.args.node(0, "model") or c.node]), "ddp", c.qual)
    return (state.new("instance", c.node, label="Trainer", props={"engine": "transformers", "args": c.args}),)


def _unmodelled(state: TorchState, c: Call) -> Value:
    _engine(state, c.node, UNMODELLED[c.qual], False, c.qual)
    return (state.unknown(c.node, label=f"{c.qual.rsplit('.', 1)[-1]}()"),)


CALLS = {
    LIGHTNING + "Trainer": _lightning_trainer,
    LIGHTNING + "cli.LightningCLI": _lightning_cli,
    ACCELERATE + "Accelerator": _accelerator,
    "transformers.Trainer": _hf_trainer,
    "transformers.Seq2SeqTrainer": _hf_trainer,
    **dict.fromkeys(UNMODELLED, _unmodelled),
}

METHODS = {
    "fit": method(_fit, "instance"),
    "validate": method(_fit, "instance"),
    "test": method(_fit, "instance"),
    **{
        name: method(_accel(handler), "instance")
        for name, handler in {
            "prepare": _prepare,
            "prepare_model": _prepare,
            "prepare_data_loader": _prepare,
            "prepare_optimizer": _passthrough,
            "prepare_scheduler": _passthrough,
            "unwrap_model": _unwrap,
            "save_model": _main_only_write,
            "save_state": _main_only_write,
            "save": _main_only_write,
            "gather_for_metrics": _collective("all_gather"),
            "gather": _collective("all_gather"),
            "reduce": _collective("all_reduce"),
            "wait_for_everyone": _collective("barrier"),
            "accumulate": _accumulate,
            "no_sync": _accumulate,
        }.items()
    },
}
MODULE_METHODS = {"log": _lightning_log, "log_dict": _lightning_log}
