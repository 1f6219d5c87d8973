"""The vocabulary of the semantic model: abstract objects, the contexts code runs in, and recorded events.

A value in the model is a tuple of `Obj` — every object the expression may hold at that point (both sides of
`if args.distributed: model = DDP(model)` give `model` two possible objects). Objects carry a `kind` in the
user's vocabulary (module, wrapper, optimizer, sampler, loader…), `tags` that say where a number came from
(rank, local_rank, world_size, device_count, a literal…), and fields for attributes and dict items.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any, NamedTuple

from ddpdoctor.plain import Record

Value = tuple["Obj", ...]
EMPTY: Value = ()

# Tags that vary from one process to the next; a branch on them runs on a subset of ranks.
PER_RANK_TAGS = frozenset({"rank", "local_rank"})
# Tags of values that grow with the number of processes (the global batch grows with them).
WORLD_TAGS = frozenset({"world_size", "device_count"})


class Family(Record):
    """One model, whichever handle the script holds: the nn.Module and the DDP/DataParallel wrappers around it.

    Train/eval mode, BatchNorm presence and SyncBN conversion belong to the model, not to a handle: `model.eval()`
    on the wrapper and `model.module.eval()` change the same layers.
    """

    __match_args__ = ("mode", "has_bn", "syncbn_line", "members")

    def __init__(
        self,
        mode: str | None = "train",  # "train" | "eval" | None (unknown)
        has_bn: bool | None = None,
        syncbn_line: int | None = None,
        members: list[Obj] | None = None,
    ) -> None:
        self.mode = mode
        self.has_bn = has_bn
        self.syncbn_line = syncbn_line
        self.members: list[Obj] = [] if members is None else members

    @property
    def wrappers(self) -> list[Obj]:
        return [m for m in self.members if m.kind == "wrapper"]

    @property
    def wrapped(self) -> bool:
        return any(m.props.get("wrapper") == "ddp" for m in self.wrappers)


_bare_obj = object.__new__


class Obj:
    """An abstract object: what a name or expression may hold.

    kind: qual (an imported API, `qual` = its canonical name) | const | value (a number/string derived from
    others) | unknown | function | bound | class | instance | module | wrapper | optimizer | scheduler | sampler |
    loader | dataset | params | param | state_dict | dict | tuple | device | ctx | cli_args | parser | builtin…
    """

    __slots__ = ("kind", "line", "node", "qual", "label", "tags", "const", "value", "fields", "items", "props",
                 "family", "file")
    __match_args__ = __slots__

    def __init__(
        self,
        kind: str,
        line: int = 0,
        node: ast.AST | None = None,
        qual: str | None = None,
        label: str | None = None,
        tags: frozenset[str] = frozenset(),
        const: bool = False,
        value: Any = None,
        fields: dict[str, Value] | None = None,
        items: tuple[Value, ...] | None = None,
        props: dict[str, Any] | None = None,
        family: Family | None = None,
        file: str = "",  # the file `node` is in
    ) -> None:
        self.kind = kind
        self.line = line
        self.node = node
        self.qual = qual
        self.label = label
        self.tags = tags
        self.const = const
        self.value = value
        self.fields: dict[str, Value] = {} if fields is None else fields
        self.items = items
        self.props: dict[str, Any] = {} if props is None else props
        self.family = family
        self.file = file

    @property
    def is_module(self) -> bool:
        return self.kind in ("module", "wrapper") or self.family is not None

    @property
    def wrapper_kind(self) -> str | None:
        return self.props.get("wrapper") if self.kind == "wrapper" else None

    def __repr__(self) -> str:  # compact, for debugging and test failure messages
        extra = self.qual or self.label or ""
        return f"<{self.kind} {extra} L{self.line}>"


def new_obj(
    kind: str,
    line: int,
    node: ast.AST | None,
    file: str,
    qual: str | None,
    label: str | None,
    tags: frozenset[str],
    const: bool,
    value: Any,
    fields: dict[str, Value] | None,
    items: tuple[Value, ...] | None,
    props: dict[str, Any] | None,
    family: Family | None,
) -> Obj:
    """`Obj(kind, line, node, qual, ..., file=file)`, every field given in order: what `Interpreter.new` makes
    each object the walk creates with (tens of thousands on a large script). Setting the slots directly skips the
    class call's protocol (an argument tuple and a keyword dict handed to `__init__`): a third of the cost."""
    o = _bare_obj(Obj)
    o.kind = kind
    o.line = line
    o.node = node
    o.qual = qual
    o.label = label
    o.tags = tags
    o.const = const
    o.value = value
    o.fields = {} if fields is None else fields
    o.items = items
    o.props = {} if props is None else props
    o.family = family
    o.file = file
    return o


def union(*values: Iterable[Obj]) -> Value:
    """Concatenate values, dropping repeated objects, keeping first-seen order (messages stay deterministic)."""
    if len(values) == 1:
        only = values[0]
        if len(only) <= 1:
            return tuple(only)
    elif len(values) == 2:  # a Value (a tuple) is already free of repeats: joined with nothing it stays as it is
        a, b = values
        if not b and type(a) is tuple:
            return a
        if not a and type(b) is tuple:
            return b
    seen: set[int] = set()
    out: list[Obj] = []
    for v in values:
        for o in v:
            if id(o) not in seen:
                seen.add(id(o))
                out.append(o)
    return tuple(out)


def tags_of(value: Iterable[Obj]) -> frozenset[str]:
    out: set[str] = set()
    for o in value:
        out |= o.tags
    return frozenset(out)


def is_constant(value: Value) -> bool:
    """True when every possible object is a literal or computed only from literals."""
    return bool(value) and all(o.const for o in value)


def constant_values(value: Value) -> list[Any]:
    return [o.value for o in value if o.kind == "const"]


class Ctx(NamedTuple):
    """One level of the context a statement runs in.

    kind: rank (branch taken by a subset of ranks; info = "main" | "nonmain" | "other") | cond (any other branch;
    info = the test's source text) | loop (info = dict with the loaders it iterates) | grad (info = "off" | "on" |
    None) | no_sync | accumulate | join | try

    scope (rank only): which rank the test reads. "global": the process's rank in the whole job (or not known to
    be anything else); "local": its index on its node (LOCAL_RANK, `rank % gpus_per_node`,
    `is_local_main_process`), so "main" means one process *per node*; "local_by_name": the same, known only
    from a name (`self.gpu_id`, `args.local_rank` with no visible origin).
    """

    kind: str
    node: ast.AST | None
    info: Any
    frame: int
    branch: int = 0  # which side of the `if` (0 body, 1 else) or which `case`; tells exclusive paths apart
    scope: str | None = None
    test: Value = ()  # cond/rank/while: what the test evaluated to (the launch plan reads its truth)
    file: str = ""  # the file `node` is in


class Event(Record):
    """Something the script does, in execution order, with the context it happens in."""

    __slots__ = ("kind", "node", "line", "seq", "ctx", "frames", "func", "reached", "data", "file", "chain")
    __match_args__ = __slots__

    def __init__(
        self,
        kind: str,
        node: ast.AST,
        line: int,
        seq: int,
        ctx: tuple[Ctx, ...],
        frames: tuple[int, ...],
        func: str,
        reached: bool,
        data: dict[str, Any],
        file: str = "",  # the file `node` is in
        chain: tuple[tuple[str, int, str], ...] = (),  # (file, line, function called) of each call that led here
    ) -> None:
        self.kind = kind
        self.node = node
        self.line = line
        self.seq = seq
        self.ctx = ctx
        self.frames = frames
        self.func = func
        self.reached = reached
        self.data = data
        self.file = file
        self.chain = chain

    @classmethod
    def made(
        cls, kind: str, node: ast.AST, line: int, seq: int, ctx: tuple[Ctx, ...], frames: tuple[int, ...], func: str,
        reached: bool, data: dict[str, Any], file: str, chain: tuple[tuple[str, int, str], ...],
    ) -> Event:
        """`Event(...)` with every field given in order, its slots set directly (see `new_obj`): how the walk
        records each event."""
        ev = _bare_obj(cls)
        ev.kind = kind
        ev.node = node
        ev.line = line
        ev.seq = seq
        ev.ctx = ctx
        ev.frames = frames
        ev.func = func
        ev.reached = reached
        ev.data = data
        ev.file = file
        ev.chain = chain
        return ev

    @property
    def frame(self) -> int:
        return self.frames[-1]

    def in_ctx(self, kind: str) -> list[Ctx]:
        return [c for c in self.ctx if c.kind == kind]

    def exclusive_with(self, other: Event) -> bool:
        """True when the two events sit on different sides of the same branch in the same call, so one run
        never executes both (`if distributed: model = DDP(model) else: model.cuda()`)."""
        for a in self.ctx:
            if a.kind not in ("cond", "rank"):
                continue
            for b in other.ctx:
                if b.node is a.node and b.frame == a.frame and b.kind in ("cond", "rank") and b.branch != a.branch:
                    return True
        return False

    @property
    def rank_ctx(self) -> list[Ctx]:
        return self.in_ctx("rank")

    @property
    def loops(self) -> list[Ctx]:
        return self.in_ctx("loop")

    @property
    def grad_off(self) -> bool | None:
        """Whether autograd is off here: the innermost no_grad/enable_grad/inference_mode decides."""
        for c in reversed(self.ctx):
            if c.kind == "grad":
                return None if c.info is None else c.info == "off"
        return False


class Frame(Record):
    """The local names of one function call (or of the module body, or of a class body).

    Besides what `__init__` takes: `returns` (what its `return`s gave), `globals_declared` / `nonlocal_declared`,
    `stars` (modules a global scope imported with `from m import *`), `lazy` (names bound by `from m import name`
    not yet resolved), `yields` (what a generator's body yields), `generator` (the body yielded), `stack` ((frame
    ids, call sites) of the stack up to here, once computed) and `written`: the names bound in `locals` since the
    innermost loop or branch of this frame being walked began (None when none is): where the paths join, only
    these can differ (`Interpreter.merge`)."""

    __slots__ = ("id", "name", "locals", "lexical", "node", "returns", "globals_declared", "nonlocal_declared", "cls",
                 "ctx_base", "is_class_body", "file", "call_site", "stars", "lazy", "yields", "generator", "stack",
                 "written")
    __match_args__ = __slots__

    def __init__(
        self,
        id: int,  # noqa: A002 - the field's name
        name: str,
        locals: dict[str, Value],  # noqa: A002 - the field's name
        lexical: Frame | None,
        node: ast.AST | None = None,
        cls: Obj | None = None,
        ctx_base: int = 0,
        is_class_body: bool = False,
        file: str = "",  # the file the frame's code is in
        call_site: tuple[str, int, str] | None = None,  # (file, line, function) of the call that made it, if any
    ) -> None:
        self.id = id
        self.name = name
        self.locals = locals
        self.lexical = lexical
        self.node = node
        self.returns: list[Value] = []
        self.globals_declared: set[str] = set()
        self.nonlocal_declared: set[str] = set()
        self.cls = cls
        self.ctx_base = ctx_base
        self.is_class_body = is_class_body
        self.file = file
        self.call_site = call_site
        self.stars: list[Any] = []
        self.lazy: set[str] = set()
        self.yields: list[Value] = []
        self.generator = False
        self.stack: tuple[tuple[int, ...], tuple[Any, ...]] | None = None
        self.written: set[str] | None = None
