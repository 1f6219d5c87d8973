"""CUDA emulation on CPU ranks (ddpdoctor/probe/emulation.py).

In-process tests install the emulation around one test and undo it; the two `slow` tests launch real 2-rank
gloo runs (torchrun) of CUDA-style fixture scripts in fixtures/probe/emulation/.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpdoctor.probe import emulation as emu
from ddpdoctor.probe.emulation import (
    EMULATED_DEVICE_NAME,
    emulated_device,
    emulation_active,
    install_cuda_emulation,
)

HAS_ACCELERATOR = hasattr(torch, "accelerator")  # the device-generic API, torch 2.6+
ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "probe" / "emulation"


class Notifications:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, what: str, detail: dict) -> None:
        self.calls.append((what, detail))

    def whats(self) -> list[str]:
        return [w for w, _ in self.calls]

    def detail(self, what: str) -> dict:
        return next(d for w, d in self.calls if w == what)


@pytest.fixture
def emulated():
    notes = Notifications()
    undo = install_cuda_emulation(2, notify=notes)
    try:
        yield notes
    finally:
        undo()
    assert not emulation_active()


# ---------------------------------------------------------------------------------------------------------------
# torch.cuda answers


def test_cuda_queries_answer_for_the_emulated_devices(emulated):
    assert emulation_active()
    assert torch.cuda.is_available() and torch.cuda.is_initialized()
    assert torch.cuda.device_count() == 2
    assert torch.cuda.get_device_name(1) == EMULATED_DEVICE_NAME
    props = torch.cuda.get_device_properties(torch.device("cuda", 1))
    assert (props.major, props.minor) == torch.cuda.get_device_capability() == (8, 0)
    assert props.total_memory > 0 and props.multi_processor_count >= 1 and props.name == EMULATED_DEVICE_NAME
    assert torch.cuda.is_bf16_supported()
    for fn in (torch.cuda.memory_allocated, torch.cuda.max_memory_allocated, torch.cuda.memory_reserved):
        assert fn() == 0
    assert torch.cuda.memory_stats()["allocated_bytes.all.peak"] == 0
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("step")
    torch.cuda.nvtx.range_pop()
    with torch.cuda.nvtx.range("epoch {}", 1):
        pass
    # The device-generic API (torch 2.6+) describes the same machine.
    if HAS_ACCELERATOR:
        assert torch.accelerator.is_available() and torch.accelerator.device_count() == 2
        assert torch.accelerator.current_accelerator() == torch.device("cuda")
        assert torch.distributed.get_default_backend_for_device(torch.accelerator.current_accelerator()) == "nccl"
    # cudnn / tf32 flags stay harmless.
    torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32


def test_current_device_follows_set_device_and_device_contexts(emulated):
    assert torch.cuda.current_device() == 0
    torch.cuda.set_device(1)
    assert torch.cuda.current_device() == 1
    assert not HAS_ACCELERATOR or torch.accelerator.current_device_index() == 1
    torch.cuda.set_device("cuda:0")
    with torch.cuda.device(1):
        assert torch.cuda.current_device() == 1
        assert emulated_device(torch.ones(1).cuda()) == torch.device("cuda", 1)  # no index: the current device
    assert torch.cuda.current_device() == 0
    assert isinstance(torch.cuda.device(0), torch.cuda.device)  # still a class: torch's isinstance checks use it
    if HAS_ACCELERATOR:
        with torch.accelerator.device_index(1):
            assert torch.cuda.current_device() == 1
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(2)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.zeros(1, device="cuda:2")


def test_streams_and_events(emulated):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    assert 15.0 <= start.elapsed_time(end) < 2000.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.cuda.Event().elapsed_time(torch.cuda.Event())
    with pytest.raises(RuntimeError, match="recorded"):
        torch.cuda.Event(enable_timing=True).elapsed_time(end)

    side = torch.cuda.Stream(device=1)
    assert torch.cuda.current_stream(1) is torch.cuda.default_stream(1) is not side
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream(1) is side
        x = torch.ones(3).cuda(1, non_blocking=True)
    assert torch.cuda.current_stream(1) is torch.cuda.default_stream(1)
    ready = side.record_event()
    torch.cuda.current_stream(1).wait_event(ready)
    torch.cuda.current_stream(1).wait_stream(side)
    x.record_stream(torch.cuda.current_stream(1))
    assert ready.query() and side.query() and not side.is_capturing()


# ---------------------------------------------------------------------------------------------------------------
# Device rewriting


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 1), 1])
def test_factories_and_tensor_methods_map_cuda_to_cpu(emulated, device):
    made = [
        torch.zeros(2, 3, device=device),
        torch.arange(4, device=device),
        torch.tensor([1.0, 2.0], device=device),
        torch.full((2,), 3.0, device=device),
        torch.ones(2).new_zeros(3, device=device),
        torch.empty(2, device=device, pin_memory=True),
        torch.ones(2).to(device),
        torch.ones(2).to(device, torch.float64),
        torch.ones(2).to(device=device, dtype=torch.float16, non_blocking=True),
        torch.ones(2).cuda(device if not isinstance(device, str) or ":" in device else None),
        torch.ones(2).type("torch.cuda.DoubleTensor"),
        torch.ones(2).type(torch.cuda.HalfTensor),
    ]
    assert all(t.device == torch.device("cpu") and not t.is_cuda for t in made)
    assert [t.dtype for t in made[7:9]] == [torch.float64, torch.float16]
    assert [t.dtype for t in made[-2:]] == [torch.float64, torch.float16]
    expected = torch.device("cuda", 0 if device == "cuda" else 1)
    assert emulated_device(made[0]) == expected == emulated_device(made[6])
    assert emulated.detail("cuda_device")["device"] in ("cuda", "cuda:1", 1)
    # What is not CUDA is left exactly alone.
    plain = torch.ones(2)
    assert plain.to("cpu") is plain and plain.to(torch.float32) is plain and plain.to(plain) is plain
    assert emulated_device(plain) is None


def test_torch_device_of_an_int_is_the_accelerators_device(emulated):
    """`torch.device(local_rank)` (detection code does it) is cuda:N on a GPU machine; a CPU build raises in C++.
    Emulated, it is cuda:N, maps to the CPU like any CUDA device, and stays a real torch.device (isinstance, ==,
    pickling under the name torch.device)."""
    import io
    import pickle

    d = torch.device(1)
    assert d == torch.device("cuda", 1) and isinstance(d, torch.device) and type(d) is emu._REAL_DEVICE
    assert torch.device("cpu").type == "cpu" and torch.device(type="cuda", index=0).index == 0
    assert torch.zeros(2, device=torch.device(1)).device.type == "cpu" and emulated_device(
        torch.zeros(2, device=torch.device(1))) == torch.device("cuda", 1)
    assert pickle.loads(pickle.dumps(d)) == d
    buffer = io.BytesIO()
    torch.save({"device": d}, buffer)
    buffer.seek(0)
    assert torch.load(buffer)["device"] == d
    with pytest.raises(RuntimeError):
        torch.device(-1)


def test_cuda_copies_like_a_host_to_device_copy_but_keeps_parameters(emulated):
    dataset = torch.arange(10.0)
    batch = dataset[2:6].cuda()
    batch.mul_(100)  # in-place on the "GPU" copy must not write into the dataset
    assert dataset[2:6].tolist() == [2.0, 3.0, 4.0, 5.0]
    moved = dataset.to("cuda:1")
    moved.zero_()
    assert dataset.sum().item() == 45.0

    leaf = torch.ones(3, requires_grad=True)
    (leaf.cuda() * 2).sum().backward()  # the copy is differentiable, like .cuda() on a GPU
    assert leaf.grad.tolist() == [2.0, 2.0, 2.0]

    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    weight = model[0].weight
    assert model.cuda() is model and model.to(1) is model and model.to("cuda:0", torch.float32) is model
    assert model[0].weight is weight and weight.cuda() is weight
    assert emulated_device(model) == torch.device("cuda", 0) == emulated_device(model[1].running_mean)
    model.to(torch.device("cuda", 1))
    assert emulated_device(model) == torch.device("cuda", 1)
    assert model(torch.randn(4, 3, device="cuda")).device.type == "cpu"


def test_threads_started_after_install_are_emulated(emulated):
    seen: list[torch.device] = []
    worker = threading.Thread(target=lambda: seen.append(torch.randn(2, device="cuda").device))
    worker.start()
    worker.join()
    with ThreadPoolExecutor(max_workers=1) as pool:
        seen.append(pool.submit(lambda: torch.ones(1).cuda().device).result())
    assert seen == [torch.device("cpu")] * 2

    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "pin_memory but no accelerator" warning: pinning is emulated
        loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True)
        assert [b[0].cuda(non_blocking=True).sum().item() for b in loader] == [6.0, 22.0]


def test_default_device_cuda_maps_to_cpu(emulated):
    with torch.device("cuda"):
        assert torch.zeros(2).device.type == "cpu"
    torch.set_default_device("cuda:1")
    try:
        assert torch.randn(2).device.type == "cpu"
    finally:
        torch.set_default_device(None)


# ---------------------------------------------------------------------------------------------------------------
# Mixed precision


def test_autocast_cuda_runs_cpu_autocast(emulated):
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        assert layer(x).dtype == torch.bfloat16  # the fast stand-in for float16 on CPUs
        assert torch.is_autocast_enabled() and torch.is_autocast_enabled("cuda")
        with torch.autocast(device_type="cuda", enabled=False):
            assert layer(x).dtype == torch.float32
    with torch.amp.autocast(device_type="cuda"):  # CUDA's default dtype is float16
        assert layer(x).dtype == torch.bfloat16
    with pytest.warns(FutureWarning), torch.cuda.amp.autocast(dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    assert layer(x).dtype == torch.float32 and not torch.is_autocast_enabled("cuda")
    assert emulated.detail("autocast_cuda") == {"dtype": "torch.float16", "used": "torch.bfloat16"}

    class Square(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * t

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            return 2 * t * grad

    with torch.autocast("cuda", dtype=torch.float16):
        assert Square.apply(torch.ones(2, dtype=torch.float16)).dtype == torch.float32


def test_autocast_can_keep_float16():
    undo = install_cuda_emulation(1, float16_autocast="float16")
    try:
        with torch.autocast("cuda"):
            assert nn.Linear(4, 4)(torch.randn(2, 4).cuda()).dtype == torch.float16
    finally:
        undo()
    with pytest.raises(ValueError):
        install_cuda_emulation(1, float16_autocast="float8")


def _scaled_step(scaler: torch.amp.GradScaler, poison: bool) -> tuple[torch.Tensor, float]:
    torch.manual_seed(0)
    layer = nn.Linear(4, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    loss = layer(torch.randn(8, 4)).square().mean()
    scaler.scale(loss).backward()
    if poison:
        layer.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    return layer.weight.detach().clone(), scaler.get_scale()


def test_grad_scaler_cuda_scales_on_cpu(emulated):
    reference, ref_scale = _scaled_step(torch.amp.GradScaler("cpu", init_scale=1024.0), poison=False)
    for make in (lambda: torch.amp.GradScaler("cuda", init_scale=1024.0),
                 lambda: torch.amp.GradScaler(init_scale=1024.0),
                 lambda: torch.cuda.amp.GradScaler(init_scale=1024.0)):  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            scaler = make()
        assert scaler.is_enabled()
        weight, scale = _scaled_step(scaler, poison=False)
        assert torch.equal(weight, reference) and scale == ref_scale == 1024.0
    torch.manual_seed(0)
    untouched = nn.Linear(4, 1).weight.detach()
    weight, scale = _scaled_step(torch.amp.GradScaler("cuda", init_scale=1024.0), poison=True)
    assert torch.equal(weight, untouched) and scale == 512.0  # inf found: step skipped, scale backed off
    assert emulated.detail("grad_scaler") == {"device": "cuda", "used": "cpu"}


# ---------------------------------------------------------------------------------------------------------------
# Random number generators


def test_cuda_generators_are_separate_from_the_cpu_generator(emulated):
    torch.manual_seed(3)  # seeds the CPU and every emulated CUDA generator, as on a GPU machine
    cuda_draw = torch.randn(4, device="cuda")
    cpu_draw = torch.randn(4)
    assert torch.equal(cuda_draw, torch.randn(4, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(cpu_draw, torch.randn(4, generator=torch.Generator().manual_seed(3)))  # not consumed
    assert "cuda_rng" not in emulated.whats()  # torch.manual_seed's own call is not the script's

    cpu_state = torch.get_rng_state()
    torch.cuda.manual_seed(rank_seed := 11)
    assert torch.equal(torch.get_rng_state(), cpu_state)  # CPU-side data and augmentation stay as written
    assert torch.cuda.initial_seed() == rank_seed and torch.cuda.initial_seed() != torch.initial_seed()
    assert emulated.detail("cuda_rng") == {"call": "torch.cuda.manual_seed", "seed": 11}

    saved = torch.cuda.get_rng_state()
    first = torch.rand(3, device="cuda:0")
    torch.cuda.set_rng_state(saved)
    assert torch.equal(first, torch.rand(3, device="cuda"))
    torch.cuda.set_rng_state(torch.zeros(16, dtype=torch.uint8))  # a real CUDA (Philox) state: kept out
    assert emulated.detail("cuda_rng_state_ignored") == {"state_bytes": 16}
    states = torch.cuda.get_rng_state_all()
    assert len(states) == 2 and len(torch.cuda.default_generators) == 2
    with torch.random.fork_rng(devices=[0, 1]):
        torch.randn(5, device="cuda:1")
    assert torch.equal(torch.cuda.get_rng_state(1), states[1])


# ---------------------------------------------------------------------------------------------------------------
# torch.load of CUDA checkpoints


@pytest.fixture
def cuda_checkpoint(tmp_path, monkeypatch):
    """A checkpoint whose storages are tagged "cuda:1", as torch.save writes them on a GPU machine."""
    path = tmp_path / "gpu.pt"
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:1")
        torch.save({"w": torch.arange(6.0).reshape(2, 3)}, path)
    return path


def test_torch_load_restores_cuda_checkpoints_on_cpu(emulated, cuda_checkpoint):
    expected = torch.arange(6.0).reshape(2, 3)
    for map_location in (None, "cuda:0", "cuda", torch.device("cuda", 1), {"cuda:1": "cuda:0"},
                         lambda storage, loc: storage.cuda(0), lambda storage, loc: None, "cpu"):  # fmt: skip
        loaded = torch.load(cuda_checkpoint, map_location=map_location)
        assert loaded["w"].device.type == "cpu" and torch.equal(loaded["w"], expected)
    assert "map_location" in emulated.whats()
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.load(cuda_checkpoint, map_location="cuda:5")


def test_cuda_checkpoint_needs_emulation(cuda_checkpoint):
    assert not emulation_active()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.load(cuda_checkpoint)


# ---------------------------------------------------------------------------------------------------------------
# torch.distributed, DDP, SyncBN, DataParallel (one rank, in process)


def test_nccl_ddp_and_syncbn_run_on_gloo_in_process(emulated, tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=torch.device("cuda:0")
    )
    try:
        assert dist.get_backend() == "gloo"
        side_group = dist.new_group(ranks=[0], backend="nccl")
        assert dist.get_backend(side_group) == "gloo"
        model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))).cuda()
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0], output_device=0)
        assert ddp.device_ids is None
        x = torch.randn(6, 4, device="cuda")
        ddp(x).sum().backward()
        reference = F.batch_norm(model[0](x), None, None, model[1].weight, model[1].bias, training=True)
        torch.testing.assert_close(ddp(x), reference)
        dist.barrier(device_ids=[0])
    finally:
        dist.destroy_process_group()
    assert emulated.detail("nccl_to_gloo") == {
        "call": "init_process_group", "requested": "nccl", "used": "gloo", "dropped": ["device_id=cuda:0"]
    }  # fmt: skip
    assert emulated.detail("ddp_device_ids") == {"device_ids": [0], "output_device": 0}
    assert emulated.detail("syncbn_ddp_check") == {"sync_batchnorm_layers": 1}
    assert dist.is_nccl_available()


def test_histc_of_integer_tensors_counts_as_cuda_does(emulated):
    """CUDA's histc takes integer tensors (per-class pixel counts in segmentation metrics); the CPU's raises
    "histogram_cpu" not implemented for 'Long' — a crash of a public segmentation recipe that only the emulation
    produced. Counted in float64 and returned in the input's dtype; floating inputs are untouched."""
    classes = torch.tensor([0, 2, 2, 1, 2], device="cuda")
    counts = torch.histc(classes, bins=3, min=0, max=2)
    assert counts.dtype == torch.int64 and counts.tolist() == [1, 1, 3]
    assert classes.histc(bins=3, min=0, max=2).tolist() == [1, 1, 3]
    floats = torch.histc(classes.float(), bins=3, min=0, max=2)
    assert floats.dtype == torch.float32 and floats.tolist() == [1.0, 1.0, 3.0]
    assert emulated.detail("integer_histc") == {"dtype": "int64"}


def test_nccl_flat_gather_buffers_run_on_the_gloo_group_that_replaced_nccl(emulated, tmp_path):
    """Accelerate gathers into a flat buffer of world × numel (NCCL takes any shape of that size); gloo insists on
    the stacked shape and raised "invalid tensor size" in the script's own gather — the emulation's limit, which
    a probe reported as the script's crash. On the nccl group the emulation moved to gloo the flat buffer is viewed
    in gloo's shape (the result lands in it, as on NCCL); a buffer of the wrong size still raises."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        preds = torch.arange(8.0, device="cuda").view(8, 1)
        flat = torch.empty(8, device="cuda")
        dist.all_gather_into_tensor(flat, preds)
        torch.testing.assert_close(flat, torch.arange(8.0))
        with pytest.raises(RuntimeError):
            dist.all_gather_into_tensor(torch.empty(7), preds)
    finally:
        dist.destroy_process_group()
    assert emulated.detail("flat_collective") == {"shape": [8], "viewed_as": [8, 1]}


def test_a_gloo_group_the_script_chose_keeps_gloos_shape_rule(emulated, tmp_path):
    """A script that asked for gloo itself gets gloo as it is: the same flat buffer raises there without emulation."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="invalid tensor size"):
            dist.all_gather_into_tensor(torch.empty(8), torch.arange(8.0).view(8, 1))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("requested", "used"),
    [(None, "gloo"), ("nccl", "gloo"), ("NCCL", "gloo"), ("cpu:gloo,cuda:nccl", "gloo"), ("cuda:nccl", "gloo"),
     ("cpu:mpi,cuda:nccl", "mpi"), ("gloo", "gloo"), ("mpi", "mpi"), ("undefined", "gloo")],
)  # fmt: skip
def test_backend_mapping(requested, used):
    assert str(emu._gloo_for(requested)) == used


def test_data_parallel_splits_the_batch_over_replicas_like_on_gpus(emulated):
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    wrapped = nn.DataParallel(inner, device_ids=[0, 1])
    assert wrapped.module is inner and wrapped.device_ids == [0, 1] and wrapped.output_device == 0
    assert emulated.detail("data_parallel") == {"device_ids": [0, 1], "replicas": 2}
    x = torch.randn(10, 3, device="cuda")
    out = wrapped(x)
    # each replica normalises its own chunk (5 samples), then the outputs are concatenated
    expected = torch.cat([nn.functional.batch_norm(inner[0](c), None, None, inner[1].weight, inner[1].bias,
                                                   training=True) for c in x.chunk(2)])
    torch.testing.assert_close(out, expected)
    # only replica 0's chunk updates the module's running statistics (on GPUs replica 0 shares its buffers)
    chunk0 = inner[0](x[:5]).detach()
    torch.testing.assert_close(inner[1].running_mean, 0.1 * chunk0.mean(0))
    assert int(inner[1].num_batches_tracked) == 1
    # gradients of every replica reach the shared parameters
    inner.zero_grad()
    wrapped(x).sum().backward()
    reference = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    reference.load_state_dict(inner.state_dict())
    sum(reference(c).sum() for c in x.chunk(2)).backward()
    torch.testing.assert_close(inner[0].weight.grad, reference[0].weight.grad)


def test_data_parallel_scatters_and_gathers_structures(emulated):
    class Pair(nn.Module):
        def forward(self, x, scale=1.0, extra=None):
            return {"y": x * scale, "n": x.sum() * 0 + x.shape[0]}

    wrapped = nn.DataParallel(Pair())
    x = torch.arange(6.0).view(3, 2)
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        out = wrapped(x, scale=2.0)
    torch.testing.assert_close(out["y"], x * 2)
    assert out["n"].tolist() == [2.0, 1.0]  # chunk() of 3 rows over 2 devices: 2 + 1
    single = nn.DataParallel(nn.Linear(2, 2), device_ids=[0])
    assert single(x).shape == (3, 2)


# ---------------------------------------------------------------------------------------------------------------
# Notifications, install / undo


def test_notify_once_per_kind_and_its_errors_never_reach_the_script():
    calls: list[str] = []

    def broken(what: str, detail: dict) -> None:
        calls.append(what)
        raise ValueError("recorder bug")

    undo = install_cuda_emulation(1, notify=broken)
    try:
        torch.zeros(1, device="cuda")
        torch.ones(1).cuda()
        json.dumps(torch.ones(1).to("cuda:0").tolist())
    finally:
        undo()
    assert calls == ["cuda_device"]


def _snapshot() -> dict[str, dict[str, object]]:
    import torch.cuda.memory
    import torch.cuda.nvtx
    import torch.cuda.random
    import torch.cuda.streams
    from torch.amp import autocast_mode, grad_scaler
    from torch.utils._device import DeviceContext

    namespaces = {
        "torch": torch, "torch.cuda": torch.cuda, "torch.cuda.memory": torch.cuda.memory,
        "torch.cuda.random": torch.cuda.random, "torch.cuda.streams": torch.cuda.streams,
        "torch.cuda.nvtx": torch.cuda.nvtx, "torch.distributed": dist,
        "distributed_c10d": dist.distributed_c10d, "torch.amp": torch.amp, "autocast_mode": autocast_mode,
        "torch.serialization": torch.serialization, "Tensor": torch.Tensor, "Module": nn.Module,
        "DDP": nn.parallel.DistributedDataParallel, "SyncBatchNorm": nn.SyncBatchNorm,
        "DataParallel": nn.DataParallel, "autocast": autocast_mode.autocast, "GradScaler": grad_scaler.GradScaler,
        "StorageBase": torch.storage._StorageBase, "Thread": threading.Thread, "DeviceContext": DeviceContext,
    }  # fmt: skip
    if HAS_ACCELERATOR:
        import torch.accelerator.memory

        namespaces["torch.accelerator"] = torch.accelerator
        namespaces["torch.accelerator.memory"] = torch.accelerator.memory
    snap = {name: {k: v for k, v in vars(ns).items() if k != "__warningregistry__"} for name, ns in namespaces.items()}
    snap["registry"] = dict(enumerate(torch.serialization._package_registry))
    return snap


def test_undo_restores_every_original_exactly():
    before = _snapshot()
    stack_before = torch._C._len_torch_function_stack()
    undo = install_cuda_emulation(2)
    during = _snapshot()
    changed = {(ns, k) for ns in before for k in before[ns].keys() | during[ns].keys()
               if before[ns].get(k, emu._MISSING) is not during[ns].get(k, emu._MISSING)}  # fmt: skip
    assert ("torch.cuda", "is_available") in changed and ("DDP", "__init__") in changed
    assert ("Tensor", "record_stream") in changed and ("registry", 1) in changed
    assert torch._C._len_torch_function_stack() == stack_before + 1
    with torch.device("cpu"):  # a mode the script pushed later stays on the stack
        undo()
        assert torch._C._len_torch_function_stack() == stack_before + 1
    undo()  # idempotent
    after = _snapshot()
    for ns in before:
        assert before[ns].keys() == after[ns].keys(), ns
        assert all(before[ns][k] is after[ns][k] for k in before[ns]), ns
    assert torch._C._len_torch_function_stack() == stack_before
    assert not torch.cuda.is_available() and not emulation_active()


def test_install_is_idempotent_and_validates_device_count():
    undo = install_cuda_emulation(2)
    try:
        assert install_cuda_emulation(4)() is None  # nested install: a no-op undo
        assert torch.cuda.device_count() == 2
    finally:
        undo()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            install_cuda_emulation(bad)


# ---------------------------------------------------------------------------------------------------------------
# Real 2-rank gloo runs of scripts written for GPUs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(script: Path, out_dir: Path) -> None:
    env = {**os.environ, "EMULATION_TEST_OUT": str(out_dir), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(FIXTURES / "run_emulated.py"), str(script)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_cuda_ddp_syncbn_amp_script_runs_unmodified_on_two_cpu_ranks(tmp_path):
    _run_two_ranks(FIXTURES / "train_cuda_ddp.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, res in enumerate(ranks):
        assert (res["rank"], res["world"], res["backend"]) == (r, 2, "gloo")
        assert res["device_count"] == 2 and res["current_device"] == r
        assert res["bn_types"] == ["SyncBatchNorm"]
        assert res["steps"] == 8 and len(res["losses"]) == 8  # 64 samples / 2 ranks / batch 8, 2 epochs
        assert all(0.5 < loss < 3.0 for loss in res["losses"])
        assert res["out_dtype"] == res["eval_dtype"] == "torch.bfloat16"  # float16 autocast runs as CPU bfloat16
        assert res["scale"] == 65536.0 and res["elapsed_ms"] > 0 and res["peak_memory"] == 0
        assert res["num_batches_tracked"] == 8 and res["reloaded_equal"]
        notes = dict(json.loads((tmp_path / f"notify_rank{r}.json").read_text()))
        assert notes["nccl_to_gloo"]["dropped"] == [f"device_id=cuda:{r}"]
        assert notes["ddp_device_ids"] == {"device_ids": [r], "output_device": r}
        assert notes["map_location"] == {"map_location": f"cuda:{r}", "used": "cpu"}
        assert notes["autocast_cuda"] == {"dtype": "torch.float16", "used": "torch.bfloat16"}
        assert {"sync_batchnorm", "syncbn_ddp_check", "grad_scaler", "pin_memory", "cuda_rng"} <= notes.keys()
    # Different data per rank, yet DDP keeps replicas identical and SyncBN keeps identical statistics.
    assert ranks[0]["losses"] != ranks[1]["losses"]
    assert ranks[0]["params_digest"] == ranks[1]["params_digest"]
    assert ranks[0]["running_mean"] == ranks[1]["running_mean"]
    assert ranks[0]["running_var"] == ranks[1]["running_var"]
    assert ranks[0]["running_var"] != [1.0] * 8


@pytest.mark.slow
def test_emulated_syncbn_step_equals_single_process_bn_on_the_global_batch(tmp_path):
    script = FIXTURES / "syncbn_step.py"
    _run_two_ranks(script, tmp_path)
    fx = runpy.run_path(str(script), run_name="syncbn_fixture")
    ranks = [torch.load(tmp_path / f"syncbn_rank{r}.pt") for r in (0, 1)]

    reference = fx["build_model"]()
    optimizer = torch.optim.SGD(reference.parameters(), lr=fx["LR"])
    x, target = fx["global_batch"]()
    out_before = reference(x)
    fx["loss_fn"](out_before, target, 1).backward()
    optimizer.step()
    out_after = reference(x)

    tol = {"rtol": 2e-5, "atol": 2e-5}
    torch.testing.assert_close(torch.cat([r["out_before"] for r in ranks]), out_before.detach(), **tol)
    torch.testing.assert_close(torch.cat([r["out_after"] for r in ranks]), out_after.detach(), **tol)
    for name, value in reference.state_dict().items():
        for r in ranks:
            torch.testing.assert_close(r["state"][name], value, **tol, msg=name)
    assert reference.state_dict()["4.num_batches_tracked"].item() == 2
    # The comparison can fail: per-rank (local) BN on the first shard is far from the global-batch result.
    local = fx["build_model"]()(x[: fx["SHARDS"][0]])
    assert (local - out_before[: fx["SHARDS"][0]]).abs().max().item() > 1e-2
