"""Control flow of the interpreter: both sides of every branch are walked and their variables merged (unless the
call site fixes which way it goes), loop bodies are walked once, and `with`, `try` and `match` push the contexts the
code inside them runs in."""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor.static.engine.expressions import CMP_OPS, NOT_COMPUTED, known_value, truth_of
from ddpdoctor.static.engine.support import DEAD, Args, counters, is_main_guard
from ddpdoctor.static.semantic import Ctx, Frame, Obj, Value, union

# Where paths join, a frame of at least this many variables merges only the names bound since they parted
# (`Frame.written`); a smaller one compares them all, which costs less than collecting the names bound.
TRACK_WRITES_FROM = 48
UNTRACKED: Any = object()


class ControlMixin:
    """The control-flow half of `Interpreter`."""

    def st_If(self, st: ast.If) -> bool:
        test = self.eval(st.test)
        fixed = self.parameter_truth(st.test, test)
        if fixed is not None:  # this call site fixes which way it goes
            return self.block(st.body if fixed else st.orelse)
        scope = None
        if is_main_guard(st.test):
            if self.frame.file != self.source.path:
                return self.block(st.orelse)  # an imported module's `__main__` block never runs
            kind, info, else_info = None, None, None
        else:
            kind, info, else_info, scope = self.classify_branch(test, st.test)
            if kind == "cond":
                decided = self._decided_by_path(st, test)
                if decided is not None:
                    return self.block(st.body if decided else st.orelse)
        frame = self.frame
        narrowing = self.narrowing(st.test)
        body_side, else_side = self.narrowed(narrowing, True), self.narrowed(narrowing, False)
        if (body_side is DEAD) != (else_side is DEAD):  # the variable's objects decide the test in this call
            return self.block(st.orelse if body_side is DEAD else st.body)
        before = dict(frame.locals)
        outer = self._track_writes(frame)
        try:
            if body_side is not None:
                frame.locals[narrowing[0]] = body_side
                if frame.written is not None:
                    frame.written.add(narrowing[0])
            if kind:
                self.ctx.append(Ctx(kind, st, info, frame.id, 0, scope, test, file=self.frame.file))
            lifted = self.lift_rank_guards(st.test, True)
            try:
                ended_body = self.block(st.body)
            finally:
                self.ctx[: len(lifted)] = lifted
                if kind:
                    self.ctx.pop()
            body_guard = self._trailing_guard
            after_body = frame.locals
            frame.locals = dict(before)
            if else_side is not None:
                frame.locals[narrowing[0]] = else_side
                if frame.written is not None:
                    frame.written.add(narrowing[0])
            if kind:
                self.ctx.append(Ctx(kind, st, else_info, frame.id, 1, scope, test, file=self.frame.file))
            lifted = self.lift_rank_guards(st.test, False) if st.orelse else []
            try:
                ended_else = self.block(st.orelse)
                if kind == "cond" and not ended_else:
                    self._leave_other_side(frame.locals)
            finally:
                self.ctx[: len(lifted)] = lifted
                if kind:
                    self.ctx.pop()
        finally:
            written = self._untrack_writes(frame, outer)
        after_else = frame.locals
        if ended_body and ended_else:
            frame.locals = self.merge(after_body, after_else, written)
            return True
        if ended_body:
            frame.locals = after_else
            if kind and not st.orelse:
                self._guard = (kind, else_info, 1, scope, test)
        elif ended_else:
            frame.locals = after_body
            if kind:
                self._guard = (kind, info, 0, scope, test)
        else:
            frame.locals = self.merge(after_body, after_else, written)
            if body_guard is not None and body_guard[0] == "rank" and self.single_process_otherwise(st.test, test):
                # `if distributed: ...; if not is_main(): return` then `else: ...`: past the `if`, the other
                # ranks have left, and without distribution there is one process (detectron2's evaluators)
                self._guard = body_guard
        return False

    @staticmethod
    def _track_writes(frame: Frame) -> Any:
        """Start collecting the names bound in `frame` (for a merge where paths join); returns the collection of
        the enclosing loop or branch, to give back to `_untrack_writes`. A frame of few variables is merged whole
        (cheaper than collecting): then nothing starts (UNTRACKED), and the names bound go on into the enclosing
        collection, if any."""
        if len(frame.locals) < TRACK_WRITES_FROM:
            return UNTRACKED
        outer = frame.written
        frame.written = set()
        return outer

    @staticmethod
    def _untrack_writes(frame: Frame, outer: Any) -> set[str] | None:
        """The names bound since `_track_writes` (None: not collected, merge every name); the enclosing loop or
        branch (if any) bound them too."""
        if outer is UNTRACKED:
            return None
        written = frame.written
        assert written is not None
        frame.written = outer
        if outer is not None:
            outer |= written
        return written

    def _decided_by_path(self, st: ast.If, test: Value) -> bool | None:
        """The side of a test that an enclosing branch on the same test (by its text, `not x` folded into x)
        already decided: `if args.nodes > 1: mp.spawn(main) else: main(0, args)` walks main's own
        `if args.nodes > 1: init_process_group(...)` only on its false side in the direct call. Objects made on the
        other side are already dropped there (`_on_path`); walking that side anyway would record a process group
        and a DDP wrap in a run that has neither."""
        if not self.ctx:
            return None
        key = self._cond_key(Ctx("cond", st, None, self.frame.id, 0, None, test, file=self.frame.file))
        if key is None:
            return None
        path = set(self._path())
        if key in path:
            return True
        if (key[0], 1 - key[1]) in path:
            return False
        return None

    def _leave_other_side(self, env: dict[str, Value]) -> None:
        """At the end of an `else` side (written or not), the variables hold no object made on the body side of
        the same test: after `if distributed: model = DDP(model)`, a later `if distributed: model = model.module`
        leaves only plain models, whichever side ran (`_on_path` does the same for the names an expression reads)."""
        for name, value in list(env.items()):
            if len(value) > 1 and any("path" in o.props for o in value):
                kept = self._on_path(value)
                if kept is not value:
                    env[name] = kept
                    if self.frame.written is not None:
                        self.frame.written.add(name)

    def lift_rank_guards(self, node: ast.expr, body: bool) -> list[Ctx]:
        """Inside one side of an `if`, the rank contexts that no longer restrict the ranks: the false side of
        `if not fsdp_eval and not is_main: return` (every rank but the main one leaves only when `not fsdp_eval`)
        holds on every rank where a later test (`if fsdp_eval:`, here or in a function called from here) says that
        rank-free conjunct is false. Those contexts become plain conditions while that side is walked; returns the
        prefix of `self.ctx` as it was (restored by the caller), or [] when nothing changed."""
        if not any(c.kind == "rank" and c.branch == 1 and any(o.props.get("plain") for o in c.test) for c in self.ctx):
            return []
        if body:
            parts = node.values if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And) else [node]
            facts = {self.text(p) for p in parts}
        else:
            parts = node.values if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) else [node]
            facts = {_negated(self.text(p)) for p in parts}
        saved = list(self.ctx)
        changed = False
        for i, c in enumerate(self.ctx):
            if c.kind != "rank" or c.branch != 1:
                continue
            plain = [t for o in c.test for t in o.props.get("plain", ())]
            if any(_negated(t) in facts for t in plain):
                test_node = getattr(c.node, "test", None)
                self.ctx[i] = c._replace(kind="cond", info="not " + self.text(test_node), scope=None)
                changed = True
        return saved if changed else []

    def narrowed(self, narrowing: tuple[str, Any, bool] | None, test_true: bool) -> Value | None:
        """On one side of a test (`narrowing`), the objects of the variable it speaks of that can be there
        (`model.module if isinstance(model, DDP) else model`: the wrapper on one side, the plain model on the
        other; an object the predicate cannot decide stays on both): None when that is all of them, DEAD when
        none (the side does not run in this call)."""
        if narrowing is None:
            return None
        name, predicate, holds_when_true = narrowing
        value = self.frame.locals.get(name)
        if not value:
            return None
        want = test_true == holds_when_true
        kept = tuple(o for o in value if predicate(o) in (None, want))
        if len(kept) == len(value):
            return None
        return kept or DEAD

    def st_For(self, st: ast.For | ast.AsyncFor) -> None:
        iterable = self.eval(st.iter)
        yielded = self._iter_protocol(iterable, st)
        info = self.loop_info(st, iterable)
        element = yielded or self.element_of(iterable, st)
        frame = self.frame
        self._widen_counters(st)
        before = dict(frame.locals)
        outer = self._track_writes(frame)
        self.ctx.append(Ctx("loop", st, info, frame.id, file=self.frame.file))
        try:
            self.bind(st.target, element)
            self.block(st.body)
        finally:
            self.ctx.pop()
            written = self._untrack_writes(frame, outer)
        frame.locals = self.merge_loop(before, frame.locals, written)
        self.block(st.orelse)

    st_AsyncFor = st_For

    def _widen_counters(self, st: ast.For | ast.AsyncFor | ast.While) -> None:
        """A loop body is walked once: a counter it updates (`epoch += 1`, `self.step += 1`) would be read at its
        value before the loop only, a constant, as if `sampler.set_epoch(epoch)` in `while epoch < n:` passed the
        same epoch every time. On entry such a counter also holds a varying value of the loop."""
        names, attrs = self.loop_counters(st)
        frame = self.frame
        for name in names:
            value = frame.locals.get(name)
            if value and any(o.const for o in value):
                frame.locals[name] = union(value, (self.new("value", st, label=name, props={"counter": True}),))
                if frame.written is not None:
                    frame.written.add(name)
        for base, attr in attrs:
            value = frame.locals.get(base)
            for o in value or ():
                held = o.fields.get(attr)
                if held and any(h.const for h in held):
                    varying = self.new("value", st, label=f"{base}.{attr}", props={"counter": True})
                    o.fields[attr] = union(held, (varying,))

    def loop_counters(self, st: ast.AST) -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
        found = self._counters.get(id(st))
        if found is None:
            found = self._counters[id(st)] = counters(st.body)
        return found

    def _iter_protocol(self, iterable: Value, st: ast.For | ast.AsyncFor) -> Value:
        """`for x in obj` over an instance of a class of the project calls its `__iter__` first, where the loop
        starts (an epoch-aware loader wrapper that calls `sampler.set_epoch` there is seen doing it every epoch).
        What a generator `__iter__` yields is the loop's element; otherwise the iterable's usual element."""
        yielded: list[Obj] = []
        for o in iterable:
            if o.kind != "instance" or o.props.get("class") is None:
                continue
            method = self._attr_from_class(o, "__iter__")
            if not method:
                continue
            for m in method:
                if m.kind != "bound":
                    continue
                for result in self.call_function(m.props["func"], Args(), st.iter, self_obj=m.props["self"]):
                    yielded.extend(result.props.get("yields") or ())
        return union(yielded)

    def st_While(self, st: ast.While) -> None:
        self._widen_counters(st)
        test = self.eval(st.test)
        frame = self.frame
        before = dict(frame.locals)
        outer = self._track_writes(frame)
        self.ctx.append(Ctx("loop", st, self.loop_info(st, None), frame.id, 0, None, test, file=self.frame.file))
        try:
            self.block(st.body)
        finally:
            self.ctx.pop()
            written = self._untrack_writes(frame, outer)
        frame.locals = self.merge_loop(before, frame.locals, written)
        self.block(st.orelse)

    def st_With(self, st: ast.With | ast.AsyncWith) -> bool:
        pushed = 0
        try:
            for item in st.items:
                value = self.eval(item.context_expr)
                kinds_here: set[str] = set()
                for o in value:
                    entered = self.context_of(o)
                    if entered is not None and (o.kind != "ctx" or entered[0] not in kinds_here):
                        if o.kind == "ctx":
                            kinds_here.add(entered[0])
                        self.ctx.append(Ctx(entered[0], st, entered[1], self.frame.id, file=self.frame.file))
                        pushed += 1
                if item.optional_vars is not None:
                    self.bind(
                        item.optional_vars, (self.unknown(item.optional_vars, label=self.text(item.optional_vars)),)
                    )
            return self.block(st.body)
        finally:
            if pushed:
                del self.ctx[len(self.ctx) - pushed :]

    st_AsyncWith = st_With

    def st_Try(self, st: ast.Try) -> bool:
        frame = self.frame
        self.ctx.append(Ctx("try", st, None, frame.id, file=self.frame.file))
        try:
            self.block(st.body)
        finally:
            self.ctx.pop()
        after_body = frame.locals
        for handler in st.handlers:
            frame.locals = dict(after_body)
            outer = self._track_writes(frame)
            try:
                if handler.name:
                    self.bind_name(handler.name, (self.unknown(handler, label=handler.name),))
                self.ctx.append(Ctx("try", handler, None, frame.id, file=self.frame.file))
                try:
                    self.block(handler.body)
                finally:
                    self.ctx.pop()
            finally:
                written = self._untrack_writes(frame, outer)
            after_body = self.merge(after_body, frame.locals, written)
        frame.locals = after_body
        self.block(st.orelse)
        return self.block(st.finalbody)

    st_TryStar = st_Try

    def st_Match(self, st: ast.Match) -> None:
        self.eval(st.subject)
        frame = self.frame
        before = dict(frame.locals)
        merged = dict(before)
        outer = self._track_writes(frame)
        try:
            for i, case in enumerate(st.cases):
                frame.locals = dict(before)
                self.ctx.append(Ctx("cond", st, self.text(case.pattern), frame.id, i, file=self.frame.file))
                try:
                    self.block(case.body)
                finally:
                    self.ctx.pop()
                # the names any case so far bound: only those can differ between `merged` and this case's end
                merged = self.merge(merged, frame.locals, frame.written)
        finally:
            self._untrack_writes(frame, outer)
        frame.locals = merged

    def parameter_truth(self, test_node: ast.expr, test: Value) -> bool | None:
        """The truth of a test that only reads parameters of the current call when the caller passed literals for
        them (or left their literal defaults): `if is_training:` in `create_loader(..., is_training=False)` runs one
        way in this call, and so does `if local_rank not in [-1, 0]:` in a helper called with `rank=-1` (YOLOv5's
        "not distributed": that call never reaches the barrier, whatever the name says). Module-level constants
        and unknown values keep both sides walked."""
        negate = False
        node = test_node
        while isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            node, negate = node.operand, not negate
        frame = self.frame
        fnode = frame.node
        if (
            not isinstance(node, (ast.Name, ast.Compare))
            or frame.call_site is None
            or not isinstance(fnode, (ast.FunctionDef, ast.AsyncFunctionDef))
        ):
            return None
        spec = fnode.args
        params = {a.arg for a in (*spec.posonlyargs, *spec.args, *spec.kwonlyargs)}
        if isinstance(node, ast.Compare):
            truth = self._parameter_comparison(node, params, frame.locals)
        elif node.id not in params or node.id not in frame.locals:
            return None
        else:
            truth = truth_of(frame.locals[node.id])
        return None if truth is None else truth != negate

    @staticmethod
    def _parameter_comparison(node: ast.Compare, params: set[str], local: dict[str, Value]) -> bool | None:
        """`param == literal`, `param not in (-1, 0)`...: every name a parameter holding one literal, every other
        operand a literal."""
        values: list[Any] = []
        named = False
        for part in (node.left, *node.comparators):
            if isinstance(part, ast.Name):
                if part.id not in params or part.id not in local:
                    return None
                value = known_value(local[part.id])
                if value is NOT_COMPUTED:
                    return None
                named = True
            else:
                try:
                    value = ast.literal_eval(part)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    return None
            values.append(value)
        if not named:
            return None
        try:
            return all(bool(CMP_OPS[type(op)](values[i], values[i + 1])) for i, op in enumerate(node.ops))
        except Exception:  # a comparison the literals do not support (None < 1): leave both sides
            return None


def _negated(text: str) -> str:
    """The source text of `not <text>` as the tests are written (`not x` <-> `x`)."""
    return text[4:] if text.startswith("not ") else "not " + text
