"""The rule catalog: the one place where every ddpdoctor code is defined and documented.

`ddpdoctor rules`, `ddpdoctor explain`, the README rule table and SARIF `tool.driver.rules` are all generated
from `RULES`. Codes are stable forever; a retired code is never reused.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpdoctor.findings import Severity


@dataclass(frozen=True, kw_only=True)
class Rule:
    code: str
    name: str
    severity: Severity
    summary: str
    static: bool
    probe: bool
    what: str
    why: str
    example: str
    fix: str

    @property
    def category(self) -> str:
        return {
            "1": "setup",
            "2": "batchnorm",
            "3": "data",
            "4": "optimisation",
            "5": "checkpoints",
            "9": "probe",
        }[self.code[2]]

    def documentation(self) -> str:
        """The four-part documentation as plain text (also SARIF `help.text`)."""
        return (
            f"{self.code} {self.name} ({self.severity.label})\n\n"
            f"What it detects\n{self.what}\n\n"
            f"Why it hurts accuracy\n{self.why}\n\n"
            f"Example\n{self.example}\n\n"
            f"Fix\n{self.fix}\n"
        )



RULES: tuple[Rule, ...] = (
    Rule(
        code="DD101",
        name="sync-bn-after-ddp",
        severity=Severity.MEDIUM,
        summary="convert_sync_batchnorm applied to a model after it was wrapped in DDP; the probe reports whether the layers really sync on this torch",
        static=True,
        probe=True,
        what="convert_sync_batchnorm applied to a model after it was wrapped in DDP; the probe reports whether the layers really sync on this torch",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD102",
        name="forward-bypasses-ddp",
        severity=Severity.CRITICAL,
        summary="training forward runs through the unwrapped module; DDP forward never runs while steps happen",
        static=True,
        probe=True,
        what="training forward runs through the unwrapped module; DDP forward never runs while steps happen",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD103",
        name="replicas-diverged",
        severity=Severity.CRITICAL,
        summary="parameters differ across ranks after optimizer steps (digest compare)",
        static=False,
        probe=True,
        what="parameters differ across ranks after optimizer steps (digest compare)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD104",
        name="hardcoded-rank",
        severity=Severity.CRITICAL,
        summary="init_process_group with a literal rank (or literal world_size) that cannot differ per process",
        static=True,
        probe=True,
        what="init_process_group with a literal rank (or literal world_size) that cannot differ per process",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD105",
        name="device-not-bound",
        severity=Severity.HIGH,
        summary="CUDA DDP without set_device/device_ids per local rank; ranks share one device",
        static=True,
        probe=True,
        what="CUDA DDP without set_device/device_ids per local rank; ranks share one device",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD106",
        name="data-parallel",
        severity=Severity.MEDIUM,
        summary="nn.DataParallel used (single process; BN statistics from replica 0 only)",
        static=True,
        probe=True,
        what="nn.DataParallel used (single process; BN statistics from replica 0 only)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD107",
        name="moved-after-wrap",
        severity=Severity.MEDIUM,
        summary=".to()/.cuda() on the model after DDP wrapping",
        static=True,
        probe=False,
        what=".to()/.cuda() on the model after DDP wrapping",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD108",
        name="legacy-local-rank-arg",
        severity=Severity.MEDIUM,
        summary="--local_rank argument without LOCAL_RANK fallback (torchrun does not pass it)",
        static=True,
        probe=True,
        what="--local_rank argument without LOCAL_RANK fallback (torchrun does not pass it)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD109",
        name="single-node-world-size",
        severity=Severity.LOW,
        summary="world size taken from torch.cuda.device_count(): correct on one node only",
        static=True,
        probe=False,
        what="world size taken from torch.cuda.device_count(): correct on one node only",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD201",
        name="bn-stats-diverge",
        severity=Severity.MEDIUM,
        summary="local BN running stats differ across ranks at the end (broadcast_buffers=False)",
        static=False,
        probe=True,
        what="local BN running stats differ across ranks at the end (broadcast_buffers=False)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD202",
        name="small-bn-batch",
        severity=Severity.MEDIUM,
        summary="local BN normalises over a per-rank batch below 16 samples",
        static=False,
        probe=True,
        what="local BN normalises over a per-rank batch below 16 samples",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD203",
        name="non-iid-shards",
        severity=Severity.HIGH,
        summary="per-rank BN input statistics differ beyond i.i.d. sampling noise (scipy test, p < 1e-3)",
        static=False,
        probe=True,
        what="per-rank BN input statistics differ beyond i.i.d. sampling noise (scipy test, p < 1e-3)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD204",
        name="syncbn-large-batch",
        severity=Severity.LOW,
        summary="SyncBN over a per-rank batch already >= 32: no statistical gain, lost BN noise (ghost-BN regularisation) — a known reason SyncBN runs score lower",
        static=False,
        probe=True,
        what="SyncBN over a per-rank batch already >= 32: no statistical gain, lost BN noise (ghost-BN regularisation) — a known reason SyncBN runs score lower",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD205",
        name="syncbn-needs-cuda",
        severity=Severity.INFO,
        summary="SyncBatchNorm with a CPU/gloo setup raises in plain PyTorch",
        static=True,
        probe=True,
        what="SyncBatchNorm with a CPU/gloo setup raises in plain PyTorch",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD206",
        name="collective-on-subset",
        severity=Severity.HIGH,
        summary="DDP/SyncBN training-mode forward or a collective inside a rank-conditional branch (hang)",
        static=True,
        probe=True,
        what="DDP/SyncBN training-mode forward or a collective inside a rank-conditional branch (hang)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD207",
        name="eval-in-train-mode",
        severity=Severity.MEDIUM,
        summary="evaluation forward (no_grad) with BN layers in training mode: stats polluted, SyncBN syncs",
        static=True,
        probe=True,
        what="evaluation forward (no_grad) with BN layers in training mode: stats polluted, SyncBN syncs",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD301",
        name="sampler-not-reshuffled",
        severity=Severity.HIGH,
        summary="DistributedSampler(shuffle=True) whose order repeats across epochs (set_epoch missing/constant)",
        static=True,
        probe=True,
        what="DistributedSampler(shuffle=True) whose order repeats across epochs (set_epoch missing/constant)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD302",
        name="missing-distributed-sampler",
        severity=Severity.HIGH,
        summary="ranks iterate overlapping samples (no DistributedSampler or equivalent sharding)",
        static=True,
        probe=True,
        what="ranks iterate overlapping samples (no DistributedSampler or equivalent sharding)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD303",
        name="eval-sampler-padding",
        severity=Severity.LOW,
        summary="DistributedSampler on evaluation data pads duplicates (len % world != 0)",
        static=True,
        probe=True,
        what="DistributedSampler on evaluation data pads duplicates (len % world != 0)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD304",
        name="identical-rng-streams",
        severity=Severity.LOW,
        summary="augmentation/dropout random streams identical on every rank",
        static=False,
        probe=True,
        what="augmentation/dropout random streams identical on every rank",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD305",
        name="dataset-differs-across-ranks",
        severity=Severity.HIGH,
        summary="the same index yields different samples on different ranks (unseeded synthetic data, per-rank files)",
        static=False,
        probe=True,
        what="the same index yields different samples on different ranks (unseeded synthetic data, per-rank files)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD306",
        name="uneven-batches",
        severity=Severity.MEDIUM,
        summary="ranks run different numbers of batches or batch sizes (hang risk, biased BN)",
        static=False,
        probe=True,
        what="ranks run different numbers of batches or batch sizes (hang risk, biased BN)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD401",
        name="lr-not-scaled",
        severity=Severity.HIGH,
        summary="lr does not follow the global batch vs the reference recipe (linear/sqrt rule)",
        static=True,
        probe=True,
        what="lr does not follow the global batch vs the reference recipe (linear/sqrt rule)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD402",
        name="no-warmup",
        severity=Severity.LOW,
        summary="lr scaled up by >= 4x with no warmup schedule",
        static=True,
        probe=True,
        what="lr scaled up by >= 4x with no warmup schedule",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD403",
        name="accumulation-without-no-sync",
        severity=Severity.LOW,
        summary="gradient accumulation all-reduces on every micro-step",
        static=True,
        probe=True,
        what="gradient accumulation all-reduces on every micro-step",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD404",
        name="grads-reduced-twice",
        severity=Severity.HIGH,
        summary="gradients all-reduced by hand on top of DDP",
        static=True,
        probe=True,
        what="gradients all-reduced by hand on top of DDP",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD405",
        name="no-learning-signal",
        severity=Severity.HIGH,
        summary="all gradients exactly zero, or loss constant, across the probe's steps",
        static=False,
        probe=True,
        what="all gradients exactly zero, or loss constant, across the probe's steps",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD406",
        name="non-finite",
        severity=Severity.HIGH,
        summary="NaN/Inf in loss, gradients or BN running_var",
        static=False,
        probe=True,
        what="NaN/Inf in loss, gradients or BN running_var",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD501",
        name="module-prefix-checkpoint",
        severity=Severity.MEDIUM,
        summary="checkpoint saved from the DDP wrapper (keys start with \"module.\")",
        static=True,
        probe=True,
        what="checkpoint saved from the DDP wrapper (keys start with \"module.\")",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD502",
        name="save-on-every-rank",
        severity=Severity.LOW,
        summary="torch.save reached by every rank (or by local rank 0 of every node)",
        static=True,
        probe=True,
        what="torch.save reached by every rank (or by local rank 0 of every node)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD503",
        name="non-strict-load",
        severity=Severity.MEDIUM,
        summary="load_state_dict(strict=False) where keys mismatch (silently skipped weights)",
        static=True,
        probe=True,
        what="load_state_dict(strict=False) where keys mismatch (silently skipped weights)",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD504",
        name="unreduced-metric",
        severity=Severity.LOW,
        summary="evaluation metric computed per rank and reported without a reduction",
        static=True,
        probe=False,
        what="evaluation metric computed per rank and reported without a reduction",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD901",
        name="probe-hang",
        severity=Severity.CRITICAL,
        summary="ranks stopped making progress; per-rank Python stacks and the pending collective in evidence",
        static=False,
        probe=True,
        what="ranks stopped making progress; per-rank Python stacks and the pending collective in evidence",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD902",
        name="rank-failed",
        severity=Severity.CRITICAL,
        summary="a rank raised or died; exception text and traceback in evidence",
        static=False,
        probe=True,
        what="a rank raised or died; exception text and traceback in evidence",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
    Rule(
        code="DD903",
        name="not-distributed",
        severity=Severity.INFO,
        summary="the script never initialised a process group / never built DDP",
        static=False,
        probe=True,
        what="the script never initialised a process group / never built DDP",
        why="TODO",
        example="TODO",
        fix="TODO",
    ),
)


_BY_CODE = {r.code: r for r in RULES}


def get_rule(code: str) -> Rule:
    """The rule for a code (case-insensitive); KeyError for an unknown code."""
    try:
        return _BY_CODE[code.strip().upper()]
    except KeyError:
        raise KeyError(f"unknown rule code {code!r}") from None


def select_codes(patterns: list[str] | tuple[str, ...]) -> set[str]:
    """Codes matched by prefix patterns (`DD3` = all data rules). Raises ValueError on a pattern matching none."""
    chosen: set[str] = set()
    for pat in patterns:
        p = pat.strip().upper()
        if not p:
            continue
        hits = {c for c in _BY_CODE if c.startswith(p)}
        if not hits:
            raise ValueError(f"unknown rule or prefix {pat!r}")
        chosen |= hits
    return chosen
