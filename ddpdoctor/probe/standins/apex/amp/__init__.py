"""`apex.amp` stand-in: `initialize` and `scale_loss` with apex's rules, mixed precision through torch autocast.

Kept from apex (apex/amp/frontend.py, _initialize.py, handle.py, scaler.py):
- `initialize(models, optimizers, opt_level=..., **overrides)`: the opt levels' properties (O0 fp32, static scale 1;
  O1 casts around functions, dynamic scaling; O2 fp16 model with fp32 batch norm and master weights, dynamic
  scaling; O3 pure fp16, static scale 1), the overrides, the returned structure (a model or a list, an optimizer
  or a list, as given), and the checks that raise: a model already wrapped in a (Distributed)DataParallel,
  parameters in half precision or not on a GPU, an unknown opt_level, cudnn disabled. `enabled=False` makes
  every call a no-op;
- `scale_loss(loss, optimizers)`: yields `loss.float() * scale`; on exit the gradients of the optimizers'
  parameters are unscaled and checked for inf/NaN; with dynamic scaling an overflow halves the scale (floored at
  `min_loss_scale`) and makes the next `optimizer.step()` a no-op, 2000 clean steps double it (capped at
  `max_loss_scale`); `delay_unscale=True` leaves the gradients scaled;
- `master_params`, `state_dict` / `load_state_dict` (the loss scalers), `disable_casts`.

Difference (also in the README): weights stay fp32 at every level; the models' forward runs under
`torch.autocast` (float16 on a GPU, bfloat16 under the probe's CPU emulation) and returns float32 outputs (or
`cast_model_outputs`). So O1 casts only inside the model's forward (not in the loss computed outside it), O2's fp16
model copy and O3's fp16 weight updates are not reproduced, and the `register_*_function` lists are accepted but
change nothing.
"""

import contextlib
import functools
import types
from collections import OrderedDict

import torch

from ddpdoctor.probe.standins import _common


class AmpState:
    def __init__(self):
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1
        self.loss_scalers = []


_amp_state = AmpState()


def warn_or_err(msg):
    if _amp_state.hard_override:
        print("Warning:  " + msg)
    else:
        raise RuntimeError(msg)


def maybe_print(msg, rank0=False):
    distributed = (torch.distributed.is_available() and torch.distributed.is_initialized()
                   and torch.distributed.get_world_size() > 1)
    if _amp_state.verbosity > 0 and (not rank0 or not distributed or torch.distributed.get_rank() == 0):
        print(msg)


class Properties:
    """The options an opt_level sets (apex's names and defaults)."""

    def __init__(self):
        self.__dict__["options"] = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
        }

    def __getattr__(self, name):
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        if name not in self.options:
            raise ValueError(f"Tried to set unexpected option {name}")
        if name == "keep_batchnorm_fp32":
            if value == "False":
                value = False
            elif value == "True":
                value = True
            else:
                assert value is True or value is False or value is None, (
                    "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None, found "
                    f"keep_batchnorm_fp32={value}")
        elif name == "loss_scale" and value != "dynamic":
            value = float(value)
        self.options[name] = value


_LEVELS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False, keep_batchnorm_fp32=False,
               master_weights=False, loss_scale=1.0),
}


class LossScaler:
    """apex's loss scaler: static, or dynamic (2**16 at first, halved on overflow, doubled after 2000 clean steps)."""

    def __init__(self, loss_scale, init_scale=2.0 ** 16, scale_factor=2.0, scale_window=2000,
                 min_loss_scale=None, max_loss_scale=2.0 ** 24):
        if loss_scale == "dynamic":
            self.dynamic = True
            self._loss_scale = min(max_loss_scale, init_scale)
        else:
            self.dynamic = False
            self._loss_scale = loss_scale
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0
        self._has_overflow = False

    def loss_scale(self):
        return self._loss_scale

    def clear_overflow_state(self):
        self._has_overflow = False

    def unscale(self, grads):
        """Divide the gradients by the scale; stop at the first non-finite one when scaling is dynamic."""
        if self._has_overflow:
            return
        inv = 1.0 / self._loss_scale
        with torch.no_grad():
            for g in grads:
                if self.dynamic and not bool(torch.isfinite(g).all()):
                    self._has_overflow = True
                    break
                if inv != 1.0:
                    g.mul_(inv)

    def update_scale(self):
        if self._has_overflow and self.dynamic:
            should_skip = True
            self._loss_scale = (max(self._min_loss_scale, self._loss_scale / 2.0) if self._min_loss_scale
                                else self._loss_scale / 2.0)
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0
        return should_skip


def _check_models(models):
    import sys

    for model in models:
        parallel_type = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            parallel_type = "torch.nn.parallel.DistributedDataParallel"
        apex_parallel = sys.modules.get("apex.parallel")
        if apex_parallel is not None and isinstance(model, apex_parallel.DistributedDataParallel):
            parallel_type = "apex.parallel.DistributedDataParallel"
        if isinstance(model, torch.nn.parallel.DataParallel):
            parallel_type = "torch.nn.parallel.DataParallel"
        if parallel_type is not None:
            raise RuntimeError(f"Incoming model is an instance of {parallel_type}. Parallel wrappers should only be "
                               "applied to the model(s) AFTER \nthe model(s) have been returned from amp.initialize.")


def _check_params_fp32(models):
    for model in models:
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in named:
                if not t.is_floating_point():
                    continue
                if t.dtype == torch.float16:
                    warn_or_err(f"Found {kind} {name} with type {t.type()}, expected torch.cuda.FloatTensor.\n"
                                "When using amp.initialize, you do not need to call .half() on your model\n"
                                "before passing it, no matter what optimization level you choose.")
                elif not _common.on_gpu(t):
                    warn_or_err(f"Found {kind} {name} with type {t.type()}, expected torch.cuda.FloatTensor.\n"
                                f"When using amp.initialize, you need to provide a model with {kind}s\n"
                                "located on a CUDA device before passing it no matter what optimization level\n"
                                "you chose. Use model.to('cuda') to use the default device.")


def _cast(value, dtype):
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _cast(v, dtype)) for k, v in value.items())
    return value


def _autocast_forward(model, output_dtype):
    old_forward = model.forward
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device_type == "cuda" else torch.bfloat16

    @functools.wraps(old_forward)
    def new_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            output = old_forward(*args, **kwargs)
        return _cast(output, output_dtype)

    model.forward = new_forward


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None, loss_scale=None,
               cast_model_outputs=None, num_losses=1, verbosity=1, min_loss_scale=None,
               max_loss_scale=2.0 ** 24):
    """Prepare models and optimizers for mixed precision at `opt_level` (see the module docstring)."""
    _amp_state.opt_properties = Properties()
    _amp_state.verbosity = verbosity
    if not enabled:
        return models if optimizers is None else (models, optimizers)
    if not torch.backends.cudnn.enabled:
        raise RuntimeError("Amp requires torch.backends.cudnn.enabled = True")
    if opt_level not in _LEVELS:
        raise RuntimeError(f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'.  Note "
                           "that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero.")
    props = _amp_state.opt_properties
    props.enabled = True
    props.opt_level = opt_level
    for key, value in _LEVELS[opt_level].items():
        setattr(props, key, value)
    maybe_print(f"Selected optimization level {opt_level}", True)
    for key, value in (("cast_model_type", cast_model_type), ("patch_torch_functions", patch_torch_functions),
                       ("keep_batchnorm_fp32", keep_batchnorm_fp32), ("master_weights", master_weights),
                       ("loss_scale", loss_scale)):
        if value is not None:
            setattr(props, key, value)
    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale

    optimizers_was_list = False
    if isinstance(optimizers, torch.optim.Optimizer) or type(optimizers).__name__ == "LARC":
        optimizers = [optimizers]
    elif optimizers is None:
        optimizers = []
    elif isinstance(optimizers, list):
        optimizers_was_list = True
    else:
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers.")
    if isinstance(models, torch.nn.Module):
        models_was_list = False
        models = [models]
    elif isinstance(models, list):
        models_was_list = True
    else:
        raise TypeError("models must be either a single model or a list of models.")
    _check_models(models)
    if not _amp_state.allow_incoming_model_not_fp32:
        _check_params_fp32(models)

    half = props.cast_model_type not in (None, torch.float32) or props.patch_torch_functions
    if half:
        for model in models:
            _autocast_forward(model, cast_model_outputs if cast_model_outputs is not None else torch.float32)
    elif cast_model_outputs is not None:
        for model in models:
            old = model.forward
            model.forward = functools.wraps(old)(lambda *a, _old=old, **k: _cast(_old(*a, **k), cast_model_outputs))
    for optimizer in optimizers:
        optimizer._amp_stash = types.SimpleNamespace(params_have_scaled_gradients=False, already_patched=False)
    _amp_state.loss_scalers = [LossScaler(props.loss_scale, min_loss_scale=min_loss_scale,
                                          max_loss_scale=max_loss_scale) for _ in range(num_losses)]
    _common.emit(
        "amp_init",
        opt_level=opt_level,
        loss_scale=props.loss_scale if props.loss_scale == "dynamic" else float(props.loss_scale),
        autocast=bool(half),
        models=len(models),
        optimizers=len(optimizers),
        site=_common.user_frame_site(),
        standin=True,
    )
    if optimizers_was_list:
        return (models if models_was_list else models[0]), optimizers
    if models_was_list:
        return models if len(optimizers) == 0 else (models, optimizers[0])
    return models[0] if len(optimizers) == 0 else (models[0], optimizers[0])


def _grads(optimizers):
    return [p.grad for opt in optimizers for group in opt.param_groups for p in group["params"] if p.grad is not None]


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False):
    """Yield the scaled loss; unscale and check the gradients on exit (see the module docstring)."""
    if not hasattr(_amp_state, "opt_properties"):
        raise RuntimeError("Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
                           "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
                           "before `with amp.scale_loss`.")
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    if isinstance(optimizers, torch.optim.Optimizer) or type(optimizers).__name__ == "LARC":
        optimizers = [optimizers]
    loss_scaler = _amp_state.loss_scalers[loss_id]
    loss_scale = loss_scaler.loss_scale()
    if not _amp_state.opt_properties.master_weights and not loss_scaler.dynamic and loss_scale == 1.0:
        yield loss.float()
        return
    yield loss.float() * loss_scale
    if delay_unscale:
        for optimizer in optimizers:
            _stash(optimizer).params_have_scaled_gradients = True
        return
    loss_scaler.clear_overflow_state()
    loss_scaler.unscale(_grads(optimizers))
    for optimizer in optimizers:
        _stash(optimizer).params_have_scaled_gradients = False
    should_skip = False if delay_overflow_check else loss_scaler.update_scale()
    if should_skip:
        for optimizer in optimizers:
            _skip_next_step(optimizer, loss_scaler, loss_id)


def _stash(optimizer):
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is None:
        stash = optimizer._amp_stash = types.SimpleNamespace(params_have_scaled_gradients=False, already_patched=False)
    return stash


def _skip_next_step(optimizer, loss_scaler, loss_id):
    stash = _stash(optimizer)
    if stash.already_patched:
        return
    opt_step = optimizer.step

    def skip_step(closure=None):
        if closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        maybe_print(f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
                    f"{loss_scaler.loss_scale()}")
        optimizer.step = opt_step
        stash.already_patched = False

    optimizer.step = skip_step
    stash.already_patched = True
    _common.emit("amp_skipped_step", loss_id=loss_id, loss_scale=loss_scaler.loss_scale(), standin=True)


@contextlib.contextmanager
def disable_casts():
    with torch.autocast("cuda" if torch.cuda.is_available() else "cpu", enabled=False):
        yield


def master_params(optimizer):
    """The parameters `optimizer` updates (apex's fp32 master weights; here the model's own fp32 weights)."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination=None):
    if destination is None:
        destination = OrderedDict()
    for idx, loss_scaler in enumerate(_amp_state.loss_scalers):
        destination[f"loss_scaler{idx}"] = {"loss_scale": loss_scaler.loss_scale(),
                                              "unskipped": loss_scaler._unskipped}
    return destination


def load_state_dict(state_dict):
    if len(state_dict) != len(_amp_state.loss_scalers):
        print(f"Warning: state_dict contains {len(state_dict)} entries, while {len(_amp_state.loss_scalers)} "
              "loss_scalers are used")
    for idx, (key, value) in enumerate(state_dict.items()):
        if "loss_scaler" not in key:
            raise RuntimeError(f"Error(s) in loading state_dict. Unexpected key(s) in state_dict: {key}")
        if idx > len(_amp_state.loss_scalers) - 1:
            print(f"Skipping loss_scaler[{idx}], since num_losses was set to {len(_amp_state.loss_scalers)}")
            break
        _amp_state.loss_scalers[idx]._loss_scale = value["loss_scale"]
        _amp_state.loss_scalers[idx]._unskipped = value["unskipped"]


def _identity_decorator(fn):
    return fn


half_function = float_function = promote_function = _identity_decorator


def register_half_function(module, name):
    """Accepted; autocast's own lists decide the casts."""


register_float_function = register_promote_function = register_half_function


def init(enabled=True, loss_scale="dynamic", enable_caching=True, verbose=False, allow_banned=False):
    """apex's deprecated `amp.init()` API is not reproduced."""
    raise NotImplementedError("apex.amp.init (the old handle API) is not reproduced by ddpdoctor's apex stand-in; "
                              "use amp.initialize")
