"""What every analysis needs from a recorded run: the events by rank, the settings, and how to name places.

Pure: reads `ddpdoctor.rundata.RunData`; no torch. `fmt_num`, `fmt_ranks` and `pct` are
`ddpdoctor.formatting`'s, re-exported for the analyses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

from ddpdoctor.errors import PEER_ERROR_MARKERS
from ddpdoctor.events import SOURCE_DIR
from ddpdoctor.findings import Clearance, Confidence, Finding, Measurement, Severity, new_finding
from ddpdoctor.formatting import fmt_num, fmt_ranks, pct
from ddpdoctor.records import LaunchEnd, LaunchMode, LaunchRecord
from ddpdoctor.rules import setting
from ddpdoctor.rundata import ProcessLog, RunData, read_text_bounded
from ddpdoctor.world import Place, place_from_env

__all__ = ["PEER_ERROR_MARKERS", "RunContext", "Settings", "fmt_num", "fmt_ranks", "pct"]

@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the analyses are told besides the events: the probe's limits and the single-process recipe, as the
    run recorded them (meta.json), each replaceable when the run is re-analysed (`ddpdoctor report --base-lr`)."""

    nproc: int = 2
    epochs: int = 2
    steps: int = 4
    base_lr: float | None = None
    base_batch: int | None = None
    lr_scaling: str = "auto"
    small_bn_batch: int = setting("small_bn_batch").default

    @classmethod
    def of_run(cls, meta: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> "Settings":
        """The recorded values (unset ones keep the defaults), then `overrides` (None values ignored). An override
        that is not a setting is a TypeError: a caller's typo must not pass silently."""
        names = {f.name for f in fields(cls)}
        unknown = set(overrides or ()) - names
        if unknown:
            raise TypeError(f"not an analysis setting: {', '.join(sorted(unknown))}")
        values = {k: meta[k] for k in names if meta.get(k) is not None}
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls(**values)


@dataclass
class RunContext:
    run: RunData
    settings: Settings
    script: str  # as the user gave it
    script_abs: str
    args: list[str]
    base_dir: Path
    notes: list[str] = field(default_factory=list)
    tables: dict[str, Any] = field(default_factory=dict)
    clearances: list[Clearance] = field(default_factory=list)
    # where each rule's probe half measured (or could not measure) the condition its static half suspects
    measurements: list[Measurement] = field(default_factory=list)
    # what several analyses derive once from the run (outcome.timeout_view, source texts)
    memo: dict[str, Any] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ places
    def path(self, file: str | None) -> str | None:
        """A recorded file path as the report shows it: the script as the user gave it, others relative to the
        user's working directory when inside it."""
        if not file:
            return None
        if os.path.isabs(file):
            if self.script_abs and os.path.normpath(file) == os.path.normpath(self.script_abs):
                return self.script
            try:
                rel = os.path.relpath(file, self.base_dir)
            except ValueError:
                return file
            return file if rel.startswith("..") else rel
        return file

    def where(self, site: dict[str, Any] | None) -> tuple[str | None, int | None]:
        if not site:
            return self.script, None
        return self.path(site.get("file")), site.get("line")

    def at(self, site: dict[str, Any] | None) -> str:
        file, line = self.where(site)
        if file is None:
            return "an unknown place"
        return f"{file}:{line}" if line else file

    # ------------------------------------------------------------------ source
    @property
    def snapshots(self) -> dict[str, Path]:
        """Recorded path (normalised) → the copy of that file kept in the run directory (meta.json `sources`)."""
        if "snapshots" not in self.memo:
            out: dict[str, Path] = {}
            for directory, meta in self.run.directories:  # one per node when the run was recorded per node
                root = (directory / SOURCE_DIR).resolve()
                sources = meta.get("sources")
                for recorded, rel in (sources.items() if isinstance(sources, dict) else ()):
                    copy = (directory / str(rel)).resolve()
                    if copy.is_relative_to(root) and copy.is_file():  # never outside the run's own source/
                        out.setdefault(os.path.normpath(str(recorded)), copy)
            self.memo["snapshots"] = out
        return self.memo["snapshots"]

    def source_file(self, file: str | None) -> Path | None:
        """The user source file a recorded path names, as this machine can read it: the copy kept in the run
        directory first (what the ranks ran, wherever the run is replayed), then the recorded path itself, then
        the same file relative to the recorded or the current working directory (runs recorded before copies
        were kept, replayed from another checkout)."""
        if not file or file.startswith("<"):
            return None
        copy = self.snapshots.get(os.path.normpath(file))
        if copy is not None:
            return copy
        candidates = [Path(file)]
        shown = self.path(file)
        if shown and not os.path.isabs(shown):
            candidates += [self.base_dir / shown, Path(shown)]
        return next((c for c in candidates if c.is_file()), None)

    def source_text(self, file: str | None) -> str | None:
        """The text of that file (see `source_file`), or None when no copy of it can be read. The one way
        analyses read user source."""
        path = self.source_file(file)
        if path is None:
            return None
        key = f"source:{path}"
        if key not in self.memo:
            try:
                self.memo[key] = read_text_bounded(path)
            except OSError:
                self.memo[key] = None
        return self.memo[key]

    def shown_sources(self) -> dict[str, Path]:
        """File as findings show it (`path`) → the copy kept in the run directory: where `ddpdoctor report` reads
        inline suppressions when the user's tree is not there."""
        out: dict[str, Path] = {}
        for recorded, copy in self.snapshots.items():
            shown = self.path(recorded)
            if shown:
                out.setdefault(shown, copy)
        return out

    # ------------------------------------------------------------------ ranks
    @property
    def ranks(self) -> dict[int, ProcessLog]:
        return self.run.rank_processes

    @property
    def world_size(self) -> int:
        sizes = [e.get("world_size") for _, e in self.run.events("pg_init") if e.get("ok")]
        sizes = [s for s in sizes if isinstance(s, int)]
        if sizes:
            return max(sizes)
        return len(self.ranks) or self.settings.nproc

    # ------------------------------------------------------------------ nodes
    def place(self, p: ProcessLog) -> Place:
        """Where a process sat in the launch, from the launcher variables it recorded (ddpdoctor.world)."""
        env = p.start.get("env")
        return place_from_env(env if isinstance(env, dict) else {})

    def node_of(self, p: ProcessLog) -> str:
        """The node a process ran on: the launcher's node index (torchrun's GROUP_RANK, SLURM_NODEID), else its
        host. Two "nodes" on one machine (two launchers, one host) are two nodes."""
        node = self.place(p).node
        return f"node {node}" if node is not None else f"host {p.host or p.start.get('host') or '?'}"

    @property
    def nodes(self) -> dict[str, list[int]]:
        """node → the ranks that ran on it, in node order."""
        out: dict[str, list[int]] = {}
        for r, p in self.ranks.items():
            out.setdefault(self.node_of(p), []).append(r)
        return dict(sorted(out.items(), key=lambda kv: min(kv[1])))

    def local_rank_of(self, p: ProcessLog) -> int | None:
        return self.place(p).local_rank

    @staticmethod
    def world_size_from_device_count(p: ProcessLog, begin: dict[str, Any]) -> bool:
        """The world size this process passed to init_process_group (and the probe replaced with the launcher's)
        equals torch.cuda.device_count() as the script saw it: DD109's measurement, not a literal (DD104)."""
        given = (begin.get("overridden") or {}).get("world_size")
        ready = p.first("torch_ready") or {}
        count = ready.get("device_count")
        return bool(given) and isinstance(count, int) and given[0] == count

    @property
    def launcher(self) -> LaunchRecord:
        return self.run.launcher if self.run.launcher is not None else LaunchRecord.from_json({})

    @property
    def timed_out(self) -> bool:
        """The probe's timeout came (a signal may have interrupted the run's clean-up after it)."""
        return bool(self.launcher.timed_out)

    @property
    def end(self) -> LaunchEnd:
        """How the launch ended (EXITED for a run with no launcher.json: attach mode)."""
        return self.launcher.end

    @property
    def mode(self) -> LaunchMode | None:
        """How the probe started the script (None: a meta.json without a mode this version knows)."""
        mode = self.run.meta.mode
        return mode if isinstance(mode, LaunchMode) else None

    def rank_events(self, kind: str) -> dict[int, list[dict[str, Any]]]:
        return {r: p.of(kind) for r, p in self.ranks.items()}

    def steps_of(self, rank: int) -> int:
        p = self.ranks.get(rank)
        return len(p.of("optimizer_step")) if p else 0

    def failed(self, p: ProcessLog) -> bool:
        return bool(p.of("exception")) and p.done is None

    # ------------------------------------------------------------------ findings
    def finding(
        self,
        rule: str,
        *,
        message: str,
        severity: Severity | None = None,
        confidence: Confidence = Confidence.CERTAIN,
        site: dict[str, Any] | None = None,
        file: str | None = None,
        line: int | None = None,
        ranks: Iterable[int] = (),
        evidence: dict[str, Any] | None = None,
        magnitude: float = 0.0,
        fix_variant: str | None = None,
        fix_args: dict[str, Any] | None = None,
        fix_detail: str | None = None,
    ) -> Finding:
        """A probe finding of `rule` at `site` (a recorded call site) or `file`/`line`, by default the script
        (`ddpdoctor.findings.new_finding`)."""
        if site is not None:
            file, line = self.where(site)
        return new_finding(
            rule,
            sources=("probe",),
            message=message,
            confidence=confidence,
            severity=severity,
            fix_variant=fix_variant,
            fix_args=fix_args,
            fix_detail=fix_detail,
            file=file if file is not None else self.script,
            line=line,
            ranks=ranks,
            evidence=evidence,
            magnitude=magnitude,
        )

    def clear(
        self,
        rule: str,
        *,
        reason: str,
        site: dict[str, Any] | None = None,
        evidence: dict[str, Any] | None = None,
    ) -> None:
        """Record that the probe measured `rule`'s condition at `site` and found it absent (see
        findings.Clearance): static findings of the rule there, below certain confidence, are dropped."""
        file, line = self.where(site)
        self.clearances.append(Clearance(rule=rule, reason=reason, file=file, line=line, evidence=evidence or {}))

    def measured(
        self,
        rule: str,
        *,
        reason: str,
        site: dict[str, Any] | None = None,
        run_wide: bool = False,
        about: tuple[str, ...] = (),
        evidence: dict[str, Any] | None = None,
    ) -> None:
        """The probe measured `rule`'s condition at `site` (a recorded call site), or over the whole run
        (`run_wide`), with the numbers in `reason` ("3 saves, all by rank 0"). Whether it found the condition is
        what the analysis returns: no finding of `rule` there makes this a clearance of the static suspicions of the
        rule there (findings.resolve_measurements); a finding there is the confirmation. Call it wherever the
        measurement was possible, found or not."""
        file, line = (None, None) if run_wide else self.where(site)
        self.measurements.append(Measurement(rule=rule, reason=reason, file=file, line=line, about=about,
                                             evidence=evidence or {}))

    def not_measured(
        self,
        rule: str,
        *,
        reason: str,
        site: dict[str, Any] | None = None,
        run_wide: bool = False,
        about: tuple[str, ...] = (),
    ) -> None:
        """The probe could not measure `rule`'s condition in this run (`reason`: the code did not run, too few
        steps): a static suspicion there stays, and the report says why the probe could not settle it."""
        file, line = (None, None) if run_wide else self.where(site)
        self.measurements.append(Measurement(rule=rule, reason=reason, measured=False, file=file, line=line,
                                             about=about))

    def static_sites(self, rule: str) -> list[dict[str, Any]]:
        """The static findings of `rule` recorded with the run (static.json), as sites: {file, line, confidence,
        evidence}. What a probe half reads to measure the places static analysis suspected (did that line run?)."""
        out = []
        for f in self.run.static.findings if self.run.static else ():
            if f.rule == rule and f.line:
                out.append({"file": f.file, "line": f.line, "confidence": f.confidence.value,
                            "evidence": dict(f.evidence or {})})
        return out

    def ran_at(self, site: dict[str, Any], recorded: Iterable[dict[str, Any] | None]) -> bool:
        """Whether `site` (a static finding's file and line) is one of the `recorded` call sites."""
        want = (site.get("file"), site.get("line"))
        return any(r and self.where(r) == want for r in recorded)
