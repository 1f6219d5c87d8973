"""What the stand-ins share: telling the probe that a stand-in is in use and what the user's code did with it,
where the user's call came from, whether the caller kept a returned value, and the probe's CUDA emulation.

Everything here works outside a probe run too (no probe: nothing is recorded), so the stand-ins can be imported and
tested on their own.
"""

from __future__ import annotations

import contextlib
import dis
import sys
from collections.abc import Iterator
from typing import Any

from ddpdoctor.probe import session

_ANNOUNCED: set[str] = set()
_NEXT_OPS: dict[tuple[Any, int], str | None] = {}


def probe() -> session.Probe | None:
    return session.current()


def emit(kind: str, **fields: Any) -> None:
    p = session.current()
    if p is not None and not p.ending:
        p.safely(f"stand-in {kind}", p.emit, kind, **fields)


def announce(package: str, imported_as: str, differences: list[str]) -> None:
    """Once per process: the stand-in for `package` is in use (it says why, and how it differs)."""
    if package in _ANNOUNCED:
        return
    _ANNOUNCED.add(package)
    from ddpdoctor.probe.standins import why_standing_in

    emit(
        "standin",
        package=package,
        imported_as=imported_as,
        reason=why_standing_in(package),
        implementation=f"ddpdoctor.probe.standins.{package}",
        differences=differences,
        site=user_frame_site(),
    )


def _user_frame() -> Any:
    """The innermost frame of user code on the stack (the probe's and the stand-ins' frames are never user code)."""
    f = sys._getframe(1)
    while f is not None and not session.is_user_file(f.f_code.co_filename):
        f = f.f_back
    return f


def user_frame_site() -> dict[str, Any] | None:
    f = _user_frame()
    if f is None:
        return None
    return {"file": f.f_code.co_filename, "line": f.f_lineno, "function": f.f_code.co_name}


def _next_op(code: Any, lasti: int) -> str | None:
    key = (code, lasti)
    if key not in _NEXT_OPS:
        following = None
        for ins in dis.get_instructions(code):
            if ins.offset > lasti:
                following = ins.opname
                break
        _NEXT_OPS[key] = following
    return _NEXT_OPS[key]


def result_discarded() -> bool | None:
    """Does the innermost user frame throw away the value of the call it is making (an expression statement
    `hvd.allreduce(t)`)? Read from its bytecode: the instruction after the call pops the result. None when it
    cannot tell (no user frame)."""
    f = _user_frame()
    if f is None:
        return None
    try:
        return _next_op(f.f_code, f.f_lasti) == "POP_TOP"
    except Exception:
        return None


def emulation_active() -> bool:
    try:
        from ddpdoctor.probe import emulation
    except Exception:
        return False
    return bool(emulation.emulation_active())


def on_gpu(tensor: Any) -> bool:
    """Is `tensor` on a GPU as the script sees it: a CUDA tensor, or any tensor while CUDA is emulated on CPU
    (every tensor a CUDA script computes with lives on the CPU there)."""
    return bool(getattr(tensor, "is_cuda", False)) or emulation_active()


@contextlib.contextmanager
def not_a_training_step() -> Iterator[None]:
    """Optimizer steps taken inside are the library's own (Horovod initialising optimizer state with a
    zero-gradient step): the probe does not count them as the script's training steps."""
    p = session.current()
    if p is None:
        yield
        return
    p.quiet_steps += 1
    try:
        yield
    finally:
        p.quiet_steps -= 1


def optimizer_id(optimizer: Any) -> int | None:
    p = session.current()
    if p is None:
        return None
    return p.registry.id_of(optimizer)


# --------------------------------------------------------------------------------------------- wrappers, conversions


def record_wrapper(wrapper: Any, site: dict[str, Any] | None, options: dict[str, Any]) -> None:
    """A data-parallel wrapper was built (apex's DistributedDataParallel): recorded and registered like DDP."""
    p = session.current()
    if p is None:
        return
    from ddpdoctor.probe.recorders import ddp

    p.safely("stand-in wrapper", ddp.record_wrapper, p, wrapper, site, {**options, "standin": True})


@contextlib.contextmanager
def wrapper_forward(wrapper: Any) -> Iterator[None]:
    p = session.current()
    if p is None:
        yield
        return
    from ddpdoctor.probe.recorders import ddp

    with ddp.wrapper_forward(p, wrapper):
        yield


def record_conversion(before: Any, result: Any, pairs: list[tuple[Any, Any]], site: dict[str, Any] | None,
                      converter: str) -> None:
    """A BatchNorm → SyncBatchNorm conversion by a converter other than torch's (apex's convert_syncbn_model):
    `pairs` are the (old, new) layers."""
    p = session.current()
    if p is None:
        return
    from ddpdoctor.probe.recorders import sync_bn

    p.safely("stand-in conversion", sync_bn.record_conversion, p, before, result, pairs, site, converter)
