"""What a `ddpdoctor triage` arm changes about BatchNorm in the user's unmodified script, and the two contexts the
in-process checks run in (per-rank statistics, no collectives).

Arms (ProbeSettings.bn_mode / bn_convert, set by the launcher; `check` runs with none of them):

- "" (arm A of a SyncBN script, arm P of a plain-BN script): the script as written.
- "local" (arm L): `nn.SyncBatchNorm` layers normalise with each rank's own batch statistics (`_BatchNorm.forward`,
  which never communicates) — the same modules, classes and attributes as A, only the statistics differ. Covers
  torch's SyncBatchNorm and its subclasses that call its forward (timm's SyncBatchNormAct does); an implementation
  with its own communicating forward runs as written.
- "plain" (arm P of a SyncBN script): the conversion undone. `convert_sync_batchnorm` returns the module unchanged;
  any converter (timm, mmengine/mmcv, apex-style, the script's own) that registers a SyncBN-like module where a
  plain BatchNorm is gets the plain one kept (a module-registration hook returns the registered child unchanged),
  so the original layers, their flags and their parameters stay; an `nn.SyncBatchNorm(...)` the script builds
  directly is registered as an `nn.BatchNorm2d` holding the same parameters and buffers (re-classed to
  BatchNorm1d/3d at its first forward by the input's dimension).
- "group" (arm G): SyncBN over subgroups of `bn_group_size` consecutive ranks, created right after
  init_process_group; layers without an explicit process group use the rank's subgroup.
- bn_convert=1 (arms A, L, G of a plain-BN script, the mirror question): the model is converted with
  `convert_sync_batchnorm` when DDP wraps it.

Patches are installed in two parts: `install_early` right after the CUDA emulation and before the recorders (so
the recorders see the script's calls as it made them and the results the arm returned; the collective guard is
innermost, so a recorder still sees the user's frame as the caller of a collective), `install_late` after the
recorders (outermost: the mirror conversion happens before the DDP recorder describes the model).

`local_stats()` and `no_collectives()` are the contexts of the in-process checks (conversion equivalence,
population statistics): SyncBN layers normalise locally and any collective raises `CollectiveInCheck` instead of
leaving the peers waiting. Both are thread-local and never active while the user's code runs.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ddpdoctor.probe.session import Probe

_TLS = threading.local()

GUARDED_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "barrier", "all_to_all",
    "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
)
SWITCH_EVENTS = 8  # arm_switch events per kind of switch


class CollectiveInCheck(RuntimeError):
    """A collective was called inside one of ddpdoctor's in-process checks (the peers are not there)."""


@contextlib.contextmanager
def local_stats() -> Iterator[None]:
    """SyncBatchNorm layers normalise with this rank's own statistics (no communication) inside the block."""
    depth = getattr(_TLS, "local", 0)
    _TLS.local = depth + 1
    try:
        yield
    finally:
        _TLS.local = depth


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """Any torch.distributed collective raises CollectiveInCheck inside the block."""
    depth = getattr(_TLS, "guard", 0)
    _TLS.guard = depth + 1
    try:
        yield
    finally:
        _TLS.guard = depth


def local_stats_active() -> bool:
    return getattr(_TLS, "local", 0) > 0


def sync_like(module: Any) -> bool:
    """A BatchNorm that synchronises statistics across ranks: torch's SyncBatchNorm and subclasses, or another
    implementation that says so in its class name (apex's SyncBatchNorm, NaiveSyncBatchNorm, a script's own)."""
    from torch.nn import SyncBatchNorm
    from torch.nn.modules.batchnorm import _BatchNorm

    if isinstance(module, SyncBatchNorm):
        return True
    if not isinstance(module, _BatchNorm):
        return False
    return any("sync" in c.__name__.lower() for c in type(module).__mro__)


def process_group_memo(*modules: Any) -> dict[int, Any]:
    """A deepcopy memo that shares every process group the modules hold (a ProcessGroup cannot be copied)."""
    memo: dict[int, Any] = {}
    for root in modules:
        if root is None or not hasattr(root, "modules"):
            continue
        for m in root.modules():
            pg = m.__dict__.get("process_group")
            if pg is not None:
                memo[id(pg)] = pg
    return memo


class _ArmState:
    def __init__(self, probe: Probe) -> None:
        s = probe.settings
        self.mode = s.bn_mode
        self.convert = bool(s.bn_convert)
        self.group_size = int(s.bn_group_size or 0)
        self.group: Any = None
        self.group_ranks: list[int] | None = None
        self.switches: dict[str, int] = {}

    def note(self, probe: Probe, what: str, **fields: Any) -> None:
        n = self.switches.get(what, 0) + 1
        self.switches[what] = n
        if n <= SWITCH_EVENTS:
            probe.emit("arm_switch", what=what, arm=probe.settings.arm, count=n, site=probe.site(), **fields)


# ------------------------------------------------------------------------------------------------ seeds


def _rank_for_seed(probe: Probe) -> int | None:
    """This process's rank as its launcher gave it (RANK, LOCAL_RANK), or None where the environment does not say:
    the children of a self-spawning script (torch.multiprocessing.spawn) inherit their parent's environment, and
    learn their rank only when the process group gives it (`seed_for_rank`)."""
    if probe.role not in ("rank", "attached", "single"):
        return None
    for key in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def _seed_all(probe: Probe, value: int) -> None:
    random.seed(value)
    from ddpdoctor.probe.importhook import when_imported

    def seed_numpy() -> None:
        np = sys.modules.get("numpy")
        if np is not None:
            probe.safely("seed numpy", np.random.seed, value % (2**32))

    when_imported("numpy", seed_numpy)


def seed_process(probe: Probe) -> None:
    """Seed Python's and numpy's generators (seed + rank) before the script runs: an unseeded script then draws
    the same numbers in every arm. The script's own seeding overrides it, as it would any seed. A process whose rank
    is not known yet is seeded as rank 0 and again by `seed_for_rank` once the process group gives its rank."""
    seed = probe.settings.seed
    if seed < 0:
        return
    _seed_all(probe, seed + (_rank_for_seed(probe) or 0))


def seed_torch(probe: Probe) -> None:
    seed = probe.settings.seed
    if seed < 0:
        return
    import torch

    torch.manual_seed(seed + (_rank_for_seed(probe) or 0))


def seed_for_rank(probe: Probe, rank: int) -> None:
    """The process group gave this process its rank: a process whose rank its environment did not say (a spawned
    child) is seeded seed + rank now — unless the script seeded a generator itself since it started, which then
    stands as written (identical streams the script chose are its own, DD304). Without this every spawned child
    drew from seed + 0: identical random streams on every rank that triage itself had made (a false DD304)."""
    seed = probe.settings.seed
    if seed < 0 or _rank_for_seed(probe) is not None or probe.user_seeded:
        return
    import torch

    _seed_all(probe, seed + rank)
    torch.manual_seed(seed + rank)
    probe.emit("arm_switch", what="seed", arm=probe.settings.arm, count=1, site=None, seed=seed + rank)


# ------------------------------------------------------------------------------------------------ install


def install_early(probe: Probe) -> None:
    """The SyncBN forward switch (always: the checks' local_stats needs it) and the arm's own switches."""
    import torch
    from torch.nn import SyncBatchNorm
    from torch.nn.modules import module as module_mod
    from torch.nn.modules.batchnorm import _BatchNorm

    state = _ArmState(probe)
    probe.arm_state = state  # type: ignore[attr-defined]
    if state.mode or state.convert:
        probe.emit("arm", arm=probe.settings.arm, bn_mode=state.mode, bn_convert=state.convert,
                   group_size=state.group_size, seed=probe.settings.seed)

    def make_forward(orig):
        def forward(self: Any, input: Any) -> Any:
            if local_stats_active() or state.mode == "local":
                return _BatchNorm.forward(self, input)
            return orig(self, input)

        return forward

    probe.patcher.wrap(SyncBatchNorm, "forward", make_forward)
    _install_guard(probe)

    if state.mode == "plain":
        _install_plain(probe, state, torch, SyncBatchNorm, module_mod, _BatchNorm)
    if state.mode == "group" and state.group_size > 0:
        _install_groups(probe, state)

        def scope(module: Any, args: Any) -> None:
            # before the recorders' hooks, which read the layer's process group at its first forward
            if state.group is not None and isinstance(module, SyncBatchNorm) and module.process_group is None:
                module.process_group = state.group

        handle = module_mod.register_module_forward_pre_hook(scope)
        probe.patcher.add_undo(handle.remove)


def install_late(probe: Probe) -> None:
    """Outermost patches: the mirror arms' conversion when DDP wraps the model (before the DDP recorder describes
    the model it wraps)."""
    state = getattr(probe, "arm_state", None) or _ArmState(probe)
    if state.convert:
        _install_mirror_conversion(probe, state)


def _install_guard(probe: Probe) -> None:
    """The collective guard, innermost: the recorders' wrappers around it still see the user's frame as their
    caller (they record a collective only when called from user code), and skip ddpdoctor's own checks
    (`probe.quiet`)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    c10d = dist.distributed_c10d
    for name in GUARDED_COLLECTIVES:
        for owner in (dist, c10d):
            if getattr(owner, name, None) is not None:
                probe.patcher.wrap(owner, name, _guarded)


def _guarded(orig):
    def collective(*args: Any, **kwargs: Any) -> Any:
        if getattr(_TLS, "guard", 0):
            raise CollectiveInCheck(f"{getattr(orig, '__name__', 'collective')} inside a ddpdoctor check")
        return orig(*args, **kwargs)

    return collective


def _install_plain(probe: Probe, state: _ArmState, torch: Any, SyncBatchNorm: type, module_mod: Any,
                   _BatchNorm: type) -> None:
    def make_convert(orig):
        def convert_sync_batchnorm(cls: Any, module: Any, process_group: Any = None, *args: Any, **kwargs: Any) -> Any:
            layers = 0
            if hasattr(module, "modules"):
                layers = sum(1 for m in module.modules() if isinstance(m, _BatchNorm) and not sync_like(m))
            state.note(probe, "conversion undone", converter="torch.nn.SyncBatchNorm.convert_sync_batchnorm",
                       layers=layers)
            return module

        return convert_sync_batchnorm

    probe.patcher.wrap(SyncBatchNorm, "convert_sync_batchnorm", make_convert)

    def keep_plain(parent: Any, name: str, submodule: Any) -> Any:
        if submodule is None or not sync_like(submodule):
            return None
        current = parent.__dict__.get("_modules", {}).get(name)
        if current is submodule:
            return None
        if current is not None and isinstance(current, _BatchNorm) and not sync_like(current):
            probe.safely("arm plain", state.note, probe, "conversion undone", converter=type(submodule).__name__,
                         layer=name, kept=type(current).__name__)
            return current
        if type(submodule) is SyncBatchNorm:  # built directly by the script: plain BatchNorm in its place
            plain = probe.safely("arm plain", _as_plain, submodule, torch)
            if plain is not None:
                probe.safely("arm plain", state.note, probe, "built as BatchNorm", layer=name,
                             num_features=int(submodule.num_features))
                return plain
        return None

    handle = module_mod.register_module_module_registration_hook(keep_plain)
    probe.patcher.add_undo(handle.remove)

    by_dim = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}

    def fix_class(module: Any, args: Any) -> None:
        if not module.__dict__.get("_ddpdoctor_any_dim"):
            return
        del module.__dict__["_ddpdoctor_any_dim"]
        x = args[0] if args else None
        cls = by_dim.get(getattr(x, "dim", lambda: 4)())
        if cls is not None and type(module) is not cls:
            module.__class__ = cls
        return

    handle = module_mod.register_module_forward_pre_hook(fix_class)
    probe.patcher.add_undo(handle.remove)


def _as_plain(sync: Any, torch: Any) -> Any:
    """A BatchNorm2d holding the SyncBatchNorm's own parameters, buffers and mode (re-classed to 1d/3d by the
    input's dimension at its first forward)."""
    plain = torch.nn.BatchNorm2d.__new__(torch.nn.BatchNorm2d)
    plain.__dict__.update({k: v for k, v in sync.__dict__.items() if k != "process_group"})
    plain.__dict__["_ddpdoctor_any_dim"] = True
    return plain


def _install_groups(probe: Probe, state: _ArmState) -> None:
    import torch.distributed as dist

    c10d = dist.distributed_c10d

    def make_init(orig):
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = orig(*args, **kwargs)
            probe.safely("arm subgroups", _make_groups, probe, state, dist)
            return result

        return init_process_group

    from ddpdoctor.probe.patching import wrap_everywhere

    wrap_everywhere(probe, (c10d, dist), "init_process_group", make_init)


def _make_groups(probe: Probe, state: _ArmState, dist: Any) -> None:
    if state.group is not None:
        return
    world, rank, g = dist.get_world_size(), dist.get_rank(), state.group_size
    groups = [list(range(start, min(start + g, world))) for start in range(0, world, g)]
    for ranks in groups:  # every rank creates every group, in the same order
        pg = dist.new_group(ranks)
        if rank in ranks:
            state.group, state.group_ranks = pg, ranks
    state.note(probe, "subgroups", groups=groups, group_size=g)


def _install_mirror_conversion(probe: Probe, state: _ArmState) -> None:
    from torch.nn import SyncBatchNorm
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.parallel import DistributedDataParallel as DDP

    def make_init(orig):
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            module = args[0] if args else kwargs.get("module")
            if module is not None and hasattr(module, "modules") and not isinstance(module, _BatchNorm):
                plain = [m for m in module.modules() if isinstance(m, _BatchNorm) and not sync_like(m)]
                if plain:
                    SyncBatchNorm.convert_sync_batchnorm(module)
                    state.note(probe, "converted to SyncBatchNorm", layers=len(plain))
            orig(self, *args, **kwargs)

        return __init__

    probe.patcher.wrap(DDP, "__init__", make_init)
