"""Which live objects the recorders have seen: DDP wrappers and what they own, optimizers, loaders, samplers.

Shared by the recorders (one direction: recorders write here, others read). Keyed by `id()` and validated with a
weak reference, because tensors cannot be dictionary keys by value and a recycled id must not alias.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class DDPRecord:
    pid: int  # probe id, stable within the process
    ddp_ref: Any  # weakref to the DistributedDataParallel
    module_ref: Any  # weakref to ddp.module
    registered_params: set[int] = field(default_factory=set)  # ids DDP registered for gradient reduction
    mixed_precision: bool = False
    checked: bool = False  # model_check emitted

    @property
    def ddp(self) -> Any:
        return self.ddp_ref()

    @property
    def module(self) -> Any:
        return self.module_ref()


class TrackedObjects:
    """The DDP models, the modules they own and the optimizers this process built, each with its probe id."""

    def __init__(self) -> None:
        self._next = 0
        self.ddps: list[DDPRecord] = []
        # id(module) -> (weakref(module), ddp pid, qualified name inside the DDP module)
        self.owned_modules: dict[int, tuple[Any, int, str]] = {}
        # optimizers: id -> (weakref, probe id)
        self.optimizers: dict[int, tuple[Any, int]] = {}
        self._ids: dict[int, tuple[Any, int]] = {}

    def new_id(self) -> int:
        self._next += 1
        return self._next

    def id_of(self, obj: Any) -> int:
        """A small probe id for any weak-referenceable object (loaders, samplers, optimizers)."""
        entry = self._ids.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        pid = self.new_id()
        try:
            ref = weakref.ref(obj)
        except TypeError:
            ref = (lambda o: (lambda: o))(obj)
        self._ids[id(obj)] = (ref, pid)
        return pid

    def add_ddp(self, ddp: Any, registered_params: set[int], mixed_precision: bool) -> DDPRecord:
        rec = DDPRecord(
            pid=self.id_of(ddp),
            ddp_ref=weakref.ref(ddp),
            module_ref=weakref.ref(ddp.module),
            registered_params=registered_params,
            mixed_precision=mixed_precision,
        )
        self.ddps.append(rec)
        for name, m in ddp.module.named_modules():
            self.owned_modules[id(m)] = (weakref.ref(m), rec.pid, name)
        return rec

    def own(self, module: Any, ddp_pid: int, prefix: str) -> None:
        for name, m in module.named_modules(prefix=prefix):
            self.owned_modules[id(m)] = (weakref.ref(m), ddp_pid, name)

    def owner_of(self, module: Any) -> tuple[int, str] | None:
        entry = self.owned_modules.get(id(module))
        if entry is None or entry[0]() is not module:
            return None
        return entry[1], entry[2]

    def live_ddps(self) -> Iterator[DDPRecord]:
        for rec in self.ddps:
            if rec.ddp is not None and rec.module is not None:
                yield rec

    def ddp_owning_params(self, params: Any) -> int | None:
        ids = {id(p) for p in params}
        if not ids:
            return None
        for rec in self.live_ddps():
            mine = {id(p) for p in rec.module.parameters()}
            if ids & mine:
                return rec.pid
        return None

    def all_models_in_eval(self) -> bool:
        """True when every live DDP module is in eval mode (an evaluation loop), False when none are known."""
        mods = [rec.module for rec in self.live_ddps()]
        return bool(mods) and not any(m.training for m in mods)
