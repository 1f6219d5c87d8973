"""The JSON files beside a run's event logs, as typed records: what the writers (the launcher, attach mode, `check`)
and the readers (the analyses, `report`) agree on.

    meta.json      RunMeta       the run as it was asked for: script, probe limits, recipe, launch plan, sources
    launcher.json  LaunchRecord  how the launch ended: exit code, timeout, interruption, wall time, what was killed
    static.json    StaticRecord  the static analysis of the `check` that recorded the run: findings and notes

`from_json` reads what any version wrote: a missing key takes its default, a key this version does not know is kept
in `extra` and written back by `to_json`, so a newer run replayed by an older ddpdoctor (or the other way round)
loses nothing. `ddpdoctor.events.META_KEYS` documents meta.json's keys; a test holds `RunMeta` to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ddpdoctor.findings import Finding
from ddpdoctor.rules.dd202_small_bn_batch import SMALL_BN_BATCH

__all__ = ["LaunchRecord", "RunMeta", "StaticRecord"]


def _split(cls: type, data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the keys that are fields of `cls`, the others)."""
    names = {f.name for f in fields(cls)} - {"extra"}
    known = {k: v for k, v in data.items() if k in names}
    return known, {k: v for k, v in data.items() if k not in names}


def _to_json(record: Any) -> dict[str, Any]:
    out = {f.name: getattr(record, f.name) for f in fields(record) if f.name != "extra"}
    for k, v in out.items():
        if isinstance(v, tuple):
            out[k] = list(v)
    return {**out, **record.extra}


@dataclass(frozen=True, kw_only=True)
class RunMeta:
    """meta.json: written once by the launcher (or the first rank in attach mode), read by every analysis."""

    schema: str = ""
    mode: str = ""  # torchrun | spawn | single | attach
    script: str = ""  # as the user gave it
    script_abs: str = ""
    args: tuple[str, ...] = ()
    cwd: str = ""
    nproc: int | None = None
    epochs: int | None = None  # 0 = no limit
    steps: int | None = None  # 0 = no limit
    timeout: float | None = None
    device: str = "auto"
    base_lr: float | None = None
    base_batch: int | None = None
    lr_scaling: str | None = None
    small_bn_batch: int | None = SMALL_BN_BATCH
    legacy_local_rank_arg: str | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    python: str = ""
    host: str = ""
    started: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> RunMeta:
        known, extra = _split(cls, data or {})
        if known.get("args") is not None:
            known["args"] = tuple(str(a) for a in known["args"])
        for key in ("plan", "sources"):
            if not isinstance(known.get(key), dict):
                known.pop(key, None)
        known = {k: v for k, v in known.items() if v is not None or k in _NULLABLE_META}
        return cls(**known, extra=extra)

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)


_NULLABLE_META = {"nproc", "epochs", "steps", "timeout", "base_lr", "base_batch", "lr_scaling", "small_bn_batch",
                  "legacy_local_rank_arg", "started"}


@dataclass(frozen=True, kw_only=True)
class LaunchRecord:
    """launcher.json: how the launch ended, written by the launcher after the run (absent in attach mode)."""

    mode: str = ""
    returncode: int | None = None
    timed_out: bool = False
    interrupted: bool = False
    timeout: float | None = None
    started: float | None = None
    ended: float | None = None
    wall_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # command, port, agent, first_launch, killed, ...

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> LaunchRecord:
        known, extra = _split(cls, data or {})
        known["timed_out"] = bool(known.get("timed_out"))
        known["interrupted"] = bool(known.get("interrupted"))
        return cls(**known, extra=extra)

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    def get(self, key: str, default: Any = None) -> Any:
        """A field or an extra key by name (the launcher's many diagnostic keys live in `extra`)."""
        if key in _LAUNCH_FIELDS:
            value = getattr(self, key)
            return default if value is None else value
        return self.extra.get(key, default)


_LAUNCH_FIELDS = {f.name for f in fields(LaunchRecord)} - {"extra"}


@dataclass(frozen=True, kw_only=True)
class StaticRecord:
    """static.json: the static findings of the `check` that recorded the run, and its notes (a static rule that
    failed on the script). Runs recorded before notes existed hold a bare list of findings."""

    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Any) -> StaticRecord:
        if data is None:
            return cls()
        if isinstance(data, list):
            return cls(findings=tuple(Finding.from_json(item) for item in data))
        return cls(
            findings=tuple(Finding.from_json(item) for item in data.get("findings") or ()),
            notes=tuple(str(n) for n in data.get("notes") or ()),
        )

    def to_json(self) -> dict[str, Any]:
        return {"findings": [f.to_json() for f in self.findings], "notes": list(self.notes)}
