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
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the event model reads these records and is imported inside the ranks: keep this module light
    from ddpdoctor.findings import Finding


__all__ = ["LaunchEnd", "LaunchMode", "LaunchRecord", "RunMeta", "StaticRecord"]


class _Text(str, Enum):
    """An enum whose members are their on-disk strings: equal to them, written to JSON and environment variables
    as them, printed as them (`f"{mode}"` is "torchrun" on every Python)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def of(cls, value: Any) -> Any:
        """The member whose string `value` is, None for anything else (a run written by another version)."""
        try:
            return cls(value)
        except ValueError:
            return None


class LaunchMode(_Text):
    """How the probe starts the script (ddpdoctor.probe.plan decides): ProbeSettings.mode in every instrumented
    process, meta.json and launcher.json `mode` on disk (these strings)."""

    TORCHRUN = "torchrun"  # N ranks through torch.distributed.run's elastic agent
    SPAWN = "spawn"  # started once: the script's main process starts its own ranks (mp.spawn, Process)
    SINGLE = "single"  # started once: one process drives every device (nn.DataParallel)
    ATTACH = "attach"  # `python -m ddpdoctor.probe` under the user's own launcher (torchrun, srun, mpirun)

    @property
    def starts_once(self) -> bool:
        """The launcher starts the script's one main process (not N ranks through torchrun's agent)."""
        return self in (LaunchMode.SPAWN, LaunchMode.SINGLE)


class LaunchEnd(_Text):
    """How a launch ended, one state (as torch elastic's `WorkerState` / `RunResult.state` is for its agent). On
    disk it stays launcher.json's flags (`timed_out`, `interrupted`, `agent_stopped_after_ranks_exited`), which
    `LaunchRecord.end` reads back and `LaunchEnd.flags` writes."""

    EXITED = "exited"  # the launched process (or, in a shared launch, every rank of the run) ended by itself
    RANKS_EXITED = "ranks_exited"  # every rank recorded its exit and was gone: the agent's teardown was cut short
    TIMED_OUT = "timed_out"  # the probe's timeout: stacks dumped, the run stopped
    INTERRUPTED = "interrupted"  # Ctrl-C / SIGTERM / SIGHUP: the run stopped, the command ends `interrupted`

    @property
    def stopped(self) -> bool:
        """The probe stopped the run before it ended by itself."""
        return self in (LaunchEnd.TIMED_OUT, LaunchEnd.INTERRUPTED)

    def flags(self, *, timed_out: bool = False) -> dict[str, bool]:
        """launcher.json's flags for this end. `timed_out`: the run had timed out before a signal during its
        clean-up made it INTERRUPTED (both flags are then written, as they always were)."""
        return {"timed_out": self is LaunchEnd.TIMED_OUT or timed_out,
                "interrupted": self is LaunchEnd.INTERRUPTED}


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
    mode: LaunchMode | str | None = None  # a string this version does not know stays as written
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _mode(self.mode))


def _mode(value: Any) -> Any:
    """A record's launch mode: its member, or the value as written when this version does not know it (a record
    read from a file and written back loses nothing)."""
    return LaunchMode.of(value) or value


@dataclass(frozen=True, kw_only=True, eq=False)
class LaunchRecord(_Record):
    """launcher.json: how the launch ended, written by the launcher after the run (absent in attach mode)."""

    mode: LaunchMode | str | None = None  # as RunMeta.mode
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _mode(self.mode))

    @property
    def end(self) -> LaunchEnd:
        """How the launch ended, from the flags on disk (an interruption outranks the timeout it cut short)."""
        if self.interrupted:
            return LaunchEnd.INTERRUPTED
        if self.timed_out:
            return LaunchEnd.TIMED_OUT
        if self.agent_stopped_after_ranks_exited:
            return LaunchEnd.RANKS_EXITED
        return LaunchEnd.EXITED


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
