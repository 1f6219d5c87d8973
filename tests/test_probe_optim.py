"""The optimisation-health recorder (ddpdoctor/probe/recorders/optim_health.py): in this process on a real
one-rank gloo group, and the real probe on 2 CPU ranks over fixtures/probe/optim/ (recorded as fixtures/runs/optim_*/
by `python -m ddpdoctor.dev.record`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "fixtures" / "runs"


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[Any]:
    """A probe in this process with the optimizer and optimisation-health recorders installed (undone after)."""
    from ddpdoctor.probe.recorders import ddp, optim_health, optimizer
    from ddpdoctor.probe.session import Probe
    from ddpdoctor.probe.settings import ProbeSettings

    p = Probe(ProbeSettings(run_dir=str(tmp_path), epochs=0, steps=0), role="rank")
    try:
        for install in (optim_health.install, ddp.install, optimizer.install):
            install(p)
        yield p
    finally:
        p.patcher.undo()


def events(probe: Any, kind: str) -> list[dict[str, Any]]:
    path = probe.writer.path
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_losses_backward_counts_and_gradients_per_step(probe: Any) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 3)
    for _ in range(2):
        for _micro in range(3):  # accumulation without DDP: plain backwards
            loss = model(x).pow(2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
    steps = events(probe, "train_step")
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["backwards"] for s in steps] == [3, 3]
    assert [s["plain_backwards"] for s in steps] == [3, 3]
    assert steps[0]["syncing_backwards"] == 0
    assert len(steps[0]["losses"]) == 3
    value, hexbits = steps[0]["losses"][0]
    assert float.fromhex(hexbits) == value > 0
    assert steps[0]["grads"]["params"] == 2 and steps[0]["grads"]["zero"] == 0 and steps[0]["grads"]["none"] == 0
    assert steps[0]["grads"]["norm"] > 0
    assert steps[0]["backward_site"]["file"] == __file__


def test_zero_loss_gives_exactly_zero_gradients(probe: Any) -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(torch.randn(4, 3))
    (nn.functional.mse_loss(out, out.detach()) * 0).backward()
    opt.step()
    (step,) = events(probe, "train_step")
    assert step["grads"]["zero"] == 2 and step["grads"]["max_abs"] == 0.0
    assert step["losses"] == [[0.0, "0x0.0p+0"]]


def test_non_finite_loss_gradients_and_parameters(probe: Any) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.tensor([[1.0, float("inf")], [2.0, 3.0]])
    loss = nn.MSELoss()(model(x), torch.zeros(2, 2))
    loss.backward()
    opt.step()
    found = {e["tensor"]: e for e in events(probe, "nonfinite")}
    assert set(found) >= {"loss", "grad", "param"}
    assert found["loss"]["step"] == 1 and found["loss"]["value"] == "nan"
    assert found["grad"]["count"] >= 1 and found["grad"]["total"] == 4
    assert {e["names"][0] for e in events(probe, "nonfinite") if e["tensor"] == "loss"} == {
        "output of the loss module", "loss passed to backward()"}


def test_ddp_accumulation_and_hand_reduction_are_seen(probe: Any, one_rank_group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    with model.no_sync():
        model(x).sum().backward()
    model(x).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2
    metric = torch.ones(1)
    dist.all_reduce(metric)  # not a gradient: not recorded
    opt.step()
    (step,) = events(probe, "train_step")
    assert step["backwards"] == 2 and step["syncing_backwards"] == 1 and step["nosync_backwards"] == 1
    hand = step["hand_reduced"]
    assert hand["params"] == 2 and hand["numel"] == 8 and hand["ops"] == ["all_reduce"] and hand["after_ddp"] == 2
    assert hand["ratio_median"] == pytest.approx(0.5)  # one rank: SUM leaves it, the division halves it
    calls = events(probe, "grad_collective")
    assert [c["param"] for c in calls] == ["weight", "bias"]
    assert all(c["after_ddp"] and c["step"] == 1 for c in calls)
    assert calls[0]["site"]["file"] == __file__


def test_freed_gradient_memory_is_not_a_gradient(probe: Any, one_rank_group: None) -> None:
    """The demo's false DD404: zero_grad() frees the gradients and the allocator hands their memory to the next
    tensor of that size (SyncBN's per-channel sums, a logged loss). Here the old gradient itself is kept alive, so
    a tensor sits at a freed gradient's address with its size for sure; it is not the parameter's .grad any more."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for _ in range(2):
        out = model(x).sum()
        dist.all_reduce(torch.ones(1))  # a logged metric, while last step's gradients are alive
        old = [p.grad for p in model.parameters()]
        opt.zero_grad()  # set_to_none: the parameters let go of them
        for t in old:
            if t is not None:
                dist.all_reduce(t)  # same address and size as a gradient a moment ago
        out.backward()
        opt.step()
    assert events(probe, "grad_collective") == []
    assert [s["hand_reduced"] for s in events(probe, "train_step")] == [None, None]


def test_hand_reduction_of_views_and_flat_buffers(probe: Any, one_rank_group: None) -> None:
    """A tensor that shares memory with a gradient is that gradient: a slice of it, gradients that are views of
    DDP's buckets (gradient_as_bucket_view=True), a flat buffer the script made the gradients views of."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    x = torch.randn(4, 3)
    model = DDP(nn.Linear(3, 2), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight, bias = model.module.weight, model.module.bias
    model(x).sum().backward()
    model(x).sum().backward()  # second backward: the gradients are views into DDP's bucket now
    assert bias.grad.untyped_storage().data_ptr() == weight.grad.untyped_storage().data_ptr()
    dist.all_reduce(bias.grad[1:])  # a slice of a bucket view: bias only, not its bucket neighbour
    opt.step()

    model = DDP(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = torch.zeros(8)
    model.module.weight.grad, model.module.bias.grad = flat[:6].view(2, 3), flat[6:]
    model(x).sum().backward()  # DDP copies its result into the existing (view) gradients
    assert model.module.bias.grad.data_ptr() == flat[6:].data_ptr()
    dist.all_reduce(flat)
    opt.step()

    first, second = events(probe, "train_step")
    assert first["hand_reduced"]["params"] == 1 and first["hand_reduced"]["numel"] == 2
    assert second["hand_reduced"]["params"] == 2 and second["hand_reduced"]["numel"] == 8
    assert second["hand_reduced"]["ratio_median"] == pytest.approx(1.0)  # one rank: SUM is the identity
    calls = events(probe, "grad_collective")
    assert [(c["param"], c["numel"], c["step"]) for c in calls] == [("bias", 1, 1), ("weight", 8, 2)]


def test_only_a_collective_the_script_calls_is_a_hand_reduction(probe: Any, one_rank_group: None) -> None:
    """The direct caller decides, not the innermost user frame: ddpdoctor's SyncBatchNorm all-reduces under the
    script's loss.backward(), which is no hand reduction. A function compiled as if it lived in
    ddpdoctor/bn/syncbn.py stands for such library code here (with the real SyncBN the tensor is never a
    gradient, and the address coincidence is the allocator's choice). The process-group recorder's wrapper sits
    outside this recorder's, as in a real run: it is skipped, not taken for the caller."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpdoctor.bn import syncbn
    from ddpdoctor.probe.recorders import process_group

    process_group.install(probe)
    library: dict[str, Any] = {}
    exec(compile("import torch.distributed as dist\n\ndef reduce(t):\n    dist.all_reduce(t)\n",
                 syncbn.__file__, "exec"), library)

    def user_reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t)

    model = DDP(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    library["reduce"](model.module.weight.grad)
    opt.step()
    assert events(probe, "grad_collective") == []
    user_reduce(model.module.bias.grad)
    opt.step()
    (call,) = events(probe, "grad_collective")
    assert call["param"] == "bias"
    assert call["site"]["file"] == __file__ and call["site"]["function"] == "user_reduce"
    assert [c["site"]["function"] for c in events(probe, "collective")] == ["user_reduce"]


def test_ddp_comm_hooks_are_ddps_own_reduction(probe: Any, one_rank_group: None) -> None:
    """Communication hooks reduce DDP's bucket, which with gradient_as_bucket_view=True is the gradients'
    memory: torch's built-in hook (called from torch) and a script's own hook (called from user code) are DDP's
    reduction, not a second one. A hand all_reduce after them still counts."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    def my_hook(state, bucket):  # unannotated: under `from __future__ import annotations` DDP rejects a str one
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])

    torch.manual_seed(0)
    for hook in (default_hooks.allreduce_hook, my_hook):
        model = DDP(nn.Linear(3, 2), gradient_as_bucket_view=True)
        model.register_comm_hook(None, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 3)
        for _ in range(3):  # from the second backward on, the bucket is the gradients' storage
            opt.zero_grad(set_to_none=False)
            model(x).sum().backward()
            opt.step()
    assert events(probe, "grad_collective") == []
    assert all(s["hand_reduced"] is None for s in events(probe, "train_step"))

    dist.all_reduce(model.module.weight.grad)
    opt.step()
    assert [c["param"] for c in events(probe, "grad_collective")] == ["weight"]


# ------------------------------------------------------------------------------------------------ the real probe

OPTIM_FIXTURES = {
    # fixture: (options, rules the probe must report, rules it must not)
    "accumulate_hand_reduce": (
        {"base_lr": 0.1, "base_batch": 8}, {"DD402", "DD403", "DD404"}, {"DD401", "DD405", "DD406"}
    ),
    "good_accumulate": (
        {"base_lr": 0.1, "base_batch": 8}, set(), {"DD401", "DD402", "DD403", "DD404", "DD405", "DD406"}
    ),
    "zero_loss": ({}, {"DD405"}, {"DD403", "DD404", "DD406"}),
    "corrupt_sample": ({}, {"DD406"}, {"DD403", "DD404", "DD405"}),
}
LIVE = {"accumulate_hand_reduce"}  # recorded runs replay the others (tests/test_analyses_optim.py)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIM_FIXTURES))
def test_probe_finds_the_optimisation_rules(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpdoctor.check import run_check
    from ddpdoctor.config import CheckConfig

    if name not in LIVE:
        pytest.skip("replayed from fixtures/runs (recorded by python -m ddpdoctor.dev.record)")
    options, fire, silent = OPTIM_FIXTURES[name]
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    report = run_check(CheckConfig(script=Path(f"fixtures/probe/optim/{name}.py"), device="cpu", nproc=2,
                                   timeout=600, keep_run=run_dir, **options))
    probe_rules = {f.rule for f in report.findings if "probe" in f.sources}
    assert fire <= probe_rules, report.to_json()["findings"]
    assert not (silent & probe_rules), report.to_json()["findings"]


@pytest.mark.slow
def test_syncbn_backward_all_reduce_is_no_hand_reduction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's false DD404, end to end: a correct CUDA-style SyncBatchNorm script whose SyncBN backward sums
    land in freshly freed gradient memory (the recorder that matched addresses reported DD404 in 5 of 5 runs)."""
    from ddpdoctor.check import run_check
    from ddpdoctor.config import CheckConfig
    from ddpdoctor.rundata import read_run

    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    report = run_check(CheckConfig(script=Path("fixtures/probe/optim/cuda_syncbn_zero_grad_late.py"), device="cpu",
                                   nproc=2, timeout=600, keep_run=run_dir))
    assert [f.rule for f in report.findings] == [], report.to_json()["findings"]
    run = read_run(run_dir)
    ranks = run.rank_processes
    assert sorted(ranks) == [0, 1]
    for log in ranks.values():
        assert log.of("grad_collective") == [] and log.of("internal_error") == []
        steps = log.of("train_step")
        assert len(steps) == 8  # 2 epochs x 4 steps, each a DDP-synchronising backward through 2 SyncBN layers
        assert all(s["syncing_backwards"] == 1 and s["hand_reduced"] is None for s in steps)
        assert any(e["what"] == "sync_batchnorm" for e in log.of("emulation"))
        own = [e for e in log.of("collective") if not e.get("implicit")]
        assert len(own) == 8  # the script's own all_reduce of the logged loss, seen as such
        # and DDP's broadcast of rank 0's buffers before each forward, recorded as torch's, not the script's
        assert all(e["implicit"] == "ddp_buffers" and e["op"] == "broadcast"
                   for e in log.of("collective") if e.get("implicit"))


def test_two_ddp_models_each_reduce_once(probe: Any, one_rank_group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    generator, critic = DDP(nn.Linear(3, 3)), DDP(nn.Linear(3, 1))
    opt = torch.optim.SGD([*generator.parameters(), *critic.parameters()], lr=0.1)
    x = torch.randn(4, 3)
    generator(x).sum().backward()
    critic(x).sum().backward()
    opt.step()
    (step,) = events(probe, "train_step")
    assert step["syncing_backwards"] == 2 and step["max_syncs_per_ddp"] == 1
