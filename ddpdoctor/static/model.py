"""`ScriptModel`: the semantic model of one script (with the project modules it imports), built once and shared by
every rule.

Rules ask questions in the user's vocabulary — which objects are DDP wrappers, which loop trains, was the model
wrapped before this line — and build findings with `finding()`, which takes severity and fix text from the rule
(`ddpdoctor.findings.new_finding`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cached_property
from typing import Any

from ddpdoctor.errors import UsageError
from ddpdoctor.findings import Confidence, Finding, Severity, new_finding
from ddpdoctor.plain import ValueRecord
from ddpdoctor.static.apis import CliArg, TorchInterpreter, scaled_up_by_world
from ddpdoctor.static.apis.optim import optimizer_like
from ddpdoctor.static.engine import SourceFile, SourceIndex
from ddpdoctor.static.engine.support import simple_text
from ddpdoctor.static.project import ModuleFile, Project
from ddpdoctor.static.semantic import Ctx, Event, Family, Obj, Value, union


class ScriptModel(ValueRecord):
    """What the walk of a script found: its events in order, its command-line options, and what it could not
    follow (`errors`, `truncated`); `sources`: every file the walk read (display path → file), the script first;
    `notes`: about the ones it could not."""

    __match_args__ = ("filename", "source", "tree", "events", "cli_args", "errors", "truncated", "file", "sources",
                      "notes")

    def __init__(
        self,
        filename: str,
        source: str,
        tree: ast.Module,
        events: list[Event],
        cli_args: dict[str, CliArg],
        errors: list[str] | None = None,
        truncated: bool = False,
        file: SourceFile | None = None,
        sources: dict[str, SourceFile] | None = None,
        notes: list[str] | None = None,
    ) -> None:
        self.filename = filename
        self.source = source
        self.tree = tree
        self.events = events
        self.cli_args = cli_args
        self.errors: list[str] = [] if errors is None else errors
        self.truncated = truncated
        self.file = file
        self.sources: dict[str, SourceFile] = {} if sources is None else sources
        self.notes: list[str] = [] if notes is None else notes

    @classmethod
    def build(cls, tree: ast.Module, source: str, filename: str, assume: dict[str, Any] | None = None) -> ScriptModel:
        """Interpret the script; `assume` gives facts the source cannot (see `TorchInterpreter`)."""
        file = SourceFile(filename, source, tree)
        interp = TorchInterpreter(file, assume)
        interp.run()
        return cls._of(interp, file)

    @classmethod
    def build_project(
        cls, project: Project, also: tuple[ModuleFile, ...] = (), assume: dict[str, Any] | None = None
    ) -> ScriptModel:
        """Interpret the project's entry script, following its imports into the project's files; `also`: project
        modules whose unreached functions are walked too (files the user named that the script imports). A script
        that cannot be read or parsed is a UsageError."""
        file = project.load(project.module_of(project.entry))
        if file is None:
            raise UsageError(project.notes[-1] if project.notes else f"{project.entry_shown}: cannot read")
        interp = TorchInterpreter(file, assume, project=project)
        interp.run(also)
        return cls._of(interp, file, notes=list(project.notes))

    @classmethod
    def _of(cls, interp: TorchInterpreter, file: SourceFile, notes: list[str] | None = None) -> ScriptModel:
        errors = [e if path == file.path else f"{path}: {e}" for path, e in interp.errors_by_file()]
        return cls(
            filename=file.path,
            source=file.source,
            tree=file.tree,
            events=interp.events,
            cli_args=interp.cli_args,
            errors=errors,
            truncated=interp.truncated,
            file=file,
            sources=dict(interp.sources),
            notes=notes or [],
        )

    # ------------------------------------------------------------------ events

    @cached_property
    def _by_kind(self) -> dict[str, list[Event]]:
        out: dict[str, list[Event]] = {}
        for ev in self.events:
            out.setdefault(ev.kind, []).append(ev)
        return out

    def of(self, *kinds: str, loaders: Iterable[Obj] | None = None) -> list[Event]:
        """Events of these kinds, in execution order; with `loaders` (for `iterate` only), the iterations that may
        draw from any of these loaders, each once."""
        if loaders is not None:
            if kinds != ("iterate",):
                raise ValueError("loaders= selects iterate events only")
            return self._iterations_of(loaders)
        if len(kinds) == 1:
            return list(self._by_kind.get(kinds[0], ()))
        return sorted((ev for k in kinds for ev in self._by_kind.get(k, ())), key=lambda e: e.seq)

    # The data rules ask, for each sampler, which loaders draw from it and which loops iterate those loaders
    # (`loaders_of`, `of("iterate", loaders=...)`):
    # answered from two maps built once, instead of every rule scanning every loader and every iteration per
    # sampler (quadratic in a script with many loaders). Objects are matched by identity, as `in` does for Obj.

    def loaders_of(self, sampler: Obj) -> list[Obj]:
        """The loaders whose `sampler` argument may be this sampler, in the order of their `loader` events (a
        loader listed once per event that made it, as `[ev.data["obj"] for ev in of("loader")]` lists it)."""
        return self._loaders_by_sampler.get(id(sampler), [])

    @cached_property
    def _loaders_by_sampler(self) -> dict[int, list[Obj]]:
        out: dict[int, list[Obj]] = {}
        for ev in self._by_kind.get("loader", ()):
            loader = ev.data["obj"]
            for key in dict.fromkeys(id(s) for s in loader.fields.get("sampler", ())):
                out.setdefault(key, []).append(loader)
        return out

    def _iterations_of(self, loaders: Iterable[Obj]) -> list[Event]:
        """`of("iterate", loaders=loaders)`: each iteration once, in execution order."""
        by_loader = self._iterations_by_loader
        found = sorted({i for ld in loaders for i in by_loader.get(id(ld), ())})
        iterations = self._by_kind.get("iterate", [])
        return [iterations[i] for i in found]

    @cached_property
    def _iterations_by_loader(self) -> dict[int, list[int]]:
        """id of a loader -> the positions in `of("iterate")` of the iterations over it."""
        out: dict[int, list[int]] = {}
        for i, it in enumerate(self._by_kind.get("iterate", ())):
            for key in dict.fromkeys(id(ld) for ld in it.data["loaders"]):
                out.setdefault(key, []).append(i)
        return out

    @cached_property
    def ddp_wraps(self) -> list[Event]:
        return [ev for ev in self.of("wrap") if ev.data["wrapper_kind"] == "ddp"]

    @cached_property
    def distributed(self) -> bool:
        """The script sets up data-parallel training across processes."""
        return bool(
            self.ddp_wraps
            or self.of("init_pg")
            or self.of("spawn")
            or any(ev.data["obj"].props.get("distributed") for ev in self.of("sampler"))
        )

    @cached_property
    def _setup_events(self) -> list[Event]:
        return self.of("init_pg", "spawn") or self.ddp_wraps

    def single_process_path(self, event: Event) -> bool:
        """True when `event` runs only where the script starts no processes: every process-group init and spawn
        (without any, every DDP wrap) sits on the other side of a test the event sits in, the same `if` or one
        with the same text (`if args.nodes > 1: mp.spawn(main, ...) else: main(0, args)` walks main twice, the
        second walk a single-process run; `if opt['dist']: init_dist()` then `if opt['dist']: loader = ...
        else: loader = DataLoader(..., shuffle=True)`)."""
        setup = self._setup_events
        if not setup:
            return False
        return all(self.on_other_side(ev, event) for ev in setup)

    @staticmethod
    def on_other_side(a: Event, b: Event) -> bool:
        """True when one run never executes both events: they sit on different sides of the same `if`
        (`Event.exclusive_with`), or of two tests with the same text, in any calls (`if self.opt['dist']: DDP(net)
        else: DataParallel(net)` in a helper called once per network)."""
        if a.exclusive_with(b):
            return True
        mine = _cond_texts(b)
        return any((t, 1 - side) in mine for t, side in _cond_texts(a))

    def wrap_event_before(self, obj: Obj, event: Event) -> Event | None:
        """The DDP wrap that put `obj`'s model inside a wrapper on the way to `event`, if any (a wrap on the
        other side of an `if` does not count)."""
        if obj.family is None:
            return None
        for ev in self.ddp_wraps:
            if ev.seq < event.seq and ev.data["wrapper"].family is obj.family and not ev.exclusive_with(event):
                return ev
        return None

    def wrap_event_of(self, wrapper: Obj) -> Event | None:
        for ev in self.of("wrap"):
            if ev.data["wrapper"] is wrapper:
                return ev
        return None

    @cached_property
    def trained_families(self) -> list[Family]:
        """Models that are optimised: wrapped in DDP, or whose parameters an optimizer holds."""
        fams: list[Family] = []
        for ev in self.ddp_wraps:
            fam = ev.data["wrapper"].family
            if fam is not None and fam not in fams:
                fams.append(fam)
        for ev in self.of("optimizer"):
            for owner in self.param_owners(ev.data["obj"].props.get("params") or ()):
                if owner.family is not None and owner.family not in fams:
                    fams.append(owner.family)
        return fams

    def param_owners(self, params: Value, depth: int = 0) -> list[Obj]:
        """The modules whose parameters a `params` argument holds (`model.parameters()`, param groups, lists)."""
        out: list[Obj] = []
        if depth > 4:
            return out
        for o in params:
            if o.kind in ("params", "param"):
                out.extend(o.props.get("owner", ()))
            elif o.kind == "tuple":
                for v in (o.items or ()) + ((o.props["elem"],) if "elem" in o.props else ()):
                    out.extend(self.param_owners(v, depth + 1))
            elif o.kind == "dict":
                out.extend(self.param_owners(o.fields.get("params", ()), depth + 1))
            elif o.kind == "unknown" and "call_args" in o.props:
                out.extend(self.param_owners(o.props["call_args"].all(), depth + 1))
            elif o.kind == "unknown" and o.props.get("base") is not None:
                out.extend(self.param_owners((o.props["base"],), depth + 1))
        return list(union(out))

    @cached_property
    def _event_at(self) -> dict[int, Event]:
        """id of an AST node → the first event at it."""
        out: dict[int, Event] = {}
        for ev in self.events:
            out.setdefault(id(ev.node), ev)
        return out

    @cached_property
    def _last_in_loop(self) -> dict[str, dict[int, int]]:
        """"train" / "forward" → loop node id → the last seq of a backward or step / of a forward inside it."""
        out: dict[str, dict[int, int]] = {"train": {}, "forward": {}}
        for key, events in (("train", self.training_events), ("forward", self.of("forward"))):
            last = out[key]
            for ev in events:
                for c in ev.ctx:
                    if c.kind == "loop":
                        last[id(c.node)] = max(last.get(id(c.node), -1), ev.seq)
        return out

    @cached_property
    def training_events(self) -> list[Event]:
        """Backward passes and optimizer steps, and calls nobody models that are handed an optimizer with something
        else (timm's `loss_scaler(loss, optimizer, parameters=...)`: the AMP scaler runs backward and the step
        inside a package the walk does not enter), in execution order."""
        opaque = []
        for ev in self.of("call"):
            args = ev.data["args"]
            if len(args.pos) + len(args.kw) >= 2 and any(optimizer_like(o) for o in args.all()):
                opaque.append(ev)
        return sorted([*self.of("backward", "opt_step"), *opaque], key=lambda e: e.seq)

    def loop_trains(self, loop: ast.AST | None, after: int = -1) -> bool:
        """Whether a backward pass or an optimizer step happens inside this loop."""
        if loop is None:
            return False
        return self._last_in_loop["train"].get(id(loop), -1) > after

    def loop_evaluates(self, loop: ast.AST | None) -> bool:
        """A loop that runs a model forward and never a backward or step: an evaluation loop (a loop that only
        moves batches, like a prefetch thread, is neither)."""
        if loop is None or self.loop_trains(loop):
            return False
        return id(loop) in self._last_in_loop["forward"]

    def iteration_trains(self, it: Event) -> bool:
        """Whether the batches of an `iterate` event feed training: a backward/step inside its `for` loop, or —
        for `batches = iter(loader)` drawn with next() — later in the same call."""
        loop = it.data.get("loop")
        if loop is not None:
            return self.loop_trains(loop, it.seq)
        return any(ev.seq > it.seq and it.frame in ev.frames for ev in self.training_events)

    @cached_property
    def backward_events(self) -> list[Event]:
        return self.of("backward")

    @cached_property
    def lr_scaled_up(self) -> list[Event]:
        """Where the script makes its step size grow with the world size: `lr = base_lr * world_size`,
        `args.lr *= dist.get_world_size()`, an optimizer/scheduler built with such a value, or `loss *= world_size`
        (summing instead of averaging gradients is the same scaling for SGD)."""
        out: list[Event] = []
        for ev in self.of("lr_assign"):
            if any(scaled_up_by_world(o) for o in ev.data["value"]):
                out.append(ev)
        out.extend(self.of("loss_scaled"))
        for ev in self.of("optimizer"):
            if any(scaled_up_by_world(o) for o in ev.data["obj"].props.get("lr") or ()):
                out.append(ev)
        for ev in self.of("scheduler"):
            args = ev.data["obj"].props.get("args")
            if args is not None and any(scaled_up_by_world(o) for o in args.all()):
                out.append(ev)
        return sorted(out, key=lambda e: e.seq)

    # ------------------------------------------------------------------ source

    @cached_property
    def lines(self) -> list[str]:
        return self.source.splitlines()

    def text(self, node: ast.AST | None, limit: int = 70) -> str:
        if node is None:
            return "?"
        s = simple_text(node)
        if s is None:
            try:
                s = ast.unparse(node)
            except Exception:  # pragma: no cover
                return "?"
        s = " ".join(s.split())
        return s if len(s) <= limit else s[: limit - 1] + "…"

    @property
    def index(self) -> SourceIndex:
        """The one-walk index of the script's own tree (`engine.SourceIndex`)."""
        return (self.file or self._own_file).index

    @cached_property
    def _own_file(self) -> SourceFile:
        return SourceFile(self.filename, self.source, self.tree)

    @cached_property
    def _scan(self) -> tuple[str, frozenset[str], frozenset[str]]:
        """(identifiers and string constants lower-cased, string constants, imports) of every file read."""
        files = list(self.sources.values()) or [self.file or self._own_file]
        if len(files) == 1:
            index = files[0].index
            return index.words, frozenset(index.strings), frozenset(index.imports)
        indexes = [f.index for f in files]
        return (
            " ".join(i.words for i in indexes),
            frozenset().union(*(i.strings for i in indexes)),
            frozenset().union(*(i.imports for i in indexes)),
        )

    @property
    def with_items(self) -> list[ast.withitem]:
        """The `with` items of every file read."""
        files = list(self.sources.values()) or [self.file or self._own_file]
        return [item for f in files for item in f.index.with_items]

    @property
    def words(self) -> str:
        """Every identifier, attribute and string constant (not docstrings) of the file, lower-cased."""
        return self._scan[0]

    @property
    def string_constants(self) -> frozenset[str]:
        return self._scan[1]

    @property
    def imported(self) -> frozenset[str]:
        return self._scan[2]

    # ------------------------------------------------------------------ naming things in messages

    def name(self, obj: Obj) -> str:
        return obj.props.get("bound_name") or obj.label or obj.kind

    def sampler_name(self, sampler: Obj, loaders: Iterable[Obj]) -> str:
        """"DistributedSampler `train_sampler`", or "the DistributedSampler of `val_loader`" when it has no name."""
        if sampler.props.get("bound_name"):
            return f"DistributedSampler `{sampler.props['bound_name']}`"
        for ld in loaders:
            if any(s is sampler for s in ld.fields.get("sampler", ())):
                return f"the DistributedSampler of `{self.name(ld)}`"
        return "a DistributedSampler"

    def names(self, objs: Iterable[Obj]) -> str:
        seen: list[str] = []
        for o in objs:
            n = self.name(o)
            if n not in seen:
                seen.append(n)
        return ", ".join(f"`{n}`" for n in seen[:3])

    # ------------------------------------------------------------------ findings

    def finding(
        self,
        code: str,
        *,
        line: int | Event | Obj,
        message: str,
        confidence: Confidence,
        evidence: dict[str, Any] | None = None,
        severity: Severity | None = None,
        magnitude: float = 0.0,
        fix_variant: str | None = None,
        fix_args: dict[str, Any] | None = None,
        fix_detail: str | None = None,
    ) -> Finding:
        """A static finding of rule `code` at `line` (`ddpdoctor.findings.new_finding`): an event or an object (its
        file and line; a place in another file than the script adds the chain of calls that led there to the
        evidence), or a line of the script."""
        file, at, chain = self.where(line)
        if chain:
            evidence = {**(evidence or {}), "call_chain": chain}
        return new_finding(
            code,
            sources=("static",),
            message=message,
            confidence=confidence,
            severity=severity,
            fix_variant=fix_variant,
            fix_args=fix_args,
            fix_detail=fix_detail,
            file=file,
            line=at,
            evidence=evidence,
            magnitude=magnitude,
        )

    def where(self, at: int | Event | Obj | CliArg) -> tuple[str, int, list[str]]:
        """(file, line, call chain as "file:line function()" strings when the place is outside the script)."""
        if isinstance(at, int):
            return self.filename, at, []
        file = at.file or self.filename
        if isinstance(at, Event):
            chain = at.chain
        else:  # an object or an option: the chain of the event that made it
            made = self._event_at.get(id(at.node))
            chain = made.chain if made is not None else ()
        shown = [f"{f}:{line} {name}()" for f, line, name in chain] if file != self.filename else []
        return file, at.line, shown

    def place(self, at: Event | Obj | Ctx, near: Event | Obj | CliArg | None = None) -> str:
        """How a message names a place: `line N` in the file the finding is in (the one of `near`, else the
        script), `file:N` in another file."""
        file = at.file or self.filename
        line = at.line if not isinstance(at, Ctx) else getattr(at.node, "lineno", 0)
        here = (near.file or self.filename) if near is not None else self.filename
        return f"line {line}" if file == here else f"{file}:{line}"


def _cond_texts(event: Event) -> set[tuple[str, int]]:
    """The plain conditions an event sits under, as (test text, side) with `not` folded in: the body of `if x:`
    and the else side of `if not x:` are both ("x", 0)."""
    out = set()
    for c in event.ctx:
        if c.kind != "cond" or not isinstance(c.info, str):
            continue
        text, side = c.info, 0
        while text.startswith("not "):
            text, side = text[4:], 1 - side
        out.add((text.strip("()") if text.startswith("(") and text.endswith(")") else text, side))
    return out


def lower(confidence: Confidence, steps: int = 1) -> Confidence:
    """One (or more) levels less sure, never below `possible`."""
    return Confidence(max(Confidence.POSSIBLE, confidence - steps))


def cap_unreached(confidence: Confidence, *events: Event) -> Confidence:
    """Code the walk reached only as a stand-alone entry (nobody in the file calls it) is less certain."""
    return lower(confidence) if any(not ev.reached for ev in events) else confidence
