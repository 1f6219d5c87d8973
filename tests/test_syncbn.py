"""`sync_batch_norm_forward` over real gloo ranks equals plain batch norm on the concatenated global batch.

One `torch.multiprocessing.spawn` of 2 ranks runs every case (start-up dominates: each rank imports torch); the
ranks save what they computed and the test process compares it with a single-process `nn.BatchNorm{1,2,3}d` on
the concatenated batch. Tolerances (max-abs difference relative to the reference's max-abs value):
float32 1e-5 for outputs and running stats, 5e-5 for gradients (docs/facts.md#syncbatchnorm-on-cpu: 1.1e-5
worst, weight grad; measured here: <= 5e-7); float64 1e-12; bfloat16 input 1e-2 (one bfloat16 ulp of the output).
Inputs offset by 1000 carry 1000x less relative precision, so their outputs and gradients get 20x the tolerance
(measured: 2.2e-5 float32, 8.6e-13 float64); their running stats keep the plain one.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from ddpdoctor.bn.syncbn import local_batch_norm_forward, sync_batch_norm_forward

STEPS = 3
# one xdist worker runs this module (`make test` runs two): its 2-rank SyncBN run is made once, by a
# module-scoped fixture, for all the tests that read it (spread over two workers, it was made on each)
pytestmark = pytest.mark.xdist_group("syncbn")


@dataclass(frozen=True)
class Case:
    name: str
    dims: int  # 1, 2 or 3 -> BatchNorm1d/2d/3d
    sizes: tuple[int, ...]  # per-rank batch sizes
    channels: int = 4
    spatial: tuple[int, ...] = ()
    momentum: float | None = 0.1
    affine: bool = True
    track: bool = True
    offset: float = 0.0
    dtype: torch.dtype = torch.float32
    input_dtype: torch.dtype | None = None  # bfloat16 input into a float32 module
    sync_class: bool = False  # use nn.SyncBatchNorm (the probe's case) instead of BatchNormNd


CASES = (
    Case("2d-even", 2, (4, 4), spatial=(3, 3)),
    Case("2d-uneven-3-5", 2, (3, 5), spatial=(3, 3)),
    Case("2d-uneven-1-7", 2, (1, 7), spatial=(2, 2)),
    Case("2d-empty-rank", 2, (0, 6), spatial=(3, 3)),
    Case("1d-flat-uneven", 1, (3, 5)),
    Case("1d-seq-1-7", 1, (1, 7), spatial=(5,)),
    Case("3d-uneven", 3, (2, 3), spatial=(2, 3, 2)),
    Case("2d-cma", 2, (3, 5), spatial=(3, 3), momentum=None),
    Case("2d-no-affine", 2, (3, 5), spatial=(3, 3), affine=False),
    Case("2d-no-tracking", 2, (3, 5), spatial=(3, 3), track=False),
    Case("2d-offset-1000", 2, (3, 5), spatial=(4, 4), offset=1000.0),
    Case("2d-float64", 2, (3, 5), spatial=(3, 3), dtype=torch.float64),
    Case("2d-float64-offset", 2, (1, 7), spatial=(3, 3), dtype=torch.float64, offset=1000.0, momentum=None),
    Case("2d-bf16-input", 2, (3, 5), spatial=(3, 3), input_dtype=torch.bfloat16),
    Case("syncbn-class", 2, (3, 5), spatial=(3, 3), sync_class=True),
)


def _make_module(case: Case, seed: int) -> nn.Module:
    cls = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[case.dims]
    if case.sync_class:
        cls = nn.SyncBatchNorm
    m = cls(case.channels, momentum=case.momentum, affine=case.affine, track_running_stats=case.track)
    m = m.to(case.dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if case.affine:
            m.weight.copy_(1 + 0.2 * torch.randn(case.channels, generator=g, dtype=case.dtype))
            m.bias.copy_(0.2 * torch.randn(case.channels, generator=g, dtype=case.dtype))
        if case.track:
            m.running_mean.copy_(0.1 * torch.randn(case.channels, generator=g, dtype=case.dtype))
            m.running_var.copy_(1 + 0.1 * torch.rand(case.channels, generator=g, dtype=case.dtype))
    return m


def _step_data(case: Case, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch and the upstream gradient of one step, identical in every process."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    shape = (sum(case.sizes), case.channels, *case.spatial)
    # per-channel scale and shift so channels differ, plus the case's offset
    scale = 0.5 + torch.rand(case.channels, generator=g, dtype=case.dtype)
    shift = torch.randn(case.channels, generator=g, dtype=case.dtype)
    view = (1, case.channels, *([1] * len(case.spatial)))
    x = torch.randn(shape, generator=g, dtype=case.dtype) * scale.view(view) + shift.view(view) + case.offset
    dy = torch.randn(shape, generator=g, dtype=case.dtype)
    input_dtype = case.input_dtype or case.dtype
    return x.to(input_dtype), dy.to(input_dtype)


def _eval_input(case: Case, seed: int) -> torch.Tensor:
    x, _ = _step_data(case, seed, 99)
    return x


def _run_case(case: Case, seed: int, rank: int | None, forward) -> dict:
    """Train STEPS forwards+backwards, then one eval forward; `rank=None` means the whole global batch."""
    module = _make_module(case, seed)
    lo = 0 if rank is None else sum(case.sizes[:rank])
    hi = sum(case.sizes) if rank is None else lo + case.sizes[rank]
    out: dict = {"steps": []}
    module.train()
    for step in range(STEPS):
        x_full, dy_full = _step_data(case, seed, step)
        x = x_full[lo:hi].clone().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        y = forward(module, x)
        (y * dy_full[lo:hi]).sum().backward()
        out["steps"].append(
            {
                "y": y.detach().clone(),
                "dx": x.grad.clone() if x.grad is not None else torch.zeros_like(x),
                "dw": None if module.weight is None or module.weight.grad is None else module.weight.grad.clone(),
                "db": None if module.bias is None or module.bias.grad is None else module.bias.grad.clone(),
            }
        )
    if case.track:
        out["running_mean"] = module.running_mean.clone()
        out["running_var"] = module.running_var.clone()
        out["num_batches_tracked"] = int(module.num_batches_tracked)
    module.eval()
    with torch.no_grad():
        out["eval"] = forward(module, _eval_input(case, seed)[lo:hi]).clone()
    return out


DDP_STEPS = 3
DDP_BATCH = 4  # per rank


def _ddp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)
    ).double()


def _ddp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = 3 + 2 * torch.randn(2 * DDP_BATCH, 3, 5, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (2 * DDP_BATCH,), generator=g)
    return x, y


def _train(model: nn.Module, rank: int | None) -> dict[str, torch.Tensor]:
    """Plain SGD on cross-entropy (by hand: importing torch.optim costs a second); rank=None trains on the whole
    global batch in one process."""
    params = list(model.parameters())
    for step in range(DDP_STEPS):
        x, y = _ddp_batch(step)
        if rank is not None:
            x, y = x[rank * DDP_BATCH : (rank + 1) * DDP_BATCH], y[rank * DDP_BATCH : (rank + 1) * DDP_BATCH]
        for p in params:
            p.grad = None
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in params:
                p -= 0.5 * p.grad
    module = model.module if hasattr(model, "module") else model
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _ddp_training(rank: int) -> dict[str, torch.Tensor]:
    """SyncBN inside a real DDP training loop: its backward all-reduce interleaves with DDP's bucket all-reduces."""
    import types

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _ddp_model()
    model[1].forward = types.MethodType(sync_batch_norm_forward, model[1])
    return _train(DDP(model), rank)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results = {}
        for i, case in enumerate(CASES):
            results[case.name] = _run_case(case, i, rank, sync_batch_norm_forward)
        # a nn.SyncBatchNorm with its own process_group attribute, and an explicit group argument
        group = dist.new_group([0, 1])
        case = CASES[1]
        results["explicit-group"] = _run_case(
            case, 1, rank, lambda m, x: sync_batch_norm_forward(m, x, process_group=group)
        )
        results["ddp"] = _ddp_training(rank)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    out_dir = tmp_path_factory.mktemp("syncbn")
    mp.spawn(_worker, args=(2, _free_port(), str(out_dir)), nprocs=2, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a = a.double()
    ref = ref.double()
    denom = ref.abs().max().item() if ref.numel() else 0.0
    diff = (a - ref).abs().max().item() if ref.numel() else 0.0
    return diff / max(denom, 1e-30)


def _tolerances(case: Case, key: str) -> float:
    grad = key[:2] in ("dx", "dw", "db")
    if case.input_dtype is torch.bfloat16:
        return 2e-2 if grad else 1e-2
    # Inputs offset by 1000 carry 1000x less precision relative to their spread (float32 spacing at 1000 is
    # 6.1e-5): the reference's own x - mean is only that exact, whatever we do. Running stats stay exact.
    offset_factor = 20.0 if case.offset and not key.startswith("running") else 1.0
    if case.dtype is torch.float64:
        return 1e-12 * offset_factor
    return (5e-5 if grad else 1e-5) * offset_factor


def _compare(case: Case, seed: int, ranks: list[dict]) -> dict[str, float]:
    ref = _run_case(case, seed, None, lambda m, x: m(x))
    errors: dict[str, float] = {}
    for step in range(STEPS):
        r = ref["steps"][step]
        parts = [rk["steps"][step] for rk in ranks]
        errors[f"y{step}"] = _rel(torch.cat([p["y"] for p in parts]), r["y"])
        errors[f"dx{step}"] = _rel(torch.cat([p["dx"] for p in parts]), r["dx"])
        if case.affine:
            errors[f"dw{step}"] = _rel(sum(p["dw"] for p in parts), r["dw"])
            errors[f"db{step}"] = _rel(sum(p["db"] for p in parts), r["db"])
        else:
            assert all(p["dw"] is None and p["db"] is None for p in parts)
    if case.track:
        for rk in ranks:
            errors["running_mean"] = max(errors.get("running_mean", 0.0), _rel(rk["running_mean"], ref["running_mean"]))
            errors["running_var"] = max(errors.get("running_var", 0.0), _rel(rk["running_var"], ref["running_var"]))
            assert rk["num_batches_tracked"] == ref["num_batches_tracked"] == STEPS
    if case.track:
        errors["eval"] = _rel(torch.cat([rk["eval"] for rk in ranks]), ref["eval"])
    else:
        # eval without running stats normalises with each rank's own batch and never communicates (as PyTorch)
        x = _eval_input(case, seed)
        lo = 0
        for size, rk in zip(case.sizes, ranks):
            if size:
                local = _make_module(case, seed).eval()
                errors["eval"] = max(errors.get("eval", 0.0), _rel(rk["eval"], local(x[lo : lo + size])))
            lo += size
    for key, err in errors.items():
        tol = _tolerances(case, key)
        assert err <= tol, f"{case.name}: {key} relative error {err:.3g} > {tol:g}"
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_matches_single_process_batch_norm(rank_results, index):
    case = CASES[index]
    errors = _compare(case, index, [rk[case.name] for rk in rank_results])
    # the comparison is not vacuous: training changed the running stats and the outputs are normalised
    if case.track:
        assert not torch.allclose(rank_results[0][case.name]["running_var"], _make_module(case, index).running_var)
    assert set(errors) >= {"y0", "dx0", "eval"}


@pytest.mark.slow
def test_explicit_process_group(rank_results):
    _compare(CASES[1], 1, [rk["explicit-group"] for rk in rank_results])


@pytest.mark.slow
def test_ranks_really_synchronised(rank_results):
    """Guard against a silent fallback to local BN: the ranks' running stats agree with each other and differ
    from what rank 0's batch alone would give."""
    case = CASES[1]  # sizes (3, 5)
    r0, r1 = (rk[case.name] for rk in rank_results)
    assert torch.equal(r0["running_var"], r1["running_var"])
    local = _make_module(case, 1)
    for step in range(STEPS):
        x_full, _ = _step_data(case, 1, step)
        local(x_full[:3])
    assert _rel(r0["running_var"], local.running_var) > 1e-2


@pytest.mark.slow
def test_ddp_training_with_syncbn_equals_one_process_on_the_global_batch(rank_results):
    """DDP averages gradients of per-rank mean losses; with SyncBN that is the gradient of the global-batch loss,
    so three SGD steps land on the same weights and running stats as one process (float64: 1e-10)."""
    ref = _train(_ddp_model(), None)
    for rk in rank_results:
        for key, value in ref.items():
            got = rk["ddp"][key]
            if value.is_floating_point():
                assert _rel(got, value) < 1e-10, key
            else:
                assert torch.equal(got, value), key
    assert not torch.allclose(ref["1.running_var"], torch.ones(4, dtype=torch.float64))


def test_naive_sum_of_squares_would_fail_on_offset_inputs():
    """Why Chan's formula: with inputs offset by 1000 the textbook E[x^2]-E[x]^2 in float32 loses the variance."""
    g = torch.Generator().manual_seed(0)
    x = 1000 + torch.randn(8, 4, 4, 4, generator=g)
    n = x.numel() / x.size(1)
    naive = (x.pow(2).sum((0, 2, 3)) / n) - (x.sum((0, 2, 3)) / n) ** 2
    exact = x.double().var((0, 2, 3), unbiased=False)
    assert ((naive.double() - exact).abs() / exact).max() > 1e-2


def test_without_process_group_it_is_plain_batch_norm():
    """No initialised process group: the same numbers as the module's own forward, buffers included."""
    case = Case("plain", 2, (6,), spatial=(3, 3), momentum=None)
    ours = _run_case(case, 3, None, sync_batch_norm_forward)
    ref = _run_case(case, 3, None, lambda m, x: m(x))
    for step in range(STEPS):
        for key in ("y", "dx", "dw", "db"):
            assert torch.equal(ours["steps"][step][key], ref["steps"][step][key])
    assert torch.equal(ours["running_var"], ref["running_var"])
    assert ours["num_batches_tracked"] == ref["num_batches_tracked"] == STEPS
    local = _run_case(case, 3, None, local_batch_norm_forward)
    assert torch.equal(local["running_mean"], ref["running_mean"])


def test_input_checks_match_pytorch():
    bn2 = nn.BatchNorm2d(3)
    with pytest.raises(ValueError, match="expected 4D input"):
        sync_batch_norm_forward(bn2, torch.randn(2, 3))
    sbn = nn.SyncBatchNorm(3)
    with pytest.raises(ValueError, match="at least 2D"):
        sync_batch_norm_forward(sbn, torch.randn(3))
