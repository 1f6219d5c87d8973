"""`hvd.DistributedOptimizer` (horovod/torch/optimizer.py), on torch.distributed.

Kept from Horovod 0.28:
- `DistributedOptimizer(optimizer, ...)` returns a NEW optimizer of a class created on the fly that derives from the
  wrapped optimizer's class, built from its `param_groups` (the wrapped optimizer's state is not carried over);
- gradients are averaged across ranks (op=Average; Sum, Min, Max, Product as asked; `gradient_predivide_factor`
  splits the division before and after the sum; `compression=hvd.Compression.fp16` reduces in float16);
- with `backward_passes_per_step=k` gradients accumulate locally for k backward passes (summed, not averaged
  over the passes) and are averaged across ranks once, at `step()` / `synchronize()`;
- every parameter an optimizer updates takes part in every reduction: one that got no gradient on this rank gets
  a zero gradient, so momentum and weight decay still move it;
- the misuse Horovod refuses raises the same errors: names that are not (name, tensor) pairs, duplicate names,
  parameters not named; more backward passes than `backward_passes_per_step` before `step()`;
  `zero_grad()` between `backward()` and `step()`; a warning for `step()` after `synchronize()` without
  `skip_synchronize()`.

Difference (also in the README): Horovod starts each gradient's allreduce in the background as soon as the
gradient is ready; the stand-in reduces all of them in `synchronize()` (called by `step()`), in parameter order
and in one flat buffer per dtype and device. The values are the same; only the overlap with the backward pass is
lost. `groups=` is accepted and checked but only changes Horovod's fusion, so it changes nothing here; Adasum
raises NotImplementedError.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ddpdoctor.probe.standins import _common

from .compression import Compression
from .mpi_ops import _DIST_OPS, Adasum, Average, Sum, _scale, global_process_set, size

_PENDING = object()  # stands for the in-flight allreduce handle Horovod keeps once a gradient is ready


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1, op=Average,
                 gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set):
        super(self.__class__, self).__init__(params)
        self._compression = compression

        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, param_group in enumerate(self.param_groups)
                                for j, v in enumerate(param_group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                             "model.named_parameters().")

        dups = _DistributedOptimizer.find_duplicates([k for k, _ in named_parameters])
        if len(dups) > 0:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")

        all_param_ids = {id(v) for param_group in self.param_groups for v in param_group["params"]}
        named_param_ids = {id(v) for k, v in named_parameters}
        unnamed_param_ids = all_param_ids - named_param_ids
        if len(unnamed_param_ids):
            raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                             f"Python object ids: {', '.join(str(i) for i in unnamed_param_ids)}")

        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: self.backward_passes_per_step for _, v in named_parameters}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        self._handles = {}
        self._grad_accs = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True

        if groups is not None:
            if not (isinstance(groups, list) or groups > 0):
                raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
            if isinstance(groups, list):
                grouped_parameter_ids = set()
                for group in groups:
                    for p in group:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in grouped_parameter_ids:
                            raise ValueError("A parameter can only appear once in groups.")
                        grouped_parameter_ids.add(id(p))
        self._groups = groups

        if self.process_set.included() and (size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._register_hooks()

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    @staticmethod
    def find_duplicates(lst):
        seen = set()
        dups = set()
        for el in lst:
            if el in seen:
                dups.add(el)
            seen.add(el)
        return dups

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def _register_hooks(self):
        for param_group in self.param_groups:
            for p in param_group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    self._grad_accs.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p):
        def hook(*ignore):
            if p in self._handles and self._handles[p][0] is not None and self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")
            assert not p.grad.requires_grad
            assert self._allreduce_delay[p] > 0
            handle = None
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                handle = _PENDING
            self._handles[p] = (handle, None)

        return hook

    def _ordered_params(self):
        """The parameters to reduce, in param-group order: the same order on every rank."""
        seen = set()
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p in self._requires_update and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def synchronize(self):
        if not self.process_set.included():
            self._synchronized = True
            return
        if self.op == Adasum:
            raise NotImplementedError("ddpdoctor's Horovod stand-in does not implement the Adasum reduction")
        params = self._ordered_params()
        dense, sparse = [], []
        for p in params:
            if p.grad is None:
                # no gradient on this rank (an unused branch): another rank may have one, so a zero gradient
                # takes part in the reduction, as in Horovod
                p.grad = p.data.new(p.size()).zero_()
            if p.grad.is_sparse and not self.sparse_as_dense:
                sparse.append(p)
            else:
                dense.append(p)
        self._reduce_dense(dense)
        for p in sparse:
            self._reduce_sparse(p)
        for p in params:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        self._synchronized = True

    def _factors(self) -> tuple[float, float]:
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor / (self.process_set.size() or 1)
        return 1.0, 1.0

    def _reduce_dense(self, params):
        prescale, postscale = self._factors()
        buckets = {}
        for p in params:
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
            compressed, ctx = self._compression.compress(grad)
            buckets.setdefault((compressed.device, compressed.dtype), []).append((p, compressed, ctx))
        for entries in buckets.values():
            with torch.no_grad():
                flat = torch.cat([c.reshape(-1) for _, c, _ in entries])
                _scale(flat, prescale)
                dist.all_reduce(flat, op=getattr(dist.ReduceOp, _DIST_OPS[self.op]), group=self.process_set.group)
                _scale(flat, postscale)
                offset = 0
                for p, compressed, ctx in entries:
                    n = compressed.numel()
                    reduced = self._compression.decompress(flat[offset:offset + n].view_as(compressed), ctx)
                    offset += n
                    if p.grad.is_sparse:
                        p.grad = reduced.to_sparse()
                    else:
                        p.grad.copy_(reduced)

    def _reduce_sparse(self, p):
        dense = p.grad.to_dense().contiguous()
        prescale, postscale = self._factors()
        with torch.no_grad():
            _scale(dense, prescale)
            dist.all_reduce(dense, op=getattr(dist.ReduceOp, _DIST_OPS[self.op]), group=self.process_set.group)
            _scale(dense, postscale)
            p.grad.zero_().add_(dense.to_sparse())

    @contextmanager
    def skip_synchronize(self):
        """optimizer.step() does not synchronize inside (after an explicit optimizer.synchronize())."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad()


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """An optimizer that averages gradients across all ranks before applying them (see the module docstring)."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum and size() > 1:
        raise NotImplementedError("ddpdoctor's Horovod stand-in does not implement the Adasum reduction")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, groups, sparse_as_dense, process_set)
    _common.emit(
        "grad_averaging",
        wrapper="horovod.torch.DistributedOptimizer",
        opt=_common.optimizer_id(wrapped),
        wrapped_opt=_common.optimizer_id(optimizer),
        site=_common.user_frame_site(),
        backward_passes_per_step=backward_passes_per_step,
        op={Average: "Average", Sum: "Sum"}.get(op, str(op)),
        compression=getattr(compression, "__name__", str(compression)),
        gradient_predivide_factor=gradient_predivide_factor,
        params=sum(len(g["params"]) for g in wrapped.param_groups),
        world_size=size(),
        standin=True,
    )
    return wrapped
