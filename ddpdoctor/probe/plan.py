"""How to launch a script, decided from its source (a quick AST read; never imports or runs it).

- A script that starts its own ranks (torch.multiprocessing.spawn / start_processes, multiprocessing.Process)
  and initialises a process group without reading the launcher's RANK/LOCAL_RANK/WORLD_SIZE is started ONCE;
  its children are instrumented through sitecustomize.
- A script whose argparse parser declares --local_rank / --local-rank gets `--local_rank=N`, as
  torch.distributed.launch passed it (torchrun does not).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SPAWN_CALLS = {
    "torch.multiprocessing.spawn",
    "torch.multiprocessing.start_processes",
    "torch.multiprocessing.spawn.spawn",
    "torch.multiprocessing.spawn.start_processes",
    "torch.multiprocessing.Process",
    "multiprocessing.Process",
    "multiprocessing.context.Process",
}
LAUNCHER_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE"}
LOCAL_RANK_OPTIONS = ("--local_rank", "--local-rank")


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    spawns_own_ranks: bool = False
    spawn_line: int | None = None
    reads_launcher_env: bool = False
    inits_process_group: bool = False
    local_rank_option: str | None = None
    local_rank_line: int | None = None

    @property
    def mode(self) -> str:
        return "spawn" if self.spawns_own_ranks else "torchrun"

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "spawn_line": self.spawn_line,
            "reads_launcher_env": self.reads_launcher_env,
            "inits_process_group": self.inits_process_group,
            "local_rank_option": self.local_rank_option,
            "local_rank_line": self.local_rank_line,
        }


class _Scanner(ast.NodeVisitor):
    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self.spawn_line: int | None = None
        self.reads_env = False
        self.init_pg = False
        self.local_rank: tuple[str, int] | None = None

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                root = a.name.split(".")[0]
                self.aliases.setdefault(root, root)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level:
            for a in node.names:
                self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def visit_Assign(self, node: ast.Assign) -> None:
        # ctx = mp.get_context("spawn") → ctx.Process(...) is a multiprocessing Process
        if isinstance(node.value, ast.Call):
            inner = self._name(node.value.func) or ""
            if inner.endswith("get_context") and "multiprocessing" in inner:
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.aliases[target.id] = inner.rsplit(".", 1)[0] + ".context"
        self.generic_visit(node)

    def _name(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self._name(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):  # mp.get_context("spawn").Process
            inner = self._name(node.func)
            if inner and inner.endswith("get_context"):
                return inner.rsplit(".", 1)[0] + ".context"
        return None

    def visit_Call(self, node: ast.Call) -> None:
        name = self._name(node.func) or ""
        if name in SPAWN_CALLS or (name.endswith(".Process") and "multiprocessing" in name):
            if self.spawn_line is None:
                self.spawn_line = node.lineno
        if name.endswith("init_process_group"):
            self.init_pg = True
        if name.endswith(("environ.get", "getenv")) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and first.value in LAUNCHER_ENV:
                self.reads_env = True
        if name.endswith("add_argument"):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and arg.value in LOCAL_RANK_OPTIONS and self.local_rank is None:
                    self.local_rank = (arg.value, node.lineno)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load) and (self._name(node.value) or "").endswith("environ"):
            key = node.slice
            if isinstance(key, ast.Constant) and key.value in LAUNCHER_ENV:
                self.reads_env = True
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if (
            isinstance(node.left, ast.Constant)
            and node.left.value in LAUNCHER_ENV
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
        ):
            self.reads_env = True
        self.generic_visit(node)


def plan_launch(source: str) -> LaunchPlan:
    """The launch plan for a script's source text. A syntax error gives the default plan (static analysis
    reports it)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return LaunchPlan()
    s = _Scanner()
    s.visit(tree)
    spawns = s.spawn_line is not None and s.init_pg and not s.reads_env
    return LaunchPlan(
        spawns_own_ranks=spawns,
        spawn_line=s.spawn_line,
        reads_launcher_env=s.reads_env,
        inits_process_group=s.init_pg,
        local_rank_option=s.local_rank[0] if s.local_rank and not spawns else None,
        local_rank_line=s.local_rank[1] if s.local_rank else None,
    )


def plan_for_file(script: Path) -> LaunchPlan:
    try:
        return plan_launch(script.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return LaunchPlan()
