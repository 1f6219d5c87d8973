"""Checkpoint recorder: every `torch.save` (where it wrote, from which rank and node, what the saved object holds),
every `torch.load` of a file (and whether it is a file the user had before the probe: a resume), and every
`Module.load_state_dict` (strict or not, and the keys it skipped).

In launcher modes the script's writes are redirected under the run directory (ddpdoctor.probe.fsview): torch.save
and torch.load open paths in C++, so their path arguments are mapped here (a save lands in RUN/writes/<path>, a
load of that path reads it back). The events keep the path as the script gave it: what DD502 needs (every rank
writing the same file) is about the script's intent, not where the probe put the bytes.

What DD501 needs is cheap to read from the object before it is pickled: state dicts are mappings whose keys are
dotted strings, so we look at the keys of the object and of its values one level down (`{"model": sd, ...}`),
never at tensor contents.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ddpdoctor.probe import fsview
from ddpdoctor.probe.patching import wrap_everywhere
from ddpdoctor.probe.session import Probe

NAME = "checkpoint"
KEYS_SHOWN = 12  # key names kept per event; the counts are always complete
PREFIX = "module."
MAX_KEYS = 200_000  # a bigger mapping is data, not a model's state dict: not inspected
LOADS_RECORDED = 20  # torch.load events per process


def _path_of(f: Any) -> tuple[str | None, str | None]:
    """(path as the script gave it, absolute path) of a save target: a path, or a file object with a name."""
    if isinstance(f, (str, bytes, os.PathLike)):
        raw = os.fsdecode(f)
        return raw, os.path.abspath(raw)
    name = getattr(f, "name", None)
    if isinstance(name, str) and name and not name.startswith("<"):
        return name, os.path.abspath(name)
    return None, None


def _is_state_dict(obj: Any) -> bool:
    """A mapping whose keys are all strings and most values tensors: what `Module.state_dict()` returns."""
    import torch

    if not isinstance(obj, dict) or not obj or len(obj) > MAX_KEYS:
        return False
    if not all(isinstance(k, str) for k in obj):
        return False
    tensors = sum(1 for v in obj.values() if torch.is_tensor(v))
    return tensors * 2 >= len(obj)


def state_dicts_in(obj: Any) -> list[dict[str, Any]]:
    """The state dicts in a saved object: the object itself, or its values one level down."""
    found: list[tuple[str, dict]] = []
    if _is_state_dict(obj):
        found.append(("", obj))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if _is_state_dict(value):
                found.append((str(key), value))
    out = []
    for where, sd in found:
        keys = list(sd)
        prefixed = [k for k in keys if k.startswith(PREFIX)]
        out.append({"key": where, "keys": len(keys), "module_prefixed": len(prefixed), "first_keys": keys[:KEYS_SHOWN]})
    return out


def _top_keys(obj: Any) -> list[str] | None:
    if isinstance(obj, dict):
        return [str(k) for k in list(obj)[:KEYS_SHOWN]]
    return None


def install(probe: Probe) -> None:
    import torch
    import torch.serialization
    from torch.nn import Module

    def make_save(orig):
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            target = fsview.map_write(f) if isinstance(f, (str, bytes, os.PathLike)) else f
            if probe.ending:
                with fsview.writing(target):
                    return orig(obj, target, *args, **kwargs)
            before = probe.safely("torch.save before", _before_save, probe, obj, f)
            t0 = time.perf_counter()
            try:
                with fsview.writing(target):
                    result = orig(obj, target, *args, **kwargs)
            except BaseException as exc:
                if before is not None:
                    probe.safely("torch.save", _after_save, probe, before, f, time.perf_counter() - t0,
                                 f"{type(exc).__name__}: {exc}"[:500])
                raise
            if before is not None:
                probe.safely("torch.save", _after_save, probe, before, f, time.perf_counter() - t0, None)
            return result

        return save

    wrap_everywhere(probe, (torch, torch.serialization), "save", make_save)

    loads = {"n": 0}

    def make_torch_load(orig):
        def load(f: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(f, (str, bytes, os.PathLike)):
                return orig(f, *args, **kwargs)
            users = fsview.user_file(f)
            site = probe.site()
            result = orig(fsview.map_read(f), *args, **kwargs)
            if loads["n"] < LOADS_RECORDED and not probe.ending:
                loads["n"] += 1
                probe.safely("torch.load", _file_loaded, probe, f, users, result, site)
            return result

        return load

    wrap_everywhere(probe, (torch, torch.serialization), "load", make_torch_load)

    # TorchScript's save/load open a path in C++, past the run's file view: map it as torch.save's is
    def make_jit_save(orig):
        def save(m: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(f, (str, bytes, os.PathLike)):
                return orig(m, f, *args, **kwargs)
            target = fsview.map_write(f)
            with fsview.writing(target):
                return orig(m, target, *args, **kwargs)

        return save

    def make_jit_load(orig):
        def load(f: Any, *args: Any, **kwargs: Any) -> Any:
            return orig(fsview.map_read(f) if isinstance(f, (str, bytes, os.PathLike)) else f, *args, **kwargs)

        return load

    import torch.jit._serialization

    wrap_everywhere(probe, (torch.jit, torch.jit._serialization), "save", make_jit_save)
    wrap_everywhere(probe, (torch.jit, torch.jit._serialization), "load", make_jit_load)

    depth = {"n": 0}

    def make_load(orig):
        def load_state_dict(self, state_dict: Any, strict: bool = True, *args: Any, **kwargs: Any) -> Any:
            # an override calling super().load_state_dict: the outer call counts
            if depth["n"] or probe.ending or probe.quiet or probe.recording:
                return orig(self, state_dict, strict, *args, **kwargs)
            site = probe.site()
            depth["n"] += 1
            try:
                result = orig(self, state_dict, strict, *args, **kwargs)
            except BaseException as exc:
                probe.safely("load_state_dict", _loaded, probe, self, state_dict, strict, site, None,
                             f"{type(exc).__name__}: {exc}"[:1000])
                raise
            finally:
                depth["n"] -= 1
            probe.safely("load_state_dict", _loaded, probe, self, state_dict, strict, site, result, None)
            return result

        return load_state_dict

    probe.patcher.wrap(Module, "load_state_dict", make_load)


def _before_save(probe: Probe, obj: Any, f: Any) -> dict[str, Any]:
    path, abspath = _path_of(f)
    existed = bool(abspath) and os.path.exists(abspath)
    from ddpdoctor.probe.session import user_callers

    return {
        "site": probe.site(),
        "callers": user_callers(1)[1:],
        "path": path,
        "abspath": abspath,
        "target": type(f).__name__,
        "existed": existed,
        "size_before": os.path.getsize(abspath) if existed and os.path.isfile(abspath) else None,
        "object": type(obj).__name__,
        "top_keys": _top_keys(obj),
        "state_dicts": state_dicts_in(obj),
        "t_start": time.time(),
    }


def _after_save(probe: Probe, before: dict[str, Any], f: Any, seconds: float, error: str | None) -> None:
    abspath = before["abspath"]
    size = os.path.getsize(abspath) if abspath and error is None and os.path.isfile(abspath) else None
    probe.emit(
        "checkpoint_save",
        local_rank=_env_int("LOCAL_RANK"),
        node=_env_int("GROUP_RANK"),
        bytes=size,
        seconds=round(seconds, 4),
        error=error,
        step=probe.steps,
        **before,
    )


def _counters(obj: Any) -> dict[str, int]:
    """Integer values at the top of a loaded checkpoint (epoch, step, iteration...): where a resume starts."""
    if not isinstance(obj, dict):
        return {}
    out = {}
    for key, value in obj.items():
        if isinstance(key, str) and isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
            if len(out) >= KEYS_SHOWN:
                break
    return out


def _file_loaded(probe: Probe, f: Any, users: str | None, obj: Any, site: Any) -> None:
    path, abspath = _path_of(f)
    probe.emit(
        "checkpoint_load",
        site=site,
        path=path,
        abspath=abspath,
        users_file=users is not None,
        object=type(obj).__name__,
        top_keys=_top_keys(obj),
        counters=_counters(obj),
        step=probe.steps,
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.lstrip("-").isdigit() else None


def module_keys(module: Any) -> list[str]:
    """The keys `module.state_dict()` has, read from the module tree without calling `state_dict()` (which a
    wrapper such as FSDP may implement with collectives, and which runs user hooks)."""
    keys = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        keys.extend(head + name for name, p in m._parameters.items() if p is not None)
        skip = getattr(m, "_non_persistent_buffers_set", set())
        keys.extend(head + name for name, b in m._buffers.items() if b is not None and name not in skip)
    return list(dict.fromkeys(keys))


def _loaded(probe: Probe, module: Any, state_dict: Any, strict: Any, site: Any, result: Any, error: str | None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model_keys = module_keys(module)
    given = [str(k) for k in state_dict] if isinstance(state_dict, dict) else []
    missing = list(getattr(result, "missing_keys", []) or [])
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    # Would the keys have matched with the "module." prefix removed or added? (DD501's consequence.)
    model_set = set(model_keys)
    stripped = {k[len(PREFIX):] if k.startswith(PREFIX) else k for k in given}
    prefixed = {PREFIX + k for k in given}
    probe.emit(
        "state_dict_load",
        site=site,
        module_class=type(module).__name__,
        is_ddp=isinstance(module, DDP),
        strict=bool(strict),
        given_keys=len(given),
        model_keys=len(model_keys),
        missing=len(missing),
        unexpected=len(unexpected),
        missing_keys=missing[:KEYS_SHOWN],
        unexpected_keys=unexpected[:KEYS_SHOWN],
        given_prefixed=sum(1 for k in given if k.startswith(PREFIX)),
        model_prefixed=sum(1 for k in model_keys if k.startswith(PREFIX)),
        matched=len(model_set & set(given)),
        match_without_prefix=len(model_set & stripped),
        match_with_prefix=len(model_set & prefixed),
        error=error,
        step=probe.steps,
    )
