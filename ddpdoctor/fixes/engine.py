"""The fix engine: text edits by position, applied bottom-up, with conflict detection and a unified diff.

A rule's fix (`ddpdoctor/rules/ddNNN_*/fix.py`) reads one finding and the file's source (`Code`: text, AST, the
script's indentation and quotes) and returns a `Patch` (small edits at line/column positions, in the script's own
names) or raises `NoFix` with the reason. The engine never writes anything: `plan` turns findings into patches,
`apply` returns the patched text, `unified_diff` the diff. Nothing here imports torch.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import io
import sys
import tokenize
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules import get_rule

__all__ = ["Code", "Edit", "NoFix", "Patch", "Plan", "apply", "fix_module", "plan", "unified_diff"]


class NoFix(Exception):
    """A finding whose fix is not mechanical here (the names are unknown, the code is not in the expected shape):
    the message says why, and the finding keeps its prose fix."""


@dataclass(frozen=True)
class Edit:
    """Replace the text from (line, col) to (end_line, end_col) with `text`; lines 1-based, columns 0-based in
    characters. An insertion has end == start."""

    line: int
    col: int
    end_line: int
    end_col: int
    text: str

    @property
    def start(self) -> tuple[int, int]:
        return (self.line, self.col)

    @property
    def end(self) -> tuple[int, int]:
        return (self.end_line, self.end_col)

    def overlaps(self, other: "Edit") -> bool:
        if self == other:
            return False
        if self.start == self.end or other.start == other.end:  # an insertion conflicts only strictly inside
            return self.start < other.end and other.start < self.end
        return self.start < other.end and other.start < self.end


@dataclass(frozen=True)
class Patch:
    """One finding's fix as edits, and one line saying what it does."""

    rule: str
    line: int | None
    edits: tuple[Edit, ...]
    summary: str


@dataclass
class Plan:
    """The patches of one file that do not conflict, and the findings left without one (finding, why)."""

    path: str
    text: str
    patches: list[Patch] = field(default_factory=list)
    unfixed: list[tuple[Finding, str]] = field(default_factory=list)
    fixed: list[tuple[Finding, Patch]] = field(default_factory=list)

    @property
    def new_text(self) -> str:
        return apply(self.text, [e for p in self.patches for e in p.edits])

    def diff(self, new_name: str | None = None) -> str:
        return unified_diff(self.path, self.text, self.new_text, new_name=new_name)


class Code:
    """One file's source for the fixes: its lines, AST and conventions (indent unit, quote character)."""

    def __init__(self, text: str, path: str = "<script>") -> None:
        self.text = text
        self.path = path
        self.lines = text.splitlines(keepends=True)
        self.tree = ast.parse(text)
        self._parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self._parents[child] = node

    # -- positions ---------------------------------------------------------------------------------------------

    def char_col(self, line: int, byte_col: int) -> int:
        """ast's UTF-8 byte column as a character column."""
        raw = self.lines[line - 1].encode("utf-8")
        return len(raw[:byte_col].decode("utf-8", errors="replace"))

    def start(self, node: ast.AST) -> tuple[int, int]:
        return node.lineno, self.char_col(node.lineno, node.col_offset)

    def end(self, node: ast.AST) -> tuple[int, int]:
        return node.end_lineno, self.char_col(node.end_lineno, node.end_col_offset)

    def segment(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.text, node) or ""

    def parent(self, node: ast.AST) -> ast.AST | None:
        return self._parents.get(node)

    def line_text(self, line: int) -> str:
        return self.lines[line - 1].rstrip("\r\n") if 0 < line <= len(self.lines) else ""

    def indent(self, line: int) -> str:
        text = self.line_text(line)
        return text[: len(text) - len(text.lstrip(" \t"))]

    @property
    def newline(self) -> str:
        first = self.lines[0] if self.lines else "\n"
        return "\r\n" if first.endswith("\r\n") else "\n"

    @property
    def indent_unit(self) -> str:
        """The script's indentation step (four spaces unless it indents otherwise)."""
        for node in ast.walk(self.tree):
            body = getattr(node, "body", None)
            if isinstance(node, ast.stmt) and isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                outer, inner = self.indent(node.lineno), self.indent(body[0].lineno)
                if len(inner) > len(outer) and inner.startswith(outer):
                    return inner[len(outer):]
        return "    "

    @property
    def quote(self) -> str:
        """The quote character most of the script's plain strings use."""
        counts = {'"': 0, "'": 0}
        try:
            for tok in tokenize.generate_tokens(io.StringIO(self.text).readline):
                if tok.type == tokenize.STRING and tok.string[:1] in counts and not tok.string.startswith('"""'):
                    counts[tok.string[0]] += 1
        except (tokenize.TokenError, SyntaxError):
            pass
        return "'" if counts["'"] > counts['"'] else '"'

    def string(self, value: str) -> str:
        q = self.quote
        return f"{q}{value}{q}"

    # -- finding nodes -----------------------------------------------------------------------------------------

    def nodes(self, kind: type | tuple[type, ...], line: int | None = None) -> Iterator[ast.AST]:
        """Nodes of `kind` starting on `line` (any line: None), in source order."""
        found = [n for n in ast.walk(self.tree) if isinstance(n, kind) and (line is None or n.lineno == line)]
        yield from sorted(found, key=lambda n: (n.lineno, n.col_offset))

    def calls(self, line: int | None, name: str | None = None) -> list[ast.Call]:
        """Calls on `line` whose callee's last name is `name` (any: None)."""
        return [c for c in self.nodes(ast.Call, line) if name is None or callee_name(c) == name]

    def statement(self, node: ast.AST) -> ast.stmt:
        """The statement that holds `node`."""
        while not isinstance(node, ast.stmt):
            parent = self.parent(node)
            if parent is None:
                raise NoFix("the code is not inside a statement")
            node = parent
        return node

    def statement_at(self, line: int) -> ast.stmt:
        """The innermost statement that starts on `line`."""
        found = [n for n in self.nodes(ast.stmt, line)]
        if not found:
            raise NoFix(f"no statement starts on line {line}")
        return max(found, key=lambda n: (n.col_offset, -n.end_lineno))

    def enclosing(self, node: ast.AST, kind: type | tuple[type, ...]) -> ast.AST | None:
        node = self.parent(node)
        while node is not None and not isinstance(node, kind):
            node = self.parent(node)
        return node

    def imported_names(self) -> set[str]:
        """Names bound at module level by imports, assignments, defs and classes."""
        names: set[str] = set()
        for node in self.tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        return names

    def module_alias(self, module: str) -> str | None:
        """The name the script imported `module` as (`import torch.distributed as dist` -> "dist")."""
        imports = [a for node in ast.walk(self.tree) if isinstance(node, ast.Import) for a in node.names]
        for a in imports:
            if a.name == module:
                return a.asname or a.name
        for a in imports:
            if a.asname is None and module.startswith(a.name + "."):
                return module
        return None

    def scope(self, node: ast.AST) -> ast.AST:
        """The function (or module) whose names `node` sees."""
        return self.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or self.tree

    def bound_names(self, scope: ast.AST) -> set[str]:
        """Every name assigned, imported or defined in `scope` (and module level)."""
        names = set(self.imported_names())
        for n in ast.walk(scope):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
        return names

    def fresh(self, preferred: str, scope: ast.AST) -> str:
        """`preferred`, or `preferred_2`... when the scope already binds it."""
        taken = self.bound_names(scope)
        name, i = preferred, 2
        while name in taken:
            name, i = f"{preferred}_{i}", i + 1
        return name

    def loop_at(self, line: int) -> ast.For | ast.While:
        found = [n for n in self.nodes((ast.For, ast.AsyncFor, ast.While), line)]
        if not found:
            raise NoFix(f"no loop starts on line {line}")
        return found[-1]

    def epoch_loop(self, line: int, *, inner: bool) -> tuple[ast.For, str]:
        """The epoch loop and its counter: the loop on `line` itself (inner False) or the loop around it (inner True,
        `line` being the loop over the data), when it is a `for NAME in ...` loop."""
        loop: ast.AST | None = self.loop_at(line)
        if inner:
            loop = self.enclosing(loop, (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef, ast.AsyncFunctionDef))
        if not isinstance(loop, (ast.For, ast.AsyncFor)):
            raise NoFix("the epoch loop has no epoch counter to pass to set_epoch")
        target = loop.target
        if not isinstance(target, ast.Name) or target.id == "_":
            raise NoFix("the epoch loop has no named epoch counter to pass to set_epoch")
        return loop, target.id

    def first_in_body(self, body: list[ast.stmt], statements: Iterable[str]) -> Edit:
        """Lines at the top of a block, indented like its first statement (after a docstring-free start)."""
        first = body[0]
        if first.lineno == self.enclosing_header_line(first):
            raise NoFix(f"the block of line {first.lineno} is on one line")
        return self.insert_lines_before(first.lineno, statements)

    def enclosing_header_line(self, stmt: ast.stmt) -> int:
        parent = self.parent(stmt)
        return getattr(parent, "lineno", 0)

    # -- edits -------------------------------------------------------------------------------------------------

    def replace(self, node: ast.AST, text: str) -> Edit:
        (l1, c1), (l2, c2) = self.start(node), self.end(node)
        return Edit(l1, c1, l2, c2, text)

    def insert_at(self, line: int, col: int, text: str) -> Edit:
        return Edit(line, col, line, col, text)

    def insert_lines_before(self, line: int, statements: Iterable[str], indent: str | None = None) -> Edit:
        """Whole lines before `line`, indented like it (or with `indent`)."""
        ind = self.indent(line) if indent is None else indent
        nl = self.newline
        return self.insert_at(line, 0, "".join(f"{ind}{s}{nl}" for s in statements))

    def insert_lines_after(self, stmt: ast.stmt, statements: Iterable[str], indent: str | None = None) -> Edit:
        """Whole lines after the statement `stmt` (its last line), indented like it."""
        ind = self.indent(stmt.lineno) if indent is None else indent
        nl = self.newline
        line = stmt.end_lineno + 1
        text = "".join(f"{ind}{s}{nl}" for s in statements)
        if line > len(self.lines):
            last = self.lines[-1] if self.lines else ""
            prefix = "" if last.endswith(("\n", "\r")) else nl
            return self.insert_at(len(self.lines), len(last.rstrip("\r\n")) + len(last) - len(last.rstrip("\r\n")),
                                  prefix + text)
        return self.insert_at(line, 0, text)

    def replace_lines(self, first: int, last: int, text: str) -> Edit:
        """Replace whole lines first..last (inclusive) with `text` (which ends with its newline)."""
        if last >= len(self.lines):
            end = self.lines[-1]
            return Edit(first, 0, len(self.lines), len(end), text if end.endswith(("\n", "\r")) else text.rstrip())
        return Edit(first, 0, last + 1, 0, text)

    def indent_lines(self, first: int, last: int, unit: str | None = None) -> list[Edit]:
        """One more indentation step on lines first..last, as insertions at column 0 (so a fix inside those lines,
        another finding's, does not overlap): blank lines and lines inside a multi-line string stay as they are."""
        unit = self.indent_unit if unit is None else unit
        inside: set[int] = set()
        for n in ast.walk(self.tree):
            if isinstance(n, (ast.Constant, ast.JoinedStr)) and n.end_lineno > n.lineno:
                inside.update(range(n.lineno + 1, n.end_lineno + 1))
        return [self.insert_at(k, 0, unit) for k in range(first, last + 1)
                if k not in inside and self.line_text(k).strip()]

    def delete_statement(self, stmt: ast.stmt) -> Edit:
        """Remove the statement's whole lines (it must be alone on them)."""
        if self.line_text(stmt.lineno)[: self.char_col(stmt.lineno, stmt.col_offset)].strip():
            raise NoFix(f"line {stmt.lineno} holds more than the statement")
        return Edit(stmt.lineno, 0, stmt.end_lineno + 1, 0, "")

    def imported_as(self, module: str, statement: str, binds: str) -> tuple[str, list[Edit]]:
        """The name `module` goes by in the script, importing it with `statement` (which binds `binds`) where the
        script does not: (name, the import's edit or none). NoFix when `binds` already names something else."""
        alias = self.module_alias(module)
        if alias is not None:
            return alias, []
        imp = self.add_import(statement, binds)
        if imp is None:
            raise NoFix(f"the name `{binds}` is taken")
        return binds, [imp]

    def add_import(self, statement: str, binds: str) -> Edit | None:
        """`statement` (e.g. `import os`) after the module's last top-level import, unless `binds` is bound."""
        if binds in self.imported_names():
            return None
        imports = [n for n in self.tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        module = statement.split()[1]
        if imports:  # in its group (standard library or the same package), in order where the group is sorted
            top = module.split(".")[0]
            std = top in sys.stdlib_module_names
            group = [n for n in imports if _top(n) != "__future__"
                     and ((_top(n) in sys.stdlib_module_names) if std else _top(n) == top)]
            if std and statement.startswith("import "):
                later = [n for n in group if isinstance(n, ast.Import) and n.names[0].name > module]
                if later:
                    return self.insert_lines_before(later[0].lineno, [statement], indent="")
                plain = [n for n in group if isinstance(n, ast.Import)]
                if plain:
                    return self.insert_lines_after(plain[-1], [statement], indent="")
            if group:
                return self.insert_lines_after(group[-1], [statement], indent="")
            if std:
                first = next((n for n in imports if _top(n) != "__future__"), None)
                if first is not None:
                    return self.insert_lines_before(first.lineno, [statement, ""], indent="")
            return self.insert_lines_after(imports[-1], [statement], indent="")
        body = self.tree.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            return self.insert_lines_after(body[0], [statement], indent="")
        return self.insert_at(1, 0, statement + self.newline)

    def env_int(self, var: str) -> tuple[str, list[Edit]]:
        """`int(os.environ["VAR"])` in the script's spelling of `os`, with the import it needs."""
        alias = self.module_alias("os")
        edits = []
        if alias is None:
            alias = "os"
            imp = self.add_import("import os", "os")
            if imp is not None:
                edits.append(imp)
        return f"int({alias}.environ[{self.string(var)}])", edits


def _top(node: ast.Import | ast.ImportFrom) -> str:
    name = node.names[0].name if isinstance(node, ast.Import) else (node.module or "")
    return name.split(".")[0]


def callee_name(call: ast.Call) -> str | None:
    """The last name of a call's callee (`nn.SyncBatchNorm.convert_sync_batchnorm` -> "convert_sync_batchnorm")."""
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return None


def keyword(call: ast.Call, name: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == name), None)


# -- planning and applying ---------------------------------------------------------------------------------------


def fix_module(code: str):  # noqa: ANN201 - the rule's fix module, or None
    """The rule's `fix` module (`ddpdoctor/rules/ddNNN_*/fix.py`), or None when the rule has no automatic fix."""
    from ddpdoctor.rules.rule import has_hook

    rule = get_rule(code)
    if not has_hook(rule.package, "fix"):
        return None
    return importlib.import_module(f"{rule.package}.fix")


def plan(path: str, text: str, findings: Iterable[Finding], *, unsafe: bool = False) -> Plan:
    """Each finding's patch, in the order given, minus those that conflict with an earlier one. A finding of
    `possible` confidence (a heuristic: the lr may have been tuned for the global batch already) is patched only
    when `unsafe` (ruff's `--unsafe-fixes`): its fix could change a script that was right."""
    result = Plan(path=path, text=text)
    try:
        code = Code(text, path)
    except SyntaxError as exc:
        result.unfixed = [(f, f"the file does not parse ({exc.msg})") for f in findings]
        return result
    accepted: list[tuple[Edit, str]] = []
    for f in findings:
        module = fix_module(f.rule)
        if module is None:
            result.unfixed.append((f, "no automatic fix for this rule"))
            continue
        if f.confidence <= Confidence.POSSIBLE and not unsafe:
            result.unfixed.append((f, "the finding is only possible: confirm it (the probe measures it; for DD401 "
                                      "pass --base-lr/--base-batch), or pass --unsafe-fixes"))
            continue
        try:
            patch = module.fix(f, code)
        except NoFix as exc:
            result.unfixed.append((f, str(exc)))
            continue
        edits = tuple(e for e in patch.edits if all(e != a for a, _ in accepted))  # the same edit once
        clash = next(((a, rule) for e in edits for a, rule in accepted if e.overlaps(a)), None)
        if clash is not None:
            result.unfixed.append((f, f"its fix overlaps {clash[1]}'s at line {clash[0].line}: apply that one, "
                                      "then run --diff again"))
            continue
        patch = Patch(rule=patch.rule, line=patch.line, edits=edits, summary=patch.summary)
        if not edits:  # another finding's patch already makes exactly this change
            result.fixed.append((f, patch))
            continue
        candidate = apply(text, [e for p in [*result.patches, patch] for e in p.edits])
        try:
            ast.parse(candidate)
        except SyntaxError:
            result.unfixed.append((f, "its patch would not parse (internal: please report it)"))
            continue
        accepted.extend((e, f.rule) for e in edits)
        result.patches.append(patch)
        result.fixed.append((f, patch))
    return result


def _offset(lines: list[str], line: int, col: int) -> int:
    return sum(len(s) for s in lines[: line - 1]) + col


def apply(text: str, edits: Iterable[Edit]) -> str:
    """`text` with the edits applied bottom-up (later positions first, so earlier positions stay valid); edits at
    the same position keep their given order."""
    lines = text.splitlines(keepends=True)
    indexed = list(enumerate(edits))
    indexed.sort(key=lambda ie: (_offset(lines, *ie[1].start), ie[0]), reverse=True)
    out = text
    for _, e in indexed:
        a, b = _offset(lines, *e.start), _offset(lines, *e.end)
        out = out[:a] + e.text + out[b:]
    return out


def unified_diff(path: str, old: str, new: str, *, new_name: str | None = None) -> str:
    """The diff `patch -p0` applies (`--- a` / `+++ b` name the same file unless `new_name`)."""
    if old == new:
        return ""
    lines = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True), fromfile=path,
                                 tofile=new_name or path)
    out = []
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)
