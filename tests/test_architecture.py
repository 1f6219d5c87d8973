"""The shape of the code, checked: imports flow one way (no cycle), probe analyses do not read static analysis,
and a rule's package `__init__.py` stays a declaration (reading the catalog loads no analysis code).

The import graph is read from the source (every import, also those inside functions), so it needs no import."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ddpdoctor"

# Arrows from a probe analysis into static analysis that still exist (none: the canonical torch names live in the
# neutral ddpdoctor.torchnames).
PENDING_ARROWS: set[tuple[str, str]] = set()

# Modules outside the rule packages that still import one (a rule's constant or helper), with the reason.
PENDING_RULE_IMPORTS: dict[str, str] = {}  # none left: every module outside the rules reads them through the catalog

# A module longer than this says at its top why it is one module (a paragraph starting "Size:" in its docstring).
LONG = 600
# Long modules whose split or reason is in flight.
PENDING_LONG: set[str] = set()

# Modules over 800 lines, each with why it is one module (the full reason is the "Size:" paragraph of its
# docstring). A module that grows past 800 lines is split, or added here with its reason.
VERY_LONG = 800
VERY_LONG_MODULES = {
    "ddpdoctor.events": "EVENT_KINDS, the one documented list of the probe's event kinds (the reader is rundata)",
    "ddpdoctor.probe.emulation": "the CUDA emulation is one state every patch reads, installed and undone as a whole",
    "ddpdoctor.probe.fsview": "the file view is one state every patched call asks the same three questions of",
    "ddpdoctor.probe.standins.horovod.torch.mpi_ops": "Horovod's own mpi_ops is one module scripts import names from",
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _dynamic_target(node: ast.Call) -> str | None:
    """The module an `importlib.import_module(...)` / `__import__(...)` call names: a literal, or an f-string's
    literal head (`f"ddpdoctor.rules.{name}"` is at least `ddpdoctor.rules`)."""
    fn = node.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".") or None
    return None


def _imports(module: str) -> set[str]:
    """The ddpdoctor modules `module` imports, anywhere in its body, importlib's imports of a named module
    included."""
    out: set[str] = set()
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    # a module-level `__getattr__` (PEP 562) is a facade's lazy attribute: it runs after the module was imported,
    # from the package's public names down to the API (`ddpdoctor.check`), so it is no dependency of the module
    tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and (target := _dynamic_target(node)):
            targets = [target]
        else:
            continue
        out.update(t for t in map(_resolve, targets) if t and t != module)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    assert _cycles() == []


def test_probe_analyses_do_not_import_static_analysis():
    probe_side = [m for m in MODULES if m.startswith("ddpdoctor.analyses") or m.endswith(".probe")]
    arrows = {(m, t) for m in probe_side for t in GRAPH[m] if t.startswith("ddpdoctor.static")}
    assert arrows == PENDING_ARROWS


def test_a_rule_package_init_is_a_declaration():
    """It imports the scales, the Rule class and other rules' parameters (their `__init__`), nothing else."""
    inits = {m for m in MODULES if m.startswith("ddpdoctor.rules.dd") and MODULES[m].name == "__init__.py"}
    allowed = {"ddpdoctor.levels", "ddpdoctor.rules.rule"} | inits
    for m in inits:
        assert GRAPH[m] <= allowed, (m, GRAPH[m] - allowed)


def test_a_long_module_says_why_it_is_one_module():
    unexplained = []
    for m, path in sorted(MODULES.items()):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") <= LONG:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not any(line.startswith("Size:") for line in doc.splitlines()) and m not in PENDING_LONG:
            unexplained.append(m)
    assert unexplained == []
    assert all(m in MODULES for m in PENDING_LONG), "a pending module is gone: take it off PENDING_LONG"


def test_importlib_imports_are_in_the_graph():
    # `importlib.import_module("ddpdoctor.x")` is an import like any other
    call = ast.parse('importlib.import_module("ddpdoctor.rules.dd202_small_bn_batch")').body[0].value
    assert _dynamic_target(call) == "ddpdoctor.rules.dd202_small_bn_batch"
    call = ast.parse('importlib.import_module(f"ddpdoctor.rules.{x}")').body[0].value
    assert _dynamic_target(call) == "ddpdoctor.rules"


def test_nothing_outside_the_rules_imports_a_rule_package():
    """A rule's threshold reaches the analyses, bn/, the probe, the options and the reports through the catalog
    (`ddpdoctor.rules.setting`), never by importing the rule: the layers below the rules stay below them."""
    def is_rule_package(m: str) -> bool:
        return m.startswith("ddpdoctor.rules.dd")

    arrows = {
        m: sorted(t for t in GRAPH[m] if is_rule_package(t))
        for m in MODULES
        if not m.startswith("ddpdoctor.rules") and any(is_rule_package(t) for t in GRAPH[m])
    }
    assert set(arrows) == set(PENDING_RULE_IMPORTS), arrows
    assert all(m in MODULES for m in PENDING_RULE_IMPORTS)


def test_no_module_over_800_lines_without_a_stated_reason():
    over = {m for m, path in MODULES.items() if path.read_text(encoding="utf-8").count("\n") > VERY_LONG}
    assert over == set(VERY_LONG_MODULES), {"split or list": sorted(over - set(VERY_LONG_MODULES)),
                                            "no longer long": sorted(set(VERY_LONG_MODULES) - over)}
    for m in over:
        doc = ast.get_docstring(ast.parse(MODULES[m].read_text(encoding="utf-8"))) or ""
        assert any(line.startswith("Size:") for line in doc.splitlines()), m


def test_the_event_schema_does_not_import_the_run_reader():
    # ddpdoctor.events is the schema (the probe inside the ranks imports it); ddpdoctor.rundata reads run
    # directories. The reader's old names stay reachable from ddpdoctor.events, loaded on first use.
    assert not {t for t in GRAPH["ddpdoctor.events"] if t.startswith("ddpdoctor.")}
    import ddpdoctor.events as events
    import ddpdoctor.rundata as rundata

    assert events.read_run is rundata.read_run and events.RunData is rundata.RunData


def test_bn_is_one_layer_below_the_probe():
    """ddpdoctor.bn (the exact SyncBN, the BN statistics, what runs inside compare-bn's ranks) is one layer, below the
    probe: the probe's CUDA emulation and stand-ins, the analyses and compare-bn's caller side (ddpdoctor.comparebn,
    above the probe: it launches the ranks under the supervisor) import it; it imports nothing of ddpdoctor but
    itself."""
    bn = {m for m in MODULES if m == "ddpdoctor.bn" or m.startswith("ddpdoctor.bn.")}
    assert {(m, t) for m in bn for t in GRAPH[m] if t not in bn} == set()
    users = {m.split(".")[1] for m in MODULES if m not in bn and GRAPH[m] & bn}
    assert {"probe", "analyses", "comparebn"} <= users, users
    # compare-bn's caller side stands on the probe's supervisor; nothing of the probe imports it back
    comparebn = {m for m in MODULES if m.startswith("ddpdoctor.comparebn")}
    assert any(t.startswith("ddpdoctor.probe") for m in comparebn for t in GRAPH[m])
    assert not {(m, t) for m in MODULES if m.startswith(("ddpdoctor.probe", "ddpdoctor.bn"))
                for t in GRAPH[m] if t in comparebn}
