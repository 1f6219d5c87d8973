"""`ScriptModel`: the semantic model of one script, built once and shared by every rule.

Rules ask questions in the user's vocabulary — which objects are DDP wrappers, which loop trains, was the model
wrapped before this line — and build findings with `finding()`, which takes severity and fix text from the rule
(`ddpdoctor.findings.new_finding`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

from ddpdoctor.findings import Confidence, Finding, Severity, new_finding
from ddpdoctor.static.apis import CliArg, TorchInterpreter, scaled_up_by_world
from ddpdoctor.static.engine import SourceFile
from ddpdoctor.static.semantic import Event, Family, Obj, Value, union


@dataclass
class ScriptModel:
    filename: str
    source: str
    tree: ast.Module
    events: list[Event]
    cli_args: dict[str, CliArg]
    errors: list[str] = field(default_factory=list)
    truncated: bool = False
    file: SourceFile | None = None

    @classmethod
    def build(cls, tree: ast.Module, source: str, filename: str, assume: dict[str, Any] | None = None) -> "ScriptModel":
        """Interpret the script; `assume` gives facts the source cannot (see `TorchInterpreter`)."""
        file = SourceFile(filename, source, tree)
        interp = TorchInterpreter(file, assume)
        interp.run()
        return cls(
            filename=filename,
            source=source,
            tree=tree,
            events=interp.events,
            cli_args=interp.cli_args,
            errors=interp.errors,
            truncated=interp.truncated,
            file=file,
        )

    # ------------------------------------------------------------------ events

    @cached_property
    def _by_kind(self) -> dict[str, list[Event]]:
        out: dict[str, list[Event]] = {}
        for ev in self.events:
            out.setdefault(ev.kind, []).append(ev)
        return out

    def of(self, *kinds: str) -> list[Event]:
        """Events of these kinds, in execution order."""
        if len(kinds) == 1:
            return list(self._by_kind.get(kinds[0], ()))
        return sorted((ev for k in kinds for ev in self._by_kind.get(k, ())), key=lambda e: e.seq)

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

    def loop_trains(self, loop: ast.AST | None, after: int = -1) -> bool:
        """Whether a backward pass or an optimizer step happens inside this loop."""
        if loop is None:
            return False
        for ev in self.of("backward", "opt_step"):
            if ev.seq > after and any(c.node is loop for c in ev.loops):
                return True
        return False

    def loop_evaluates(self, loop: ast.AST | None) -> bool:
        """A loop that runs a model forward and never a backward or step: an evaluation loop (a loop that only
        moves batches, like a prefetch thread, is neither)."""
        if loop is None or self.loop_trains(loop):
            return False
        return any(any(c.node is loop for c in ev.loops) for ev in self.of("forward"))

    def iteration_trains(self, it: Event) -> bool:
        """Whether the batches of an `iterate` event feed training: a backward/step inside its `for` loop, or —
        for `batches = iter(loader)` drawn with next() — later in the same call."""
        loop = it.data.get("loop")
        if loop is not None:
            return self.loop_trains(loop, it.seq)
        return any(ev.seq > it.seq and it.frame in ev.frames for ev in self.of("backward", "opt_step"))

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
        try:
            s = ast.unparse(node)
        except Exception:  # pragma: no cover
            return "?"
        s = " ".join(s.split())
        return s if len(s) <= limit else s[: limit - 1] + "…"

    @cached_property
    def _scan(self) -> tuple[str, frozenset[str], frozenset[str]]:
        """(identifiers and string constants lower-cased, string constants, imports), from the file's index."""
        index = (self.file or SourceFile(self.filename, self.source, self.tree)).index
        return index.words, frozenset(index.strings), frozenset(index.imports)

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
        line: int,
        message: str,
        confidence: Confidence,
        evidence: dict[str, Any] | None = None,
        severity: Severity | None = None,
        magnitude: float = 0.0,
        fix_variant: str | None = None,
        fix_args: dict[str, Any] | None = None,
        fix_detail: str | None = None,
    ) -> Finding:
        """A static finding of rule `code` at `line` of this file (`ddpdoctor.findings.new_finding`)."""
        return new_finding(
            code,
            sources=("static",),
            message=message,
            confidence=confidence,
            severity=severity,
            fix_variant=fix_variant,
            fix_args=fix_args,
            fix_detail=fix_detail,
            file=self.filename,
            line=line,
            evidence=evidence,
            magnitude=magnitude,
        )


def lower(confidence: Confidence, steps: int = 1) -> Confidence:
    """One (or more) levels less sure, never below `possible`."""
    return Confidence(max(Confidence.POSSIBLE, confidence - steps))


def cap_unreached(confidence: Confidence, *events: Event) -> Confidence:
    """Code the walk reached only as a stand-alone entry (nobody in the file calls it) is less certain."""
    return lower(confidence) if any(not ev.reached for ev in events) else confidence
