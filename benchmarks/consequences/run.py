"""The measured accuracy cost of each defect: scikit-learn's digits, the MLP of `train.py`, real DDP over gloo.

    pip install 'ddpdoctor[bench]'                                  # scikit-learn: digits ships inside it
    nice -n 10 .venv/bin/python benchmarks/consequences/run.py      # every row, 5 seeds; writes the data file
    .venv/bin/python benchmarks/consequences/run.py --only DD202 --seeds 3 --no-write   # a look at one rule

For each row: the single-process recipe (baseline), the defect injected into the shared training script and its
fixed twin (the same script, differing by exactly the fix), each over the same seeds. The cost of a defect is the
twin's mean test accuracy minus the defect's, in percentage points; its significance is Welch's two-sided t-test
(defect vs twin, unequal variances). With 5 seeds per arm such a test detects, at 80% power, only a gap of about
two standard deviations of the arms: every row states that smallest detectable gap, so "not significant" is read
as "smaller than that", never as "no cost".

The result goes to `ddpdoctor/data/consequences.json` (the one place; `ddpdoctor explain DDxxx` and the README
table are rendered from it by `ddpdoctor.consequences`), with the benchmark's wall time and the load average.
Each arm runs in a persistent group of ranks (torch.multiprocessing spawn, gloo on 127.0.0.1, a free port), one
thread per rank; runs already measured with the same configuration are reused within the benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from train import INSTALL_HINT, Config  # noqa: E402

DATA_FILE = ROOT / "ddpdoctor" / "data" / "consequences.json"

PORT = Config()  # the correct 2-rank port: 2 x 32 = the recipe's 64, lr 0.1, DistributedSampler, per-rank BN
RECIPE = Config(world=1, batch=64)
SMALL = dict(lr=0.025, epochs=3)  # the batch-16 recipe (lr scaled linearly from 0.1 at 64), 3 epochs of 70 steps
FINETUNE = dict(finetune=True, lr=0.01, epochs=1, batch=4)  # a pretrained net, frozen BN, small per-rank batch


@dataclass(frozen=True)
class Row:
    rules: tuple[str, ...]
    defect_text: str  # what the defect arm does
    fix_text: str  # what its twin does instead
    defect: Config
    twin: Config
    baseline: Config | None = None  # default: the twin on one process with the global batch, no conversion
    note: str = ""  # the setting's point, shown with the row
    primary: bool = True  # the row `explain` leads with (one per rule)
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return "/".join(self.rules)

    def baseline_config(self) -> Config:
        if self.baseline is not None:
            return self.baseline
        t = self.twin
        return Config(
            world=1, batch=t.world * t.batch, accum=t.accum, lr=t.lr, epochs=t.epochs, warmup_epochs=t.warmup_epochs,
            fused_act=t.fused_act, finetune=t.finetune,
        )


def setting(cfg: Config) -> str:
    text = f"{cfg.world} ranks x {cfg.batch}"
    if cfg.accum > 1:
        text += f" x {cfg.accum} accumulated"
    text += f" (global {cfg.global_batch}), lr {cfg.lr:g}, {cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''}"
    if cfg.warmup_epochs:
        text += f", {cfg.warmup_epochs:g} warmup"
    return text


ROWS: list[Row] = [
    Row(("DD101",), "convert_sync_batchnorm applied to the DDP wrapper", "converted before wrapping",
        PORT.with_(sync_bn="after"), PORT.with_(sync_bn="before"),
        note="torch 2.13: the late conversion still syncs (shared Parameters and buffers)"),
    Row(("DD102",), "the loop calls the inner module, not the DDP wrapper", "calls the wrapper",
        PORT.with_(bypass_ddp=True), PORT, note="rank 0's model is scored"),
    Row(("DD202",), "per-rank BatchNorm over 8 samples", "SyncBatchNorm over the global 16",
        PORT.with_(batch=8, **SMALL), PORT.with_(batch=8, sync_bn="before", **SMALL)),
    Row(("DD202",), "per-rank BatchNorm over 4 samples", "SyncBatchNorm over the global 16",
        PORT.with_(world=4, batch=4, **SMALL), PORT.with_(world=4, batch=4, sync_bn="before", **SMALL),
        primary=False, note="same global batch, twice the ranks"),
    Row(("DD204",), "SyncBatchNorm at 32 per rank", "per-rank BatchNorm",
        PORT.with_(sync_bn="before"), PORT),
    Row(("DD204",), "SyncBatchNorm at 32 per rank", "per-rank BatchNorm",
        PORT.with_(world=4, sync_bn="before", lr=0.2), PORT.with_(world=4, lr=0.2),
        primary=False, note="4 ranks: BN over 128 vs 32"),
    Row(("DD207",), "evaluation under no_grad without model.eval()", "model.eval() first",
        PORT.with_(eval_mode=False), PORT, note="per-epoch validation and the final test both in train mode"),
    Row(("DD208",), "BatchNormAct (fused ReLU) converted by torch's converter: the ReLUs are gone",
        "timm-style converter keeps SyncBatchNormAct",
        PORT.with_(fused_act=True, sync_bn="before", converter="torch"),
        PORT.with_(fused_act=True, sync_bn="before", converter="timm")),
    Row(("DD209",), "no-weight-decay set picked by isinstance(m, nn.BatchNorm1d) after SyncBN conversion",
        "isinstance(m, _BatchNorm)",
        PORT.with_(sync_bn="before", no_decay_exact_class=True), PORT.with_(sync_bn="before"),
        note="what the exact-class test selects here: the weight-decay exclusion (5e-4)"),
    Row(("DD210",), "a cloning converter drops the frozen state of pretrained BN (requires_grad, eval)",
        "the converter copies requires_grad and training",
        PORT.with_(sync_bn="before", converter="clone", clone_keeps_frozen=False, **FINETUNE),
        PORT.with_(sync_bn="before", converter="clone", **FINETUNE),
        note="fine-tuning the seed's recipe weights (fresh head) at 4 per rank"),
    Row(("DD216",), "optimizer built before an apex-style (cloning) SyncBN conversion", "optimizer built after",
        PORT.with_(sync_bn="before", converter="clone", optimizer_before_convert=True),
        PORT.with_(sync_bn="before", converter="clone")),
    Row(("DD301",), "no sampler.set_epoch(epoch)", "set_epoch every epoch", PORT.with_(set_epoch=False), PORT),
    Row(("DD302",), "no DistributedSampler: every rank shuffles the whole data set", "DistributedSampler",
        PORT.with_(dist_sampler=False), PORT, note="each epoch is N passes: twice the steps"),
    Row(("DD304",), "torch.manual_seed(seed) on every rank", "manual_seed(seed + rank)",
        PORT.with_(rank_seeds=False), PORT, note="augmentation: random 1-pixel shifts; dropout 0.2"),
    Row(("DD305",), "train/val split drawn per rank (rank-seeded generator)", "split with a fixed generator",
        PORT.with_(split_fixed=False), PORT),
    Row(("DD401",), "per-rank batch kept at the recipe's 64, lr 0.1 kept", "lr scaled linearly to 0.2",
        PORT.with_(batch=64), PORT.with_(batch=64, lr=0.2), baseline=RECIPE),
    Row(("DD401",), "per-rank batch kept at the recipe's 64, lr 0.1 kept",
        "lr scaled linearly to 0.4 (with warmup: 4x)",
        PORT.with_(world=4, batch=64), PORT.with_(world=4, batch=64, lr=0.4, warmup_epochs=3), baseline=RECIPE,
        primary=False, note="4 ranks: global 256"),
    Row(("DD402",), "lr scaled 4x (0.4) from the first step", "3 epochs of linear warmup from 0.1",
        PORT.with_(batch=128, lr=0.4), PORT.with_(batch=128, lr=0.4, warmup_epochs=3), baseline=RECIPE),
    Row(("DD403",), "gradient accumulation (2 micro-batches) all-reducing every micro-step",
        "non-final micro-steps under ddp.no_sync()",
        PORT.with_(batch=16, accum=2, no_sync=False), PORT.with_(batch=16, accum=2), baseline=RECIPE),
    Row(("DD501", "DD503"), "checkpoint saved from the wrapper (\"module.\" keys), loaded with strict=False",
        "ddp.module.state_dict(), loaded strictly",
        PORT.with_(ckpt_unwrapped=False, load_strict=False), PORT,
        note="the evaluation program scores the loaded network"),
]


# ---------------------------------------------------------------------------------------------------- running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pretrain_path(tmp: str, seed: int) -> str:
    return os.path.join(tmp, f"recipe-{seed}.pt")


def worker(rank: int, world: int, port: int, jobs: list, tmp: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import train as script

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        script.enable_cpu_syncbn()
    try:
        for cfg_dict, seed in jobs:
            cfg = Config(**cfg_dict)
            pretrained = torch.load(pretrain_path(tmp, seed)) if cfg.finetune else None
            save_to = pretrain_path(tmp, seed) if (world == 1 and cfg == RECIPE) else None
            t0 = time.perf_counter()
            acc = script.train(cfg, seed, rank, pretrained=pretrained, save_to=save_to)
            if rank == 0:
                with open(out, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"key": cfg.key(), "seed": seed, "acc": acc,
                                        "seconds": time.perf_counter() - t0}) + "\n")
    finally:
        if world > 1:
            dist.destroy_process_group()


def finished_runs(cache: Path) -> dict[tuple[str, int], float]:
    out = {}
    if cache.exists():
        for line in cache.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            out[(r["key"], r["seed"])] = r["acc"]
    return out


def run_all(configs: list[Config], seeds: list[int], cache: Path, parallel: int) -> dict[tuple[str, int], float]:
    """Every (config, seed) not in `cache` yet, in two phases (the fine-tuning arms start from the recipe's
    weights, so the recipe runs first); within a phase, each world size's runs are dealt over `parallel` groups
    of ranks that run at the same time."""
    import torch.multiprocessing as mp

    done = finished_runs(cache)
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-consequences-") as tmp:
        needs_recipe = any(c.finetune for c in configs)
        if needs_recipe and RECIPE not in configs:
            configs = [RECIPE, *configs]
        for phase in (False, True):
            contexts = []
            for world in sorted({c.world for c in configs}):
                # row by row (the groups share each configuration's seeds): an interrupted run leaves whole rows
                jobs = [(asdict(c), s) for c in configs if c.world == world and c.finetune == phase for s in seeds
                        if (c.key(), s) not in done or (c == RECIPE and needs_recipe)]
                chunks = [jobs[i::parallel] for i in range(parallel) if jobs[i::parallel]]
                for chunk in chunks:
                    print(f"{world} rank(s): {len(chunk)} runs", file=sys.stderr, flush=True)
                    contexts.append(mp.spawn(worker, args=(world, free_port(), chunk, tmp, str(cache)),
                                             nprocs=world, join=False))
            for ctx in contexts:
                while not ctx.join():
                    pass
            done = finished_runs(cache)
    return done


# ---------------------------------------------------------------------------------------------------- statistics


def summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "values": values}


def compare(defect: list[float], twin: list[float], alpha: float) -> dict:
    """Cost (twin - defect), its standard error, Welch's two-sided p, and the smallest gap this many seeds detect
    at 80% power (alpha two-sided, from the arms' pooled standard deviation)."""
    from scipy import stats

    n1, n2 = len(defect), len(twin)
    v1, v2 = statistics.variance(defect), statistics.variance(twin)
    cost = statistics.fmean(twin) - statistics.fmean(defect)
    se = math.sqrt(v1 / n1 + v2 / n2)
    if se == 0.0:
        p = 1.0 if cost == 0.0 else 0.0
    else:
        p = float(stats.ttest_ind(twin, defect, equal_var=False).pvalue)
    df = n1 + n2 - 2
    pooled = math.sqrt(((n1 - 1) * v1 + (n2 - 1) * v2) / df)
    mde = (stats.t.ppf(1 - alpha / 2, df) + stats.t.ppf(0.8, df)) * pooled * math.sqrt(1 / n1 + 1 / n2)
    return {"cost": cost, "cost_se": se, "p": p, "significant": p < alpha, "detectable": mde}


def write_readme(data: dict) -> None:
    """README's table between its markers, rendered from `data` (tests/test_consequences.py holds them equal)."""
    from ddpdoctor.consequences import README_BEGIN, README_END, render_markdown

    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_BEGIN}\n{render_markdown(data)}\n{README_END}{tail}", encoding="utf-8")
    print("wrote README.md's table", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="rule codes (rows naming one of them)")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave the data file alone")
    parser.add_argument("--cache", type=Path, help="JSON lines of finished runs (reused; default: a temp file)")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--parallel", type=int, default=2, help="groups of ranks at a time per world size")
    parser.add_argument("--second-settings", action="store_true",
                        help="also the rows at 4 ranks (DD202, DD204, DD401): the trend with the number of ranks")
    parser.add_argument("--no-run", action="store_true",
                        help="only the runs already in --cache: rows missing a run are left out (and named)")
    parser.add_argument("--readme", action="store_true",
                        help="only re-render README's table from the data file (no runs)")
    args = parser.parse_args(argv)
    if args.readme:
        write_readme(json.loads(DATA_FILE.read_text(encoding="utf-8")))
        return 0
    try:
        import scipy  # noqa: F401
        import sklearn  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2

    rows = [r for r in ROWS if (r.primary or args.second_settings) and (not args.only or set(r.rules) & set(args.only))]
    seeds = list(range(args.seeds))
    configs: list[Config] = []
    for r in rows:
        for c in (r.baseline_config(), r.defect, r.twin):
            if c not in configs:
                configs.append(c)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    own_cache = args.cache is None
    if args.no_run and own_cache:
        parser.error("--no-run needs --cache")
    cache = args.cache or Path(tempfile.mkstemp(prefix="ddpdoctor-consequences-", suffix=".jsonl")[1])
    try:
        done = finished_runs(cache) if args.no_run else run_all(configs, seeds, cache, args.parallel)
        run_seconds = sum(r["seconds"] for r in map(json.loads, cache.read_text(encoding="utf-8").splitlines()))
    finally:
        if own_cache:
            cache.unlink(missing_ok=True)
    wall = None if args.no_run else time.perf_counter() - t0
    load_after = os.getloadavg()
    unmeasured = [r for r in rows
                  if any((c.key(), s) not in done for c in (r.baseline_config(), r.defect, r.twin) for s in seeds)]
    rows = [r for r in rows if r not in unmeasured]

    import sklearn
    import torch

    out_rows = []
    for r in rows:
        acc = {arm: [done[(c.key(), s)] for s in seeds]
               for arm, c in (("baseline", r.baseline_config()), ("defect", r.defect), ("twin", r.twin))}
        entry = {
            "rules": list(r.rules), "label": r.label, "primary": r.primary,
            "defect_arm": r.defect_text, "twin_arm": r.fix_text, "note": r.note,
            "setting": setting(r.defect), "twin_setting": setting(r.twin),
            "baseline_setting": setting(r.baseline_config()),
            "baseline": summary(acc["baseline"]), "defect": summary(acc["defect"]), "twin": summary(acc["twin"]),
            "gap_to_baseline": statistics.fmean(acc["defect"]) - statistics.fmean(acc["baseline"]),
            **compare(acc["defect"], acc["twin"], args.alpha),
        }
        out_rows.append(entry)
    data = {
        "benchmark": "benchmarks/consequences/run.py",
        "dataset": "scikit-learn digits (1,797 8x8 images); a fixed stratified 30% test split (540 images) scores "
                   "every arm; the script splits the other 1,257 into train (90%) and validation (10%)",
        "model": "MLP 64-128-128-10, BatchNorm1d after each hidden linear layer, ReLU, dropout 0.2; SGD momentum "
                 "0.9, weight decay 5e-4 (not on BN), cosine schedule; augmentation: random 1-pixel shifts",
        "ddp": "real DDP on CPU ranks (gloo, 127.0.0.1); SyncBatchNorm as ddpdoctor's CUDA emulation runs it "
               "(ddpdoctor.bn.syncbn: exact global-batch statistics)",
        "cost": "twin mean - defect mean, test accuracy in percentage points; positive: the defect costs accuracy",
        "test": f"Welch's two-sided t-test, defect vs twin, alpha {args.alpha}; 'detectable' is the smallest gap "
                "these seeds detect at 80% power",
        "seeds": seeds,
        "versions": {"torch": torch.__version__, "scikit-learn": sklearn.__version__,
                     "python": platform.python_version()},
        "wall_s": None if wall is None else round(wall, 1),  # None: written from a cache of finished runs
        "run_seconds": round(run_seconds, 1),  # the runs' own wall times added up (groups overlap)
        "unmeasured_rows": [f"{r.label}: {setting(r.defect)}" for r in unmeasured],
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]},
        "cpus": os.cpu_count(),
        "rows": out_rows,
    }
    from ddpdoctor.consequences import render_markdown

    print(render_markdown(data))
    print(f"\nwall time {wall or 0:.0f} s (runs {run_seconds:.0f} s); load average before {load_before[0]:.1f}, "
          f"after {load_after[0]:.1f} ({os.cpu_count()} CPUs)")
    if not args.no_write:
        if args.only or (unmeasured and not args.no_run):
            print("--only or a failed row: not writing the data file (it holds every row)", file=sys.stderr)
        else:
            DATA_FILE.parent.mkdir(exist_ok=True)
            DATA_FILE.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
            print(f"wrote {DATA_FILE.relative_to(ROOT)}", file=sys.stderr)
            write_readme(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
