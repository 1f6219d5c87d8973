"""One recorder for every recorded run of fixtures/runs/ (the analysis, replay and golden-report tests read them):

    .venv/bin/python -m ddpdoctor.dev.record [NAME ...]     # e.g. demo probe_forward_bypass bn_iid_default
    .venv/bin/python -m ddpdoctor.dev.record --list         # every run it records, with its command

Each run is `ddpdoctor check SCRIPT --keep-run fixtures/runs/NAME --format json --output /dev/null ARGS`, run from
the repository root: 2 gloo ranks on this machine, the script unmodified. `RECORDINGS` is the one table of what each
run is: the probe runs (`probe_*`, the demo's run, the porting styles), the BatchNorm runs (`bn_*`), the data,
optimisation and checkpoint runs (`data_*`, `optim_*`, `ckpt_*`) and the measurement runs (`measured_*`, one per
script of fixtures/measured/). Re-record after changing what the probe writes (ddpdoctor/events.py), check the
replay tests (they pin the measured numbers), then regenerate the golden reports (CONTRIBUTING.md). The triage
run (fixtures/runs/triage_fused_act) is a `ddpdoctor triage --keep-run` directory, not a check run: it is not here.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from ddpdoctor.dev.evidence import MEASURED_FIXTURES, REPO, RUNS

SCRATCH = "{scratch}"  # in a run's arguments: a fresh temporary directory (a checkpoint script's output folder)

# probe runs: fixtures/probe/NAME.py -> fixtures/runs/probe_NAME, with these check arguments
_PROBE: dict[str, tuple[str, ...]] = {
    "missing_set_epoch": (),
    "no_distributed_sampler": (),
    "forward_bypass": (),
    "unscaled_lr": ("--base-lr", "0.1", "--base-batch", "16"),
    "hardcoded_rank": (),
    "legacy_local_rank": (),
    "self_spawn": (),
    "cuda_syncbn_correct": (),
    "cuda_syncbn_after_wrap": (),
    "rank_raises": ("--timeout", "60"),
    "collective_mismatch": ("--timeout", "60"),
    "stuck_collective": ("--timeout", "15"),
    "slow_steps": ("--timeout", "10"),  # still training when the timeout hits: not a hang
    "not_distributed": (),
    "model_not_wrapped": ("--", "--no-accel"),
    "grads_averaged_by_hand": (),
    "device_not_bound": (),
    "device_bound": (),
    "momentum_encoder": (),
    "local_rank_from_helper": (),
    "small_bn_batch_uniform_data": (),
    "lr_set_in_loop": (),
    "warmup_in_loop": (),
    "precise_bn": (),
    "legacy_local_rank_minus_one": (),
    "legacy_local_rank_env_fallback": (),
    "legacy_local_rank_device_from_rank": (),
    "shuffle_bn": (),
}
_BN = "fixtures/probe/bn/"
_CPU = ("--device", "cpu", "--nproc", "2")
# run -> (script, check arguments): the runs whose script is not fixtures/probe/NAME.py
_OTHER: dict[str, tuple[str, tuple[str, ...]]] = {
    "demo": ("fixtures/demo/train.py", ("--base-lr", "0.1", "--base-batch", "32")),  # as `make demo` runs it
    "probe_momentum_encoder_eval_bug": ("fixtures/probe/momentum_encoder.py", ("--", "--eval-bug")),
    # the styles of issue 13 (apex and Horovod through ddpdoctor's stand-ins); their checkpoints are deleted after
    "styles_dataparallel_bad": ("fixtures/styles/dataparallel/bad.py", ()),
    "styles_dataparallel_good": ("fixtures/styles/dataparallel/good.py", ()),
    "styles_apex_bad": ("fixtures/styles/apex/bad.py", ()),
    "styles_horovod_bad": ("fixtures/styles/horovod/bad.py", ()),
    # BatchNorm (tests/test_analyses_bn.py says what each shows; the hangs run until their 15 s timeout)
    "bn_iid_default": (_BN + "train_bn.py", (*_CPU, "--timeout", "60")),
    "bn_noniid_small": (_BN + "train_bn.py", (*_CPU, "--timeout", "60", "--", "--batch-size", "8", "--shard",
                                              "contiguous")),
    "bn_no_broadcast": (_BN + "train_bn.py", (*_CPU, "--timeout", "60", "--", "--no-broadcast-buffers")),
    "bn_eval_train_mode": (_BN + "train_bn.py", (*_CPU, "--timeout", "60", "--", "--eval", "train-mode")),
    "bn_eval_correct": (_BN + "train_bn.py", (*_CPU, "--timeout", "60", "--", "--eval", "correct")),
    "bn_syncbn_large": (_BN + "syncbn_large.py", (*_CPU, "--timeout", "60")),
    "bn_syncbn_cpu": (_BN + "train_bn.py", (*_CPU, "--timeout", "60", "--", "--cpu", "--sync-bn", "--batch-size",
                                            "8")),
    "bn_rank0_eval_hang": (_BN + "final_eval.py", (*_CPU, "--timeout", "15", "--", "--final-eval", "rank0")),
    "bn_uneven_hang": (_BN + "final_eval.py", (*_CPU, "--timeout", "15", "--", "--uneven")),
    # data, optimisation, checkpoints (tests/test_analyses_{data,optim,ckpt}.py replay them)
    **{f"data_{name}": (f"fixtures/probe/data/{name}.py", (*_CPU, "--timeout", "600")) for name in (
        "sampler_helper", "sampler_seed_per_rank", "seeded_augment", "synthetic_unseeded", "uneven_shards")},
    "optim_accumulate_hand_reduce": ("fixtures/probe/optim/accumulate_hand_reduce.py",
                                     (*_CPU, "--timeout", "600", "--base-lr", "0.1", "--base-batch", "8")),
    "optim_good_accumulate": ("fixtures/probe/optim/good_accumulate.py",
                              (*_CPU, "--timeout", "600", "--base-lr", "0.1", "--base-batch", "8")),
    "optim_zero_loss": ("fixtures/probe/optim/zero_loss.py", (*_CPU, "--timeout", "600")),
    "optim_corrupt_sample": ("fixtures/probe/optim/corrupt_sample.py", (*_CPU, "--timeout", "600")),
    **{f"ckpt_{name}": (f"fixtures/probe/ckpt/{name}.py", (*_CPU, "--timeout", "600", "--", SCRATCH))
       for name in ("save_every_rank", "save_rank0")},
    # an evaluation metric (tests/test_analyses_metric.py replays it)
    "metric_eval_unreduced_train_loss_reduced": ("fixtures/probe/metrics/eval_unreduced_train_loss_reduced.py", ()),
}
# the measurement scripts of fixtures/measured/ (tests/test_measured.py): arguments for the few that need some
_MEASURED_ARGS: dict[str, tuple[str, ...]] = {
    "dd401_optimizer_branch_taken": ("--base-lr", "0.1", "--base-batch", "8"),
}
# files the style and measurement fixtures save in the working directory (the repository root while recording)
STRAY = ("dataparallel_bad.pt", "dataparallel_good.pt", "apex_bad.pt", "horovod_bad.pt",
         "measured_dd502_checkpoint.pt")


def recordings() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every recorded run: name -> (script, `ddpdoctor check` arguments)."""
    out = {f"probe_{name}": (f"fixtures/probe/{name}.py", args) for name, args in _PROBE.items()}
    out.update(_OTHER)
    for path in sorted(MEASURED_FIXTURES.glob("*.py")):
        out[f"measured_{path.stem}"] = (str(path.relative_to(REPO)), _MEASURED_ARGS.get(path.stem, ()))
    return dict(sorted(out.items()))


def command(name: str, scratch: str = SCRATCH) -> list[str]:
    script, args = recordings()[name]
    return ["check", script, "--keep-run", str((RUNS / name).relative_to(REPO)), "--format", "json",
            "--output", os.devnull, *(scratch if a == SCRATCH else a for a in args)]


def record(name: str) -> None:
    from ddpdoctor.cli import main as cli

    shutil.rmtree(RUNS / name, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-record-") as scratch:
        cli(command(name, scratch))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known = recordings()
    if argv == ["--list"]:
        for name in known:
            print(f"{name}: ddpdoctor {' '.join(command(name))}")
        return 0
    unknown = [n for n in argv if n not in known]
    if unknown:
        sys.stderr.write(f"record: error: no recorded run {', '.join(unknown)} (--list names them)\n")
        return 2
    os.chdir(REPO)
    try:
        for name in argv or list(known):
            record(name)
            print(f"recorded {(RUNS / name).relative_to(REPO)}")
    finally:
        for stray in STRAY:
            (REPO / stray).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
