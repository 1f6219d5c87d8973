"""Run CUDA-style training scripts unmodified on CPU ranks ("CUDA emulation").

`ddpdoctor check` must run the user's script as written for N GPUs — `torch.cuda.set_device(local_rank)`,
`.cuda()`, `init_process_group("nccl")`, `DDP(model, device_ids=[local_rank])`, SyncBatchNorm, autocast and
GradScaler — on a laptop without GPUs. `install_cuda_emulation(N)` makes this process look like one with N CUDA
devices while every tensor really lives on the CPU and every collective goes over gloo:

- `torch.cuda` (and the device-generic `torch.accelerator`) answer for N emulated devices: availability, count,
  current device per process, names and properties, streams and events (CPU work is synchronous, so every wait
  is immediate and events time with the wall clock), memory statistics (always 0: the CPU allocator keeps none),
  bf16 support, random number generators, NVTX ranges (no-ops).
- A `TorchFunctionMode` maps every CUDA device (`"cuda"`, `"cuda:1"`, `torch.device("cuda", 1)`, a bare int) to
  the CPU in `device=` arguments, `Tensor.to` in all its forms, `Tensor.cuda`, `Tensor.type("torch.cuda.…")`,
  `torch._C._nn._parse_to` (what `Module.to(rank)` uses), and makes `pin_memory` a no-op. The mode is
  thread-local in PyTorch, so every thread started after installation enters it too (DataLoader pin-memory
  threads, prefetchers, thread pools).
- nccl becomes gloo in `init_process_group` / `new_group` (`device_id`, NCCL `pg_options` dropped), and NCCL's
  flat buffers in `all_gather_into_tensor` / `reduce_scatter_tensor` (world × numel in any shape, as Accelerate's
  gather passes them) are viewed in the stacked shape gloo insists on; DDP is built
  without `device_ids` / `output_device`, and its CPU refusal of SyncBatchNorm is skipped; `nn.SyncBatchNorm` on
  CPU input runs `ddpdoctor.bn.syncbn.sync_batch_norm_forward` (exact global-batch statistics over gloo).
- `autocast("cuda", dtype)` (also `torch.cuda.amp.autocast`, `custom_fwd`) becomes CPU autocast, so
  reduced-precision numerics are kept rather than silently dropped (with `is_available()` True, CUDA autocast
  would simply do nothing to CPU tensors). bfloat16 stays bfloat16. float16 becomes bfloat16 by default: CPU
  autocast does support float16 in torch 2.13, but on a CPU without AVX512-FP16/AMX-FP16 its kernels are far
  slower than float32 (measured on an AVX512 CPU: conv2d forward+backward 25x, matmul 17x, a small CNN step
  16x), which would blow the probe's time budget. bfloat16 keeps a reduced mantissa (8 bits, coarser than
  float16's 11) but not float16's range (max 65504): float16 overflows are not reproduced, so GradScaler
  rarely backs off. `install_cuda_emulation(..., float16_autocast="float16")` keeps the exact dtype.
  `GradScaler("cuda")` becomes a CPU GradScaler (same scaling arithmetic).
- `torch.load` restores CUDA-saved storages and `map_location="cuda:N"` / devices / dicts / lambdas calling
  `storage.cuda(N)` onto the CPU, still refusing a device index the (emulated) machine does not have.

Decisions worth knowing:

- Tensors keep reporting `device == cpu`, `is_cuda == False` and `get_device() == -1`. Faking them would lie to
  every torch internal that dispatches on device; scripts that branch on `x.is_cuda` are rare.
  `emulated_device(obj)` says which emulated GPU the script put a tensor or module on.
- `x.cuda()` / `x.to("cuda")` return a copy, as a host-to-device copy does, so in-place updates of the result
  never write back into the source (a slice of an in-memory dataset, say). An `nn.Parameter` is returned as
  itself: on a GPU machine it is normally already on the device, where `.cuda()` is the identity. A device
  read back from a tensor (`x.to(param.device)`) says cpu, so that move is a no-op, not a copy.
- Random numbers: `torch.cuda.manual_seed*`, `seed*`, `initial_seed`, `get/set_rng_state*` and
  `torch.cuda.default_generators` work on one CPU `torch.Generator` per emulated device. They never touch the
  CPU default generator: seeding it from `torch.cuda.manual_seed(rank)` would change what the script computes on
  the CPU side (its data, its augmentation) beyond the device mapping. `torch.manual_seed` seeds them too, as it
  seeds CUDA. `torch.rand*/randperm/normal(..., device="cuda")` draw from them, so CPU and CUDA streams stay
  separate as on a GPU. Random ops on tensors that would live on the GPU (dropout, `x.uniform_()`) draw from the
  CPU generator: a CPU tensor cannot say it was meant for CUDA. A real CUDA generator state (from a GPU
  checkpoint) cannot be restored on an emulated one; `set_rng_state` then keeps the current state and notifies.
- `torch.cuda.set_device` tracks one current device per process (not per thread as CUDA does).
- `nn.DataParallel` does what it does on N GPUs, one replica after the other on the CPU: the batch is split into
  chunks along `dim` (Tensor.chunk, as the CUDA scatter), each chunk runs through a replica, the outputs are
  concatenated. Replica 0 is the module itself, so its BatchNorm layers normalise over its chunk and only its
  running-statistic updates survive; the other replicas share the parameters (gradients add up as on GPUs) and
  run with copies of the buffers that are then dropped. Python attributes a forward sets on the module persist
  from replica 0 (on GPUs, replicas are shallow copies and lose them); DataParallel's check that the module sits on
  device_ids[0] is not made, and the functional `torch.nn.parallel.data_parallel` is not emulated.
- `torch.device(int)` (`torch.device(local_rank)`) raises on a CPU build in C++, before any hook can see it: the
  emulation wraps the constructor (`torch.device` answers calls and isinstance as the real class; an int is
  cuda:N, as on a GPU machine; devices pickle under the name `torch.device`).
- Not emulated: `torch.Generator("cuda")`,
  `torch.cuda.FloatTensor(...)` constructors, CUDA graphs, NVML queries (`utilization`, `temperature`),
  profiling CUDA activities, device meshes and DDP's private mixed precision. `torch.compile` works but
  compiles for the CPU (inductor needs a C++ compiler and seconds to tens of seconds per graph).

`notify(what, detail)` is called at most once per `what`, the first time something was actually emulated:
"cuda_device" (a CUDA device mapped to the CPU), "nccl_to_gloo", "ddp_device_ids", "syncbn_ddp_check",
"sync_batchnorm", "autocast_cuda", "grad_scaler", "map_location", "cuda_rng" (the script seeded CUDA generators
itself), "cuda_rng_state_ignored", "pin_memory", "data_parallel", "flat_collective" (an NCCL-style flat tensor of
an nccl group moved to gloo viewed in gloo's stacked shape), "integer_histc" (`histc` of an integer tensor, which
only CUDA has a kernel for, counted in float64). `detail` holds JSON values only. An exception
raised by `notify` is swallowed: the recorder's problems must never break the user's run.

`undo()` restores every patched attribute in reverse order (`ddpdoctor.probe.patching.Patcher`). Patches installed
later by others (the recorder) must be undone before it.

Size: one module (~1,200 lines) because the emulation is one state (the emulated devices, the current device, the
placement map, the generators) that every patch reads, installed and undone as a whole under one lock; its
sections follow the list above (devices and streams, state, the device-mapping mode, torch.cuda replacements,
distributed and SyncBN, autocast and serialization, tensor methods and threads, the entry point).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from ddpdoctor.errors import EMULATED_ORDINAL
from ddpdoctor.probe.patching import Patcher

__all__ = [
    "EMULATED_DEVICE_NAME",
    "EmulatedDeviceProperties",
    "emulated_device",
    "emulation_active",
    "install_cuda_emulation",
]

Notify = Callable[[str, dict], None]

EMULATED_DEVICE_NAME = "CPU (ddpdoctor emulated CUDA device)"
# Ampere: what a current training machine reports, and the capability at which CUDA supports bfloat16.
_EMULATED_CAPABILITY = (8, 0)
_CPU = torch.device("cpu")
_MISSING = object()  # a sentinel for "no such attribute" (the tests compare snapshots with it)

_STATE: _Emulation | None = None
_INSTALL_LOCK = threading.Lock()


def emulation_active() -> bool:
    """True while CUDA emulation is installed in this process."""
    return _STATE is not None


def emulated_device(obj: Any) -> torch.device | None:
    """The CUDA device the script placed a tensor or module on, as it would be on a GPU machine, or None.

    Emulated tensors report `device == cpu`; this answers "which GPU?" for checks such as "do two ranks share
    one device" (DD105). A module answers for its first parameter (else buffer). Tracked: `.cuda()`,
    `.to(<cuda>)`, factories with `device=<cuda>`, `Module.cuda()` and `Module.to(<cuda>)`; `.cuda()` without
    an index means the current device at that moment, as on CUDA.
    """
    state = _STATE
    if state is None:
        return None
    if isinstance(obj, torch.nn.Module):
        first = next(iter(obj.parameters()), None)
        if first is None:
            first = next(iter(obj.buffers()), None)
        obj = first
    if not isinstance(obj, torch.Tensor):
        return None
    with state.placements_lock:
        index = state.placements.get(obj)
    return None if index is None else torch.device("cuda", index)


# --------------------------------------------------------------------------------------------------------------
# Emulated devices, streams, events


@dataclass(frozen=True)
class EmulatedDeviceProperties:
    """What `torch.cuda.get_device_properties` returns for an emulated device: the host's cores stand in for
    streaming multiprocessors and an equal share of its memory for device memory."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    warp_size: int = 32
    max_threads_per_multi_processor: int = 2048
    regs_per_multiprocessor: int = 65536
    shared_memory_per_block: int = 48 * 1024
    shared_memory_per_block_optin: int = 163 * 1024
    shared_memory_per_multiprocessor: int = 164 * 1024
    L2_cache_size: int = 40 * 1024 * 1024
    gcnArchName: str = "NVIDIA (emulated)"  # noqa: N815 — torch's attribute name (read by inductor's cache key)
    uuid: str = ""
    pci_bus_id: int = 0
    pci_device_id: int = 0
    pci_domain_id: int = 0

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // (1024 * 1024)}MB, "
            f"multi_processor_count={self.multi_processor_count})"
        )


class _EmulatedEvent:
    """`torch.cuda.Event`: CPU work is finished when `record` runs, so timing is the wall clock between records."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, external: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self._recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: _EmulatedEvent) -> float:
        """Milliseconds between the two records, with CUDA's errors for events that cannot be timed."""
        if not (self.enable_timing and getattr(end_event, "enable_timing", False)):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._recorded_at is None or getattr(end_event, "_recorded_at", None) is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._recorded_at - self._recorded_at) * 1000.0

    def __repr__(self) -> str:
        return f"<torch.cuda.Event (emulated on CPU) recorded={self._recorded_at is not None}>"


class _EmulatedStream:
    """`torch.cuda.Stream`: every stream runs in program order on the CPU, so waits and syncs are immediate."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        state = _require_state()
        self._setup(_device_index(state, device), priority, cuda_stream=id(self))

    @classmethod
    def _default_for(cls, index: int) -> _EmulatedStream:
        stream = cls.__new__(cls)
        stream._setup(index, 0, cuda_stream=0)  # CUDA's default (legacy) stream handle is 0
        return stream

    def _setup(self, index: int, priority: int, cuda_stream: int) -> None:
        self.device = torch.device("cuda", index)
        self.priority = priority
        self.cuda_stream = cuda_stream
        self._context: _EmulatedStreamContext | None = None

    @property
    def device_index(self) -> int:
        return self.device.index

    @property
    def device_type(self) -> str:
        return "cuda"

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        if event is None:
            event = _EmulatedEvent()
        event.record(self)
        return event

    def is_capturing(self) -> bool:
        return False

    def __enter__(self) -> _EmulatedStream:
        self._context = _EmulatedStreamContext(self)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
            self._context = None

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream (emulated on CPU) device={self.device} cuda_stream={self.cuda_stream:#x}>"


class _EmulatedStreamContext:
    """`torch.cuda.stream(s)` / `torch.cuda.StreamContext(s)`: makes `s` current on its device for the block."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._previous: Any = None

    def __enter__(self) -> Any:
        state = _STATE
        if self.stream is None or state is None:
            return self.stream
        index = self.stream.device.index
        self._previous = state.current_streams.get(index)
        state.current_streams[index] = self.stream
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        state = _STATE
        if self.stream is None or state is None:
            return
        state.current_streams[self.stream.device.index] = self._previous


class _EmulatedCudaDevice:
    """`torch.cuda.device(i)`: a class and a context manager (torch's own `isinstance` checks rely on both)."""

    def __init__(self, device: Any) -> None:
        state = _require_state()
        self.idx = -1 if device is None or (isinstance(device, int) and device < 0) else _device_index(state, device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        state = _require_state()
        self.prev_idx = state.current_device
        if self.idx >= 0:
            state.current_device = self.idx

    def __exit__(self, *exc: Any) -> bool:
        state = _STATE
        if state is not None and self.idx >= 0:
            state.current_device = self.prev_idx
        return False


class _EmulatedCudaDeviceOf(_EmulatedCudaDevice):
    """`torch.cuda.device_of(obj)`: emulated tensors live on the CPU, so this never changes the device."""

    def __init__(self, obj: Any) -> None:
        super().__init__(-1)


class _EmulatedAcceleratorDeviceIndex:
    """`torch.accelerator.device_index(i)`."""

    def __init__(self, device: Any, /) -> None:
        self._device = _EmulatedCudaDevice(device)

    def __enter__(self) -> None:
        self._device.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._device.__exit__(*exc)


# --------------------------------------------------------------------------------------------------------------
# State and device parsing


class _Emulation:
    def __init__(self, num_devices: int, notify: Notify | None, float16_autocast: torch.dtype) -> None:
        self.num_devices = num_devices
        self.float16_autocast = float16_autocast
        self.current_device = 0
        self.notify_fn = notify
        self.notified: set[str] = set()
        self.notify_lock = threading.Lock()
        self.generators = tuple(torch.Generator() for _ in range(num_devices))
        self.default_streams = [_EmulatedStream._default_for(i) for i in range(num_devices)]
        self.current_streams: dict[int, Any] = {}
        self.mode = _CudaOnCpuMode()
        # Which emulated device the script put each tensor on (weak: entries die with their tensors).
        self.placements = WeakIdKeyDictionary()
        self.placements_lock = threading.Lock()

    def place(self, result: Any, index: int | None) -> Any:
        if index is not None and isinstance(result, torch.Tensor):
            with self.placements_lock:
                self.placements[result] = index
        return result

    def notify(self, what: str, detail: dict) -> None:
        if what in self.notified or self.notify_fn is None:
            return
        with self.notify_lock:
            if what in self.notified:
                return
            self.notified.add(what)
        try:
            self.notify_fn(what, detail)
        except Exception:  # noqa: BLE001 — the recorder's failure must not break the user's run
            pass


def _require_state() -> _Emulation:
    state = _STATE
    if state is None:
        raise RuntimeError("ddpdoctor CUDA emulation is not installed")
    return state


def _invalid_ordinal(state: _Emulation, index: int) -> RuntimeError:
    return RuntimeError(EMULATED_ORDINAL.format(index=index, devices=state.num_devices))


def _cuda_index(state: _Emulation, device: Any) -> int | None:
    """The emulated CUDA device that `device` names, or None when it names no CUDA device (cpu, meta, a bad
    string torch should report itself). A bare int means a CUDA device, as it does on a GPU machine."""
    if isinstance(device, str):
        if not device.startswith("cuda"):
            return None
        try:
            device = torch.device(device)
        except RuntimeError:
            return None
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        index = state.current_device if device.index is None else device.index
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    elif hasattr(device, "__index__") and not isinstance(device, (bool, torch.Tensor)):
        index = device.__index__()
    else:
        return None
    if index < 0:
        return None
    if index >= state.num_devices:
        raise _invalid_ordinal(state, index)
    return index


def _device_index(state: _Emulation, device: Any) -> int:
    """Like torch.cuda's `_get_device_index(device, optional=True)` for emulated devices."""
    if device is None:
        return state.current_device
    if isinstance(device, _EmulatedCudaDevice):
        return device.idx
    if isinstance(device, str) and not device.startswith("cuda"):
        raise ValueError(f"Expected a cuda device, but got: {device}")
    if isinstance(device, torch.device) and device.type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {device}")
    index = _cuda_index(state, device)
    if index is None:
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
    return index


def _jsonable_device(device: Any) -> Any:
    return device if isinstance(device, int) and not isinstance(device, bool) else str(device)


def _note_device(state: _Emulation, device: Any, via: str) -> None:
    if "cuda_device" not in state.notified:
        state.notify("cuda_device", {"device": _jsonable_device(device), "via": via})


# --------------------------------------------------------------------------------------------------------------
# The device-rewriting TorchFunctionMode


_RANDOM_FACTORIES = frozenset({torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal})


def _call_with_device_kwargs(state: _Emulation, func: Any, args: tuple, kwargs: dict) -> Any:
    """A factory function or tensor method called with `device=` (or `pin_memory=`)."""
    device = kwargs.get("device")
    index = None if device is None else _cuda_index(state, device)
    if index is None and not kwargs.get("pin_memory"):
        return func(*args, **kwargs)
    kwargs = dict(kwargs)
    if kwargs.get("pin_memory"):
        state.notify("pin_memory", {"via": getattr(func, "__name__", "factory")})
        kwargs["pin_memory"] = False
    if index is None:
        return func(*args, **kwargs)
    _note_device(state, device, getattr(func, "__name__", "factory"))
    kwargs["device"] = _CPU
    if func in _RANDOM_FACTORIES and kwargs.get("generator") is None:
        kwargs["generator"] = state.generators[index]
    return state.place(func(*args, **kwargs), index)


def _device_argument(state: _Emulation, args: tuple, kwargs: dict, first: int) -> tuple[tuple, dict, Any, int | None]:
    """Find a CUDA device given at `args[first]` (a device, not a dtype or tensor) or as `device=`, and put the
    CPU in its place. Returns the new args and kwargs, the device as written, and its emulated index."""
    if len(args) > first and not isinstance(args[first], (torch.dtype, torch.Tensor)):
        index = _cuda_index(state, args[first])
        if index is not None:
            return args[:first] + (_CPU,) + args[first + 1 :], kwargs, args[first], index
    device = kwargs.get("device")
    if device is not None:
        index = _cuda_index(state, device)
        if index is not None:
            return args, {**kwargs, "device": _CPU}, device, index
    return args, kwargs, None, None


def _handle_tensor_to(state: _Emulation, func: Any, args: tuple, kwargs: dict) -> Any:
    args, kwargs, device, index = _device_argument(state, args, kwargs, 1)
    if index is None:
        return func(*args, **kwargs)
    _note_device(state, device, "Tensor.to")
    # A host-to-device copy is a copy; positional `copy` (5th argument) is left as the script wrote it.
    if not isinstance(args[0], torch.nn.Parameter) and len(args) < 5:
        kwargs = {**kwargs, "copy": True}
    return state.place(func(*args, **kwargs), index)


def _handle_tensor_cuda(state: _Emulation, func: Any, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    device = args[1] if len(args) > 1 else kwargs.get("device")
    index = _device_index(state, device)  # an invalid ordinal raises, as on a GPU machine
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    memory_format = kwargs.get("memory_format", torch.preserve_format)
    _note_device(state, "cuda" if device is None else device, "Tensor.cuda")
    if isinstance(tensor, torch.nn.Parameter) and memory_format is torch.preserve_format:
        return state.place(tensor, index)
    copied = torch.Tensor.to(tensor, _CPU, non_blocking=non_blocking, copy=True, memory_format=memory_format)
    return state.place(copied, index)


def _handle_parse_to(state: _Emulation, func: Any, args: tuple, kwargs: dict) -> Any:
    args, kwargs, device, index = _device_argument(state, args, kwargs, 0)
    if index is not None:
        _note_device(state, device, "Module.to")
    return func(*args, **kwargs)


def _handle_tensor_type(state: _Emulation, func: Any, args: tuple, kwargs: dict) -> Any:
    in_args = len(args) > 1
    target = args[1] if in_args else kwargs.get("dtype")
    if isinstance(target, type):
        target = f"{target.__module__}.{target.__name__}"
    if isinstance(target, str) and target.startswith("torch.cuda."):
        _note_device(state, target, "Tensor.type")
        cpu_type = "torch." + target[len("torch.cuda.") :]
        if in_args:
            args = (args[0], cpu_type, *args[2:])
        else:
            kwargs = {**kwargs, "dtype": cpu_type}
    return func(*args, **kwargs)


def _handle_pin_memory(state: _Emulation, func: Any, args: tuple, kwargs: dict) -> Any:
    state.notify("pin_memory", {"via": "Tensor.pin_memory"})
    return args[0]


def _handle_histc(state: _Emulation, func: Any, args: tuple, kwargs: dict) -> Any:
    """`histc` of an integer tensor: CUDA has the kernel, the CPU only for floating types ("histogram_cpu" not
    implemented for 'Long'), so a GPU script's per-class counts (torch.histc(pred[pred == target], bins=K)) would
    crash only under emulation. Counted in float64 (exact for the integers a histogram of classes holds) and
    returned in the input's dtype, as CUDA returns it; floating inputs pass through."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex():
        return func(*args, **kwargs)
    state.notify("integer_histc", {"dtype": str(x.dtype).removeprefix("torch.")})
    rest = dict(kwargs)
    rest.pop("input", None)
    return torch.histc(x.double(), *args[1:], **rest).to(x.dtype)


_HANDLERS: dict[Any, Callable[[_Emulation, Any, tuple, dict], Any]] = {
    torch.histc: _handle_histc,
    torch.Tensor.histc: _handle_histc,
    torch.Tensor.to: _handle_tensor_to,
    torch.Tensor.cuda: _handle_tensor_cuda,
    torch.Tensor.type: _handle_tensor_type,
    torch.Tensor.pin_memory: _handle_pin_memory,
    torch._C._nn._parse_to: _handle_parse_to,
}


class _CudaOnCpuMode(TorchFunctionMode):
    """Maps CUDA devices to the CPU in every torch call of the threads it is active in.

    Hot path: one dict lookup and, only when keyword arguments are present, a membership test (~1 µs per op:
    docs/facts.md#running-cuda-scripts-on-cpu). After `undo` it passes everything through, so threads still holding
    it behave like plain torch.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        state = _STATE
        if state is not None:
            handler = _HANDLERS.get(func)
            if handler is not None:
                return handler(state, func, args, kwargs)
            if kwargs and ("device" in kwargs or "pin_memory" in kwargs):
                return _call_with_device_kwargs(state, func, args, kwargs)
        return func(*args, **kwargs)


def _remove_mode_from_this_thread(mode: TorchFunctionMode) -> None:
    from torch._C import _len_torch_function_stack
    from torch.overrides import _pop_mode, _push_mode

    above: list[Any] = []
    while _len_torch_function_stack() > 0:
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    # Modes the script pushed later go back on top; if ours was not found, the stack is restored untouched.
    for other in reversed(above):
        _push_mode(other)


# --------------------------------------------------------------------------------------------------------------
# torch.cuda / torch.accelerator replacements


def _host_memory_bytes() -> tuple[int, int]:
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 1024**3, 8 * 1024**3


def _cuda_functions(state: _Emulation) -> dict[str, Any]:
    """Replacements for `torch.cuda.<name>`; each one answers for the emulated devices."""

    def is_available() -> bool:
        return True

    def device_count() -> int:
        return state.num_devices

    def is_initialized() -> bool:
        return True

    def init() -> None:
        return None

    def set_device(device: Any) -> None:
        if isinstance(device, int) and not isinstance(device, bool) and device < 0:
            return
        state.current_device = _device_index(state, device)

    def current_device() -> int:
        return state.current_device

    def synchronize(device: Any = None) -> None:
        if device is not None:
            _device_index(state, device)

    def get_device_name(device: Any = None) -> str:
        _device_index(state, device)
        return EMULATED_DEVICE_NAME

    def get_device_capability(device: Any = None) -> tuple[int, int]:
        _device_index(state, device)
        return _EMULATED_CAPABILITY

    def get_device_properties(device: Any = None) -> EmulatedDeviceProperties:
        index = _device_index(state, device)
        total, _ = _host_memory_bytes()
        return EmulatedDeviceProperties(
            name=EMULATED_DEVICE_NAME,
            major=_EMULATED_CAPABILITY[0],
            minor=_EMULATED_CAPABILITY[1],
            total_memory=total // state.num_devices,
            multi_processor_count=os.cpu_count() or 1,
            uuid=f"ddpdoctor-emulated-{index}",
        )

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True

    def is_tf32_supported() -> bool:
        return True

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        _device_index(state, device)
        total, free = _host_memory_bytes()
        return free // state.num_devices, total // state.num_devices

    def zero_stat(device: Any = None) -> int:
        return 0

    def no_op(*args: Any, **kwargs: Any) -> None:
        return None

    def memory_stats(device: Any = None) -> OrderedDict:
        keys = (
            "allocated_bytes.all.current", "allocated_bytes.all.peak", "active_bytes.all.current",
            "active_bytes.all.peak", "reserved_bytes.all.current", "reserved_bytes.all.peak",
            "num_alloc_retries", "num_ooms",
        )  # fmt: skip
        return OrderedDict((k, 0) for k in keys)

    def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
        return f"{EMULATED_DEVICE_NAME}: the CPU allocator keeps no CUDA memory statistics.\n"

    def is_current_stream_capturing() -> bool:
        return False

    # Random number generators: one CPU generator per emulated device, never the CPU default generator.
    def _user_called() -> bool:
        # torch.manual_seed seeds CUDA through torch.cuda.manual_seed_all; only the script's own calls count.
        # Wrappers from ddpdoctor (the recorder's) are looked through.
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("ddpdoctor."):
            frame = frame.f_back
        caller = "" if frame is None else frame.f_globals.get("__name__", "")
        return not (caller == "torch" or caller.startswith("torch."))

    def manual_seed(seed: int) -> None:
        if _user_called():
            state.notify("cuda_rng", {"call": "torch.cuda.manual_seed", "seed": int(seed)})
        state.generators[state.current_device].manual_seed(int(seed))

    def manual_seed_all(seed: int) -> None:
        if _user_called():
            state.notify("cuda_rng", {"call": "torch.cuda.manual_seed_all", "seed": int(seed)})
        for generator in state.generators:
            generator.manual_seed(int(seed))

    def seed() -> None:
        state.generators[state.current_device].seed()

    def seed_all() -> None:
        chosen = state.generators[0].seed()
        for generator in state.generators[1:]:
            generator.manual_seed(chosen)

    def initial_seed() -> int:
        return state.generators[state.current_device].initial_seed()

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return state.generators[_device_index(state, device)].get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        generator = state.generators[_device_index(state, device)]
        if new_state.numel() != generator.get_state().numel():
            state.notify("cuda_rng_state_ignored", {"state_bytes": int(new_state.numel())})
            return
        generator.set_state(new_state.clone())

    def get_rng_state_all() -> list[torch.Tensor]:
        return [g.get_state() for g in state.generators]

    def set_rng_state_all(new_states: Any) -> None:
        for i, new_state in enumerate(new_states):
            set_rng_state(new_state, i)

    # Streams.
    def current_stream(device: Any = None) -> Any:
        index = _device_index(state, device)
        stream = state.current_streams.get(index)
        return stream if stream is not None else state.default_streams[index]

    def default_stream(device: Any = None) -> _EmulatedStream:
        return state.default_streams[_device_index(state, device)]

    def set_stream(stream: Any) -> None:
        if stream is not None:
            state.current_streams[stream.device.index] = stream

    def stream(stream: Any) -> _EmulatedStreamContext:
        return _EmulatedStreamContext(stream)

    return {
        "is_available": is_available,
        "device_count": device_count,
        "is_initialized": is_initialized,
        "init": init,
        "set_device": set_device,
        "current_device": current_device,
        "synchronize": synchronize,
        "get_device_name": get_device_name,
        "get_device_capability": get_device_capability,
        "get_device_properties": get_device_properties,
        "is_bf16_supported": is_bf16_supported,
        "is_tf32_supported": is_tf32_supported,
        "mem_get_info": mem_get_info,
        "memory_allocated": zero_stat,
        "max_memory_allocated": zero_stat,
        "memory_reserved": zero_stat,
        "max_memory_reserved": zero_stat,
        "memory_cached": zero_stat,
        "max_memory_cached": zero_stat,
        "memory_stats": memory_stats,
        "memory_summary": memory_summary,
        "reset_peak_memory_stats": no_op,
        "reset_max_memory_allocated": no_op,
        "reset_max_memory_cached": no_op,
        "reset_accumulated_memory_stats": no_op,
        "empty_cache": no_op,
        "ipc_collect": no_op,
        "set_per_process_memory_fraction": no_op,
        "is_current_stream_capturing": is_current_stream_capturing,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed_all,
        "seed": seed,
        "seed_all": seed_all,
        "initial_seed": initial_seed,
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "get_rng_state_all": get_rng_state_all,
        "set_rng_state_all": set_rng_state_all,
        "default_generators": state.generators,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "set_stream": set_stream,
        "stream": stream,
        "StreamContext": _EmulatedStreamContext,
        "Stream": _EmulatedStream,
        "Event": _EmulatedEvent,
        "device": _EmulatedCudaDevice,
        "device_of": _EmulatedCudaDeviceOf,
    }


def _accelerator_functions(state: _Emulation, cuda: dict[str, Any]) -> dict[str, Any]:
    """Replacements for `torch.accelerator.<name>`: the same N emulated CUDA devices."""

    def current_accelerator(check_available: bool = False) -> torch.device:
        return torch.device("cuda")

    def set_device_index(device: Any, /) -> None:
        cuda["set_device"](device)

    def current_device_index() -> int:
        return state.current_device

    def synchronize(device: Any = None, /) -> None:
        cuda["synchronize"](device)

    def current_stream(device: Any = None, /) -> Any:
        return cuda["current_stream"](device)

    def get_memory_info(device_index: Any = None, /) -> tuple[int, int]:
        return cuda["mem_get_info"](device_index)

    return {
        "is_available": cuda["is_available"],
        "device_count": cuda["device_count"],
        "current_accelerator": current_accelerator,
        "set_device_index": set_device_index,
        "set_device_idx": set_device_index,
        "current_device_index": current_device_index,
        "current_device_idx": current_device_index,
        "synchronize": synchronize,
        "current_stream": current_stream,
        "set_stream": cuda["set_stream"],
        "device_index": _EmulatedAcceleratorDeviceIndex,
        "get_memory_info": get_memory_info,
        "memory_allocated": cuda["memory_allocated"],
        "max_memory_allocated": cuda["max_memory_allocated"],
        "memory_reserved": cuda["memory_reserved"],
        "max_memory_reserved": cuda["max_memory_reserved"],
        "memory_stats": cuda["memory_stats"],
        "reset_peak_memory_stats": cuda["reset_peak_memory_stats"],
        "reset_accumulated_memory_stats": cuda["reset_accumulated_memory_stats"],
        "empty_cache": cuda["empty_cache"],
        "empty_host_cache": cuda["empty_cache"],
    }


# --------------------------------------------------------------------------------------------------------------
# torch.distributed, DDP, SyncBN, DataParallel


def _gloo_for(backend: Any) -> Any:
    """The backend an emulated run uses instead of `backend`: gloo wherever NCCL or a CUDA device was named."""
    if backend is None:
        return "gloo"  # a CUDA machine would pick "cpu:gloo,cuda:nccl"
    text = str(backend).lower()
    if text == "undefined":
        return "gloo"
    if ":" in text:
        per_device = dict(part.split(":", 1) for part in text.split(",") if ":" in part)
        if "cuda" not in per_device and "nccl" not in per_device.values():
            return backend
        cpu = per_device.get("cpu", "gloo")
        return "gloo" if cpu == "nccl" else cpu
    return "gloo" if text == "nccl" else backend


def _rebind(signature: inspect.Signature, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    try:
        return signature.bind(*args, **kwargs)
    except TypeError:
        return None  # let the original raise its own error


def _install_flat_tensor_collectives(state: _Emulation, patches: Patcher, retargeted: list[bool]) -> None:
    """NCCL's `all_gather_into_tensor` / `reduce_scatter_tensor` take the large tensor by its number of elements
    (a flat buffer of world × numel, which Accelerate's gather passes); gloo insists on the stacked shape
    (world × dim 0, the rest of the shape). Where the emulation moved the script's nccl group to gloo, a large
    tensor of the right size in another shape is viewed in the shape gloo takes (the same storage, so the result
    lands where NCCL would put it); a wrong size still raises, as it would on GPUs."""
    c10d = dist.distributed_c10d

    def _stacked(big: Any, small: Any, group: Any) -> Any:
        if not retargeted or not isinstance(big, torch.Tensor) or not isinstance(small, torch.Tensor):
            return big
        if small.dim() == 0 or not big.is_contiguous():
            return big
        try:
            world = dist.get_world_size(group)
        except Exception:
            return big
        shape = (world * small.shape[0], *small.shape[1:])
        if tuple(big.shape) == shape or big.numel() != world * small.numel():
            return big
        state.notify("flat_collective", {"shape": list(big.shape), "viewed_as": list(shape)})
        return big.view(shape)

    for name, big_first in (("all_gather_into_tensor", True), ("all_gather_single", True),
                            ("reduce_scatter_tensor", False), ("reduce_scatter_single", False)):
        orig = getattr(c10d, name, None)
        if orig is None:
            continue
        sig = inspect.signature(orig)

        def collective(*args: Any, _orig: Any = orig, _sig: Any = sig, _out_big: bool = big_first,
                       **kwargs: Any) -> Any:
            bound = _rebind(_sig, args, kwargs)
            if bound is None:
                return _orig(*args, **kwargs)
            arguments = bound.arguments
            group = arguments.get("group")
            if _out_big:  # all_gather_into_tensor(output_tensor, input_tensor): the output is world × input
                arguments["output_tensor"] = _stacked(arguments.get("output_tensor"), arguments.get("input_tensor"),
                                                      group)
            else:  # reduce_scatter_tensor(output, input): the input is world × output
                arguments["input"] = _stacked(arguments.get("input"), arguments.get("output"), group)
            return _orig(*bound.args, **bound.kwargs)

        _copy_identity(collective, orig)
        patches.setattr_everywhere([c10d, dist], name, collective)


def _install_distributed(state: _Emulation, patches: Patcher) -> None:
    c10d = dist.distributed_c10d
    orig_init = c10d.init_process_group
    orig_new_group = c10d.new_group
    init_sig = inspect.signature(orig_init)
    new_group_sig = inspect.signature(orig_new_group)

    def _retarget(bound: inspect.BoundArguments, call: str, default_to_gloo: bool) -> None:
        arguments = bound.arguments
        requested = arguments.get("backend")
        used = _gloo_for(requested) if (requested is not None or default_to_gloo) else None
        changed = str(used) != str(requested)
        dropped = []
        if changed:
            arguments["backend"] = used
            if arguments.get("pg_options") is not None:  # NCCL options mean nothing to gloo
                arguments["pg_options"] = None
                dropped.append("pg_options")
        if arguments.get("device_id") is not None:
            dropped.append(f"device_id={arguments['device_id']}")
            arguments["device_id"] = None
        if changed and not retargeted:
            retargeted.append(True)
        if changed or dropped:
            state.notify(
                "nccl_to_gloo",
                {"call": call, "requested": None if requested is None else str(requested),
                 "used": None if used is None else str(used), "dropped": dropped},
            )  # fmt: skip

    retargeted: list[bool] = []  # the emulation moved an nccl process group to gloo

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        bound = _rebind(init_sig, args, kwargs)
        if bound is None:
            return orig_init(*args, **kwargs)
        _retarget(bound, "init_process_group", default_to_gloo=True)
        return orig_init(*bound.args, **bound.kwargs)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        bound = _rebind(new_group_sig, args, kwargs)
        if bound is None:
            return orig_new_group(*args, **kwargs)
        _retarget(bound, "new_group", default_to_gloo=False)
        return orig_new_group(*bound.args, **bound.kwargs)

    for name, fn in (("init_process_group", init_process_group), ("new_group", new_group)):
        _copy_identity(fn, getattr(c10d, name))
        patches.setattr_everywhere([c10d, dist], name, fn)
    # Only the public name: torch's own code keeps asking the real question.
    patches.setattr(dist, "is_nccl_available", lambda: True)
    _install_flat_tensor_collectives(state, patches, retargeted)

    from torch.nn.parallel import DistributedDataParallel as DDP

    orig_ddp_init = DDP.__init__
    ddp_sig = inspect.signature(orig_ddp_init)

    def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = _rebind(ddp_sig, (self, *args), kwargs)
        if bound is not None:
            arguments = bound.arguments
            device_ids, output_device = arguments.get("device_ids"), arguments.get("output_device")
            if device_ids is not None or output_device is not None:
                state.notify(
                    "ddp_device_ids",
                    {"device_ids": None if device_ids is None else [_jsonable_device(d) for d in device_ids],
                     "output_device": None if output_device is None else _jsonable_device(output_device)},
                )  # fmt: skip
                arguments["device_ids"] = None
                arguments["output_device"] = None
            return orig_ddp_init(*bound.args, **bound.kwargs)
        return orig_ddp_init(self, *args, **kwargs)

    _copy_identity(ddp_init, orig_ddp_init)
    patches.setattr(DDP, "__init__", ddp_init)

    orig_sbn_handle = DDP._passing_sync_batchnorm_handle

    def passing_sync_batchnorm_handle(self: Any, module: Any) -> None:
        if self.device_type != "cpu":
            return orig_sbn_handle(self, module)
        count = sum(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())
        if count:
            state.notify("syncbn_ddp_check", {"sync_batchnorm_layers": count})
        return None

    patches.setattr(DDP, "_passing_sync_batchnorm_handle", passing_sync_batchnorm_handle)

    orig_sbn_forward = torch.nn.SyncBatchNorm.forward
    syncbn_impl: list[Any] = []

    def syncbn_forward(self: Any, input: torch.Tensor) -> torch.Tensor:
        if input.device.type != "cpu":
            return orig_sbn_forward(self, input)
        if not syncbn_impl:
            from ddpdoctor.bn.syncbn import sync_batch_norm_forward

            syncbn_impl.append(sync_batch_norm_forward)
        if self.training and "sync_batchnorm" not in state.notified and dist.is_initialized():
            state.notify("sync_batchnorm", {"implementation": "ddpdoctor.bn.syncbn.sync_batch_norm_forward"})
        return syncbn_impl[0](self, input, self.process_group)

    _copy_identity(syncbn_forward, orig_sbn_forward)
    patches.setattr(torch.nn.SyncBatchNorm, "forward", syncbn_forward)

    def data_parallel_init(
        self: Any, module: Any, device_ids: Any = None, output_device: Any = None, dim: int = 0
    ) -> None:
        # What DataParallel.__init__ does on a machine with these GPUs: every visible device unless told otherwise.
        torch.nn.Module.__init__(self)
        self.module = module
        self.dim = dim
        ids = list(range(state.num_devices)) if device_ids is None else [_device_index(state, d) for d in device_ids]
        self.device_ids = ids
        self.output_device = ids[0] if output_device is None else _device_index(state, output_device)
        self.src_device_obj = torch.device("cuda", ids[0])
        state.notify("data_parallel", {"device_ids": ids, "replicas": len(ids)})

    def data_parallel_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        # Scatter, one replica per chunk, gather — as DataParallel.forward on GPUs. The replicas run one after the
        # other on the CPU; replica 0 shares parameters and buffers with the module (its BatchNorm updates are
        # kept), the others share parameters (gradients flow back to them) and use copies of the buffers that are
        # thrown away, exactly what survives on GPUs.
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        scattered, scattered_kwargs = _dp_scatter_kwargs(inputs, kwargs, len(self.device_ids), self.dim)
        if not scattered and not scattered_kwargs:
            scattered, scattered_kwargs = [()], [{}]
        if len(self.device_ids) == 1:
            return self.module(*scattered[0], **scattered_kwargs[0])
        outputs = []
        for i, (chunk, chunk_kwargs) in enumerate(zip(scattered, scattered_kwargs)):
            if i == 0:
                outputs.append(self.module(*chunk, **chunk_kwargs))
            else:
                with _replica_buffers(self.module):
                    outputs.append(self.module(*chunk, **chunk_kwargs))
        return _dp_gather(outputs, self.dim)

    _copy_identity(data_parallel_init, torch.nn.DataParallel.__init__)
    patches.setattr(torch.nn.DataParallel, "__init__", data_parallel_init)
    _copy_identity(data_parallel_forward, torch.nn.DataParallel.forward)
    patches.setattr(torch.nn.DataParallel, "forward", data_parallel_forward)


def _dp_scatter(obj: Any, n: int, dim: int) -> list[Any]:
    """torch.nn.parallel.scatter_gather.scatter with `Tensor.chunk` for the CUDA scatter (what comm.scatter does
    without chunk sizes): fewer chunks than devices when the batch is smaller."""

    def scatter_map(o: Any) -> list[Any]:
        if isinstance(o, torch.Tensor):
            if o.numel() == 0:
                raise RuntimeError("Expected non-empty tensor")
            return list(o.chunk(n, dim))
        if isinstance(o, tuple) and hasattr(o, "_fields"):
            return [type(o)(*args) for args in zip(*map(scatter_map, o))]
        if isinstance(o, tuple) and len(o) > 0:
            return list(zip(*map(scatter_map, o)))
        if isinstance(o, list) and len(o) > 0:
            return [list(i) for i in zip(*map(scatter_map, o))]
        if isinstance(o, dict) and len(o) > 0:
            return [type(o)(i) for i in zip(*map(scatter_map, o.items()))]
        return [o for _ in range(n)]

    return scatter_map(obj)


def _dp_scatter_kwargs(inputs: tuple, kwargs: dict, n: int, dim: int) -> tuple[list[Any], list[Any]]:
    scattered = _dp_scatter(inputs, n, dim) if inputs else []
    scattered_kwargs = _dp_scatter(kwargs, n, dim) if kwargs else []
    if len(scattered) < len(scattered_kwargs):
        scattered.extend(() for _ in range(len(scattered_kwargs) - len(scattered)))
    elif len(scattered_kwargs) < len(scattered):
        scattered_kwargs.extend({} for _ in range(len(scattered) - len(scattered_kwargs)))
    return scattered, scattered_kwargs


def _dp_gather(outputs: list[Any], dim: int) -> Any:
    """torch.nn.parallel.scatter_gather.gather onto the output device: concatenation along `dim` (scalars become
    a vector, with DataParallel's warning)."""
    import warnings

    def gather_map(outs: list[Any]) -> Any:
        out = outs[0]
        if isinstance(out, torch.Tensor):
            if dim == 0 and all(t.dim() == 0 for t in outs):
                warnings.warn(
                    "Was asked to gather along dimension 0, but all input tensors were scalars; will instead "
                    "unsqueeze and return a vector.",
                    stacklevel=2,
                )
                outs = [t.view(1) for t in outs]
            return torch.cat(outs, dim)
        if out is None:
            return None
        if isinstance(out, dict):
            if not all(len(out) == len(d) for d in outs):
                raise ValueError("All dicts must have the same number of keys")
            return type(out)((k, gather_map([d[k] for d in outs])) for k in out)
        if isinstance(out, tuple) and hasattr(out, "_fields"):
            return type(out)._make(map(gather_map, zip(*outs)))
        return type(out)(map(gather_map, zip(*outs)))

    return gather_map(outputs)


@contextlib.contextmanager
def _replica_buffers(module: torch.nn.Module):  # noqa: ANN202
    """Run a forward with throw-away copies of every buffer (a DataParallel replica other than the first)."""
    saved = []
    for m in module.modules():
        for name, buf in list(m._buffers.items()):
            if buf is not None:
                saved.append((m, name, buf))
                m._buffers[name] = buf.clone()
    try:
        yield
    finally:
        for m, name, buf in saved:
            m._buffers[name] = buf


def _copy_identity(wrapper: Any, wrapped: Any) -> None:
    """Make a replacement look like torch's function: name, docstring and `inspect.signature` (a recorder that
    wraps it binds the script's arguments by name). Deliberately no `__wrapped__`: `inspect.unwrap` must not
    lead past the emulation to the original that refuses CPU tensors."""
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(wrapper, attr, getattr(wrapped, attr))
    with contextlib.suppress(ValueError, TypeError):
        wrapper.__signature__ = inspect.signature(wrapped)


# --------------------------------------------------------------------------------------------------------------
# autocast, GradScaler, torch.load


def _install_amp(state: _Emulation, patches: Patcher) -> None:
    try:
        from torch.amp import autocast_mode, grad_scaler
    except ImportError:  # torch 2.1 and 2.2: GradScaler is CUDA's alone, with nothing to run it on a CPU
        raise RuntimeError(f"torch {torch.__version__} has no device-generic torch.amp.GradScaler (torch 2.3+), which "
                           "the emulation runs CUDA's GradScaler on; it is tested on torch 2.4.1 and later") from None

    autocast_cls = autocast_mode.autocast
    orig_autocast_init = autocast_cls.__init__

    def autocast_init(
        self: Any, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None
    ) -> None:
        if device_type == "cuda":
            requested = torch.get_autocast_dtype("cuda") if dtype is None else dtype
            dtype = state.float16_autocast if requested == torch.float16 else requested
            if enabled:
                state.notify("autocast_cuda", {"dtype": str(requested), "used": str(dtype)})
            device_type = "cpu"
        orig_autocast_init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    _copy_identity(autocast_init, orig_autocast_init)
    patches.setattr(autocast_cls, "__init__", autocast_init)

    scaler_cls = grad_scaler.GradScaler
    orig_scaler_init = scaler_cls.__init__
    scaler_sig = inspect.signature(orig_scaler_init)

    def scaler_init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = _rebind(scaler_sig, (self, *args), kwargs)
        if bound is None:
            return orig_scaler_init(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["device"] == "cuda":
            if bound.arguments.get("enabled", True):
                state.notify("grad_scaler", {"device": "cuda", "used": "cpu"})
            bound.arguments["device"] = "cpu"
        return orig_scaler_init(*bound.args, **bound.kwargs)

    _copy_identity(scaler_init, orig_scaler_init)
    patches.setattr(scaler_cls, "__init__", scaler_init)

    orig_custom_fwd = autocast_mode.custom_fwd
    orig_custom_bwd = autocast_mode.custom_bwd

    def custom_fwd(fwd: Any = None, *, device_type: str, cast_inputs: Any = None) -> Any:
        return orig_custom_fwd(fwd, device_type="cpu" if device_type == "cuda" else device_type,
                               cast_inputs=cast_inputs)  # fmt: skip

    def custom_bwd(bwd: Any = None, *, device_type: str) -> Any:
        return orig_custom_bwd(bwd, device_type="cpu" if device_type == "cuda" else device_type)

    for name, fn, orig in (("custom_fwd", custom_fwd, orig_custom_fwd), ("custom_bwd", custom_bwd, orig_custom_bwd)):
        _copy_identity(fn, orig)
        patches.setattr_everywhere([autocast_mode, torch.amp], name, fn)

    orig_is_autocast_enabled = torch.is_autocast_enabled

    def is_autocast_enabled(*args: Any, **kwargs: Any) -> bool:
        if not args and not kwargs:
            return orig_is_autocast_enabled("cpu")  # the deprecated no-argument form asks about CUDA
        device_type = args[0] if args else kwargs.get("device_type")
        if device_type == "cuda":
            return orig_is_autocast_enabled("cpu")
        return orig_is_autocast_enabled(*args, **kwargs)

    patches.setattr(torch, "is_autocast_enabled", is_autocast_enabled)


def _install_serialization(state: _Emulation, patches: Patcher) -> None:
    import torch.serialization as serialization
    import torch.storage

    cuda_location = re.compile(r"cuda(:|[0-9]+)")

    def restore_cuda_on_cpu(obj: Any, location: str) -> Any:
        if location == "cuda" or cuda_location.match(location):
            index = _cuda_index(state, location)
            if index is None:
                return None
            state.notify("map_location", {"location": location, "used": "cpu"})
            return obj  # freshly deserialised CPU storage: already where emulated CUDA memory lives
        return None

    for i, (priority, tagger, deserializer) in enumerate(serialization._package_registry):
        if getattr(deserializer, "args", None) == ("cuda",):
            patches.setitem(serialization._package_registry, i, (priority, tagger, restore_cuda_on_cpu))

    orig_load = serialization.load

    def load(*args: Any, **kwargs: Any) -> Any:
        in_args = len(args) > 1
        map_location = args[1] if in_args else kwargs.get("map_location")
        if isinstance(map_location, bytes):
            map_location = map_location.decode()
        if isinstance(map_location, (str, torch.device)) and _cuda_index(state, map_location) is not None:
            state.notify("map_location", {"map_location": str(map_location), "used": "cpu"})
            if in_args:
                args = (args[0], "cpu", *args[2:])
            else:
                kwargs = {**kwargs, "map_location": "cpu"}
        return orig_load(*args, **kwargs)

    _copy_identity(load, orig_load)
    patches.setattr_everywhere([serialization, torch], "load", load)

    def storage_cuda(self: Any, device: Any = None, non_blocking: bool = False) -> Any:
        # `map_location=lambda storage, loc: storage.cuda(gpu)`: a copy, like the host-to-device copy it was.
        _device_index(state, device)
        _note_device(state, "cuda" if device is None else device, "Storage.cuda")
        return self.clone()

    patches.setattr(torch.storage._StorageBase, "cuda", storage_cuda)


# --------------------------------------------------------------------------------------------------------------
# Tensor methods, module placement, threads and default-device contexts


def _install_tensor_methods(state: _Emulation, patches: Patcher) -> None:
    # Tensor.record_stream parses its stream argument before any torch-function hook could see an emulated one.
    orig_record_stream = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, _EmulatedStream):
            return None  # every emulated stream is synchronous: nothing to keep alive
        return orig_record_stream(self, stream)

    _copy_identity(record_stream, orig_record_stream)
    patches.setattr(torch.Tensor, "record_stream", record_stream)


def _install_module_placement(state: _Emulation, patches: Patcher) -> None:
    # `Module.to(<cuda>)` moves tensors with the device already mapped to the CPU (via `_parse_to`), so the
    # placement is recorded here; `Module.cuda()` goes through `Tensor.cuda` and is recorded there.
    orig_module_to = torch.nn.Module.to

    def module_to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = orig_module_to(self, *args, **kwargs)
        device = kwargs.get("device", args[0] if args else None)
        if device is not None and not isinstance(device, (torch.dtype, torch.Tensor)) and _STATE is state:
            index = _cuda_index(state, device)
            if index is not None:
                for tensor in (*self.parameters(), *self.buffers()):
                    state.place(tensor, index)
        return result

    _copy_identity(module_to, orig_module_to)
    patches.setattr(torch.nn.Module, "to", module_to)


_REAL_DEVICE = torch.device


class _DeviceMeta(type):
    """`torch.device` as the emulation answers it: `torch.device(int)` is the accelerator's device of that index
    (cuda:N on a GPU machine) — a CPU build raises "Cannot access accelerator device when none is available" in C++
    before any hook can see it, so the constructor is wrapped. Everything else is the real class: calls return real
    `torch.device` objects, `isinstance(x, torch.device)` holds for them."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if (len(args) == 1 and not kwargs and isinstance(args[0], int) and not isinstance(args[0], bool)
                and args[0] >= 0):
            return _REAL_DEVICE("cuda", args[0])
        return _REAL_DEVICE(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _REAL_DEVICE)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return isinstance(sub, type) and issubclass(sub, _REAL_DEVICE)


def _install_device_constructor(state: _Emulation, patches: Patcher) -> None:
    import copyreg

    device = _DeviceMeta("device", (), {"__module__": "torch", "__qualname__": "device",
                                        "__doc__": _REAL_DEVICE.__doc__})
    patches.setattr(torch, "device", device)
    # pickle looks a class up by name and insists on the very object: devices pickle as calls of the name that
    # now holds the wrapper (a file written here loads anywhere as torch.device(...))
    previous = copyreg.dispatch_table.get(_REAL_DEVICE)
    copyreg.dispatch_table[_REAL_DEVICE] = lambda d: (device, (d.type, d.index) if d.index is not None else (d.type,))

    def restore() -> None:
        if previous is None:
            copyreg.dispatch_table.pop(_REAL_DEVICE, None)
        else:
            copyreg.dispatch_table[_REAL_DEVICE] = previous

    patches.add_undo(restore)


def _install_threads(state: _Emulation, patches: Patcher) -> None:
    orig_bootstrap_inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap_inner(self: threading.Thread) -> None:
        current = _STATE
        if current is None:
            return orig_bootstrap_inner(self)
        with current.mode:
            return orig_bootstrap_inner(self)

    patches.setattr(threading.Thread, "_bootstrap_inner", bootstrap_inner)

    # `torch.set_default_device("cuda")` / `with torch.device("cuda"):` push a DeviceContext *below* every other
    # mode, so it would inject the CUDA device after this mode has looked; give it the CPU instead.
    from torch.utils._device import DeviceContext

    orig_device_context_init = DeviceContext.__init__

    def device_context_init(self: Any, device: Any) -> None:
        if _cuda_index(state, device) is not None:
            _note_device(state, device, "default device")
            device = _CPU
        orig_device_context_init(self, device)

    patches.setattr(DeviceContext, "__init__", device_context_init)


# --------------------------------------------------------------------------------------------------------------
# Entry point


def install_cuda_emulation(
    num_devices: int, *, notify: Notify | None = None, float16_autocast: str = "bfloat16"
) -> Callable[[], None]:
    """Make this process behave like one with `num_devices` CUDA GPUs while computing on the CPU over gloo.

    Call it in each rank before the user's script runs (and before any recorder patches, which then wrap these
    and see the script's original arguments). Returns `undo`, which restores every patched attribute and leaves
    the calling thread's torch-function mode stack as it found it. Installing again while active returns a no-op
    `undo` (a forked child inherits the parent's emulation).

    `float16_autocast` is the CPU autocast dtype that stands in for CUDA float16 autocast: "bfloat16" (default,
    fast) or "float16" (exact dtype, but CPU float16 kernels are 17-80x slower than float32 on CPUs without
    AVX512-FP16/AMX-FP16; see the module docstring).
    """
    global _STATE
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    if float16_autocast not in ("bfloat16", "float16"):
        raise ValueError(f"float16_autocast must be 'bfloat16' or 'float16', got {float16_autocast!r}")
    with _INSTALL_LOCK:
        if _STATE is not None:
            return lambda: None
        state = _Emulation(num_devices, notify, getattr(torch, float16_autocast))
        patches = Patcher()
        try:
            _install_all(state, patches)
        except BaseException:
            patches.undo()
            raise
        _STATE = state
        state.mode.__enter__()

    installing_thread = threading.get_ident()
    undone = False

    def undo() -> None:
        nonlocal undone
        global _STATE
        with _INSTALL_LOCK:
            if undone:
                return
            undone = True
            if threading.get_ident() == installing_thread:
                _remove_mode_from_this_thread(state.mode)
            _STATE = None
            patches.undo()

    return undo


def _register_stream_bases() -> None:
    """Older torch (2.4.1 here) checks, when torch._dynamo is imported (DDP's constructor imports it), that
    `torch.cuda.Event` and `torch.cuda.Stream` are subclasses of `torch._streambase`'s abstract bases: the emulated
    ones are registered as virtual subclasses there (without, every emulated DDP script failed at its DDP(...)
    line). torch 2.11 no longer checks; torch 2.1 has no such module."""
    try:
        from torch._streambase import _EventBase, _StreamBase
    except ImportError:
        return
    if hasattr(_EventBase, "register") and hasattr(_StreamBase, "register"):  # abstract bases (later: torch.Event)
        _EventBase.register(_EmulatedEvent)
        _StreamBase.register(_EmulatedStream)


def _accelerator_modules() -> list[Any]:
    """`torch.accelerator` (torch 2.6+) and its `memory` module (later still), where this torch has them: a script
    on an older torch cannot call what is not there."""
    import importlib

    modules = []
    for name in ("torch.accelerator", "torch.accelerator.memory"):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            break
    return modules


def _install_all(state: _Emulation, patches: Patcher) -> None:
    import torch.cuda.memory
    import torch.cuda.nvtx
    import torch.cuda.random
    import torch.cuda.streams

    cuda = _cuda_functions(state)
    cuda_modules = [torch.cuda, torch.cuda.memory, torch.cuda.random, torch.cuda.streams]
    for name, value in cuda.items():
        patches.setattr_everywhere(cuda_modules, name, value)

    for name in ("range_push", "range_pop", "range_start", "range_end", "mark"):
        patches.setattr(torch.cuda.nvtx, name, lambda *args, **kwargs: 0)

    _register_stream_bases()
    accelerator = _accelerator_modules()
    for name, value in _accelerator_functions(state, cuda).items() if accelerator else ():
        patches.setattr_everywhere(accelerator, name, value)

    if dist.is_available():
        _install_distributed(state, patches)
    _install_amp(state, patches)
    _install_serialization(state, patches)
    _install_tensor_methods(state, patches)
    _install_module_placement(state, patches)
    _install_device_constructor(state, patches)
    _install_threads(state, patches)
