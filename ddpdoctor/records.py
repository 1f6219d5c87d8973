"""The JSON files beside a run's event logs, as typed records: what the writers (the launcher, attach mode, `check`)
and the readers (the analyses, `report`) agree on.

    meta.json      RunMeta       the run as it was asked for: script, probe limits, recipe, launch plan, sources
    launcher.json  LaunchRecord  how the launch ended: exit code, timeout, interruption, wall time, what was killed
    static.json    StaticRecord  the static analysis of the `check` that recorded the run: findings and notes

`from_json` reads what any version wrote: a key this version does not know is kept in `extra` and written back by
`to_json`, so a newer run replayed by an older ddpdoctor (or the other way round) loses nothing. A key the file does
not have reads as the field's default, and the record remembers which keys the file had: RunMeta and LaunchRecord
are also read-only mappings of exactly the keys written (`meta.get("mode")`, `"keep_run" in meta`), as the dicts
they replace were. New code reads the attributes. `ddpdoctor.events.META_KEYS` documents meta.json's keys; a test
holds `RunMeta` to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the event model reads these records and is imported inside the ranks: keep this module light
    from ddpdoctor.findings import Finding


__all__ = ["LaunchRecord", "RunMeta", "StaticRecord"]


class _Record(Mapping[str, Any]):
    """A frozen dataclass that reads and writes one JSON object (see the module docstring)."""

    extra: dict[str, Any]
    present: frozenset[str] | None  # the keys the file had; None: every field (a record this version built)

    @classmethod
    def _field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("extra", "present")]  # type: ignore[arg-type]

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Any:
        data = dict(data or {})
        names = cls._field_names()
        known = {k: cls._coerce(k, data[k]) for k in names if k in data}
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**known, extra=extra, present=frozenset(k for k in names if k in data))

    @classmethod
    def _coerce(cls, key: str, value: Any) -> Any:
        return value

    def to_json(self, without: tuple[str, ...] = ()) -> dict[str, Any]:
        """The JSON object, less the keys `without` (keys that do not apply to this kind of run)."""
        return {k: v for k, v in self._json.items() if k not in without}

    def updated(self, **changes: Any) -> Any:
        """A copy with `changes`; the changed keys count as written."""
        present = None if self.present is None else self.present | frozenset(changes)
        return replace(self, **changes, present=present)  # type: ignore[type-var]

    @cached_property
    def _json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self._field_names():
            if self.present is None or name in self.present:
                value = getattr(self, name)
                out[name] = list(value) if isinstance(value, tuple) else value
        out.update(self.extra)
        return out

    def __getitem__(self, key: str) -> Any:
        return self._json[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._json)

    def __len__(self) -> int:
        return len(self._json)


@dataclass(frozen=True, kw_only=True, eq=False)
class RunMeta(_Record):
    """meta.json: written by the launcher (or the first rank in attach mode), read by every analysis."""

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
    device: str | None = None
    base_lr: float | None = None
    base_batch: int | None = None
    lr_scaling: str | None = None
    small_bn_batch: int | None = None
    legacy_local_rank_arg: str | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    python: str = ""
    host: str = ""
    started: float | None = None
    keep_run: str | None = None  # where --keep-run kept the run (None: a temporary directory)
    arm: dict[str, Any] | None = None  # `ddpdoctor triage` runs: the arm's probe settings
    extra: dict[str, Any] = field(default_factory=dict)
    present: frozenset[str] | None = None

    @classmethod
    def _coerce(cls, key: str, value: Any) -> Any:
        if key == "args":
            return tuple(str(a) for a in value or ())
        if key in ("plan", "sources") and not isinstance(value, dict):
            return {}
        return value


@dataclass(frozen=True, kw_only=True, eq=False)
class LaunchRecord(_Record):
    """launcher.json: how the launch ended, written by the launcher after the run (absent in attach mode)."""

    mode: str = ""
    command: tuple[str, ...] = ()
    port: int | None = None
    rendezvous_port: int | None = None
    returncode: int | None = None
    # the launched process was still running when the probe stopped the run (timeout, Ctrl-C, finished ranks):
    # its return code is the probe's SIGKILL, not its own outcome
    stopped_by_probe: bool = False
    timed_out: bool = False
    interrupted: bool = False
    timeout: float | None = None
    started: float | None = None
    ended: float | None = None
    wall_seconds: float | None = None
    stack_dumps: tuple[int, ...] = ()  # pids whose Python stacks were dumped at the timeout
    agent_stopped_after_ranks_exited: bool = False
    killed: tuple[int, ...] = ()  # pids the supervisor had to kill
    supervisor: dict[str, Any] = field(default_factory=dict)  # reason it stopped, subreaper
    agent: dict[str, Any] | None = None  # the elastic agent's own report (errors, pids)
    first_launch: dict[str, Any] | None = None  # mode, returncode, wall_seconds of a launch that asked to relaunch
    user_tree: dict[str, Any] | None = None  # what changed in the user's tree (probe.usertree.tree_changes)
    extra: dict[str, Any] = field(default_factory=dict)
    present: frozenset[str] | None = None

    @classmethod
    def _coerce(cls, key: str, value: Any) -> Any:
        if key in ("command", "stack_dumps", "killed"):
            return tuple(value or ())
        if key == "supervisor" and not isinstance(value, dict):
            return {}
        return value


@dataclass(frozen=True, kw_only=True)
class StaticRecord:
    """static.json: the static findings of the `check` that recorded the run, and its notes (a static rule that
    failed on the script). Runs recorded before notes existed hold a bare list of findings."""

    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Any) -> StaticRecord:
        from ddpdoctor.findings import Finding

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
