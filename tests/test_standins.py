"""ddpdoctor's Horovod and apex stand-ins: found only when the real package is not importable, and faithful to the
originals' semantics on 2 real gloo ranks (fixtures/standins/semantics.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpdoctor.probe import launch_env
from ddpdoctor.probe.plan import plan_launch
from ddpdoctor.probe.settings import ProbeSettings
from ddpdoctor.probe.standins import StandinFinder, install_finder, remove_finder, why_standing_in

ROOT = Path(__file__).resolve().parents[1]
# one xdist worker runs this module (`make test` runs two): its 2-rank run of the stand-ins is made once, by a
# module-scoped fixture, for all the tests that read it (spread over two workers, it was made on each)
pytestmark = pytest.mark.xdist_group("standins")


@pytest.fixture
def clean_imports(monkeypatch):
    """Run an import test with the finder installed and no horovod/apex module cached; restore both after."""
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("horovod", "apex")}
    for k in saved:
        del sys.modules[k]
    install_finder()
    yield
    remove_finder()
    for k in [k for k in sys.modules if k.split(".")[0] in ("horovod", "apex")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_finder_serves_the_standin_when_the_package_is_missing(clean_imports) -> None:
    import horovod.torch as hvd

    assert Path(hvd.__file__).is_relative_to(ROOT / "ddpdoctor" / "probe" / "standins")
    assert hvd.__name__ == "horovod.torch"
    from horovod.torch.mpi_ops import Average, Sum  # the original module layout

    assert (Average, Sum) == (0, 1)
    assert why_standing_in("horovod") == "not installed"


def test_finder_defers_to_an_installed_package(clean_imports, tmp_path, monkeypatch) -> None:
    real = tmp_path / "horovod"
    (real / "torch").mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    (real / "torch" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import horovod.torch as hvd

    assert hvd.REAL and Path(hvd.__file__).is_relative_to(tmp_path)


def test_an_installed_apex_without_parallel_is_the_users_and_fails_as_it_does_for_them(
    clean_imports, tmp_path, monkeypatch
) -> None:
    """NVIDIA apex after it removed apex.parallel (or the unrelated PyPI `apex`): the user's environment imports
    `apex`, so the stand-in never papers over it; `apex.parallel` fails as on the user's machine (DD902 in a run)."""
    installed = tmp_path / "apex"
    (installed / "normalization").mkdir(parents=True)
    (installed / "__init__.py").write_text("INSTALLED = True\n")
    (installed / "normalization" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    import apex

    assert apex.INSTALLED and not hasattr(apex, "parallel")
    with pytest.raises(ImportError):
        from apex import parallel  # noqa: F401
    assert StandinFinder().find_spec("apex") is None


def test_a_librarys_optional_import_never_gets_the_standin(clean_imports, tmp_path, monkeypatch) -> None:
    """`try: import apex` in an installed library (site-packages) sees what the user's environment gives it: no
    apex. The script's own import of the same package, when it uses it, gets the stand-in."""
    lib = tmp_path / "site-packages" / "optlib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text(
        "try:\n    import apex\n    HAS_APEX = True\nexcept ImportError:\n    HAS_APEX = False\n"
    )
    monkeypatch.syspath_prepend(str(lib.parent))
    import optlib

    assert optlib.HAS_APEX is False and "apex" not in sys.modules
    monkeypatch.delitem(sys.modules, "optlib")
    from apex import parallel  # the test file is user code

    assert hasattr(parallel, "DistributedDataParallel")


def test_finder_defers_to_nvidia_apex(clean_imports, tmp_path, monkeypatch) -> None:
    real = tmp_path / "apex"
    (real / "parallel").mkdir(parents=True)
    (real / "__init__.py").write_text("NVIDIA = True\n")
    (real / "parallel" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    import apex

    assert apex.NVIDIA
    assert StandinFinder().find_spec("apex") is None


@pytest.fixture
def saved_environ():
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_horovod_scripts_get_horovodruns_environment(monkeypatch, saved_environ) -> None:
    plan = plan_launch("import horovod.torch as hvd\nhvd.init()\n")
    assert plan.launcher == "horovodrun" and plan.mode == "torchrun" and "horovodrun" in plan.reason
    assert plan_launch("from horovod import torch as hvd\n").launcher == "horovodrun"
    assert plan_launch("import torch.distributed as dist\ndist.init_process_group('nccl')\n").launcher == "torchrun"
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    for key, value in torchrun.items():
        monkeypatch.setenv(key, value)
    done = launch_env.apply(ProbeSettings(run_dir="/nonexistent", launcher="horovodrun", rendezvous_port=1234))
    import os

    assert done is not None and set(done["removed"]) == set(torchrun)
    assert {k: os.environ[k] for k in launch_env.HOROVOD_VARIABLES} == {
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": "localhost"}
    assert os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "1234"
    assert not any(k in os.environ for k in torchrun)


@pytest.fixture(scope="module")
def semantics(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("standins")
    proc = subprocess.run([sys.executable, str(ROOT / "fixtures" / "standins" / "semantics.py"), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_horovod_collectives_follow_horovod(semantics) -> None:
    h0, h1 = semantics[0]["hvd"], semantics[1]["hvd"]
    assert (h0["size"], h1["rank"], h1["local_rank"], h0["local_size"], h0["cross_size"]) == (2, 1, 1, 2, 1)
    # allreduce returns a new tensor (average by default) and leaves its argument alone; allreduce_ is in place
    assert h0["allreduce"] == [1.5, 1.0] and h1["allreduce"] == [1.5, 2.0]
    assert h0["allreduce_"] == [1.5, True]
    assert h0["allreduce_sum"] == h0["allreduce_avg_false"] == 3.0
    assert "supersedes average" in h0["op_and_average"]
    assert h0["allreduce_int_avg"] == 3  # integers: scaled in floating point, truncated
    assert h0["allreduce_prescale"] == 6.0 and h0["allreduce_max"] == 1.0
    assert h0["fp16"] == pytest.approx(0.8333, abs=1e-3) and h0["fp16"] != pytest.approx(5 / 6, abs=1e-6)
    assert "contiguous" in h0["noncontiguous"]
    assert h0["allgather"] == h1["allgather"] == [0.0, 1.0, 1.0]  # uneven first dimensions
    assert h0["broadcast"] == h1["broadcast"] == 10.0
    # Horovod's gradients: allreduce → allreduce of the gradient; broadcast/allgather → the average
    assert h0["allreduce_grad"] == 2.0
    assert (h0["broadcast_grad"], h1["broadcast_grad"]) == (1.5, 0.0)
    assert h1["allgather_grad"] == [4.0, 4.0]
    assert h0["broadcast_object"] == {"r": 1} and h0["allgather_object"] == [0, 10]


@pytest.mark.slow
def test_horovod_broadcasts_and_optimizer_follow_horovod(semantics) -> None:
    h0, h1 = semantics[0]["hvd"], semantics[1]["hvd"]
    assert h0["bcast_weight"] == h1["bcast_weight"]
    assert h0["bcast_running_mean"] == h1["bcast_running_mean"] == 0.0  # a state_dict carries the buffers
    assert "invalid params of type" in h0["bcast_generator"]
    assert h1["opt_lr_after_broadcast"] == 0.1 and h0["opt_state_entries"] == 6
    # a new optimizer of a subclass of the wrapped one's class, built from its param_groups (state not carried)
    assert h0["dopt_class"] == ["SGD", True, False, 0]
    assert "zero_grad() was called after loss.backward()" in h0["zero_grad_after_backward"]
    assert "more than backward_passes_per_step" in h0["two_backwards"]
    assert h0["averaged_grad"] == h1["averaged_grad"] == pytest.approx((h0["local_grad"] + h1["local_grad"]) / 2)
    assert h0["step_after_synchronize_warns"]
    assert h0["bpps2_grad"] == 4.0  # summed locally over the passes, averaged across ranks
    assert h0["unused_param_grads"] == h1["unused_param_grads"] == [0.5, 0.5]  # the other rank's zero takes part
    assert "one or more model parameters were not named" in h0["unnamed"]


@pytest.mark.slow
def test_horovod_syncbn_uses_the_global_batch(semantics) -> None:
    for r in (0, 1):
        h = semantics[r]["hvd"]
        assert h["syncbn_cpu"] == "SyncBatchNorm expected input tensor to be on GPU"
        assert h["syncbn_max_err"] < 1e-5 and h["syncbn_running_var_err"] < 1e-5


@pytest.mark.slow
def test_apex_follows_apex(semantics) -> None:
    a0, a1 = semantics[0]["apex"], semantics[1]["apex"]
    assert "expected torch.cuda.FloatTensor" in a0["amp_cpu_params"]
    # convert_syncbn_model clones weight/bias (the optimizer keeps the old ones) and shares the running stats
    assert a0["convert"] == ["SyncBatchNorm", False, True, False]
    # apex DDP broadcasts parameters but never buffers
    assert a0["ddp_param_broadcast"] == a1["ddp_param_broadcast"]
    assert (a0["ddp_buffer_kept"], a1["ddp_buffer_kept"]) == (0.0, 1.0)
    assert "apex.parallel.DistributedDataParallel" in a0["amp_after_ddp"]
    assert a0["scaled_loss_ratio"] == 65536.0
    assert a0["grad"] == a1["grad"]
    assert a0["overflow_step_skipped"] and a0["scale_after_overflow"] == 32768.0
    assert a0["state_dict_key"] == "module.0.weight"
    assert a0["reducer_grad"] == a1["reducer_grad"] == 1.5
