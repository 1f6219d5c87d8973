"""What the API models keep about a walk, beyond the generic interpreter's state: the handlers they are
dispatched through, the facts the caller assumed, the script's command-line options, and a few memos. The models
receive the interpreter typed as this class (`TorchState`), so they need not import the one that uses them."""

from __future__ import annotations

import ast
from typing import Any

from ddpdoctor.static.engine.interpreter import Interpreter
from ddpdoctor.static.engine.support import SourceFile
from ddpdoctor.static.project import Project
from ddpdoctor.static.semantic import Value


class TorchState(Interpreter):
    """The generic interpreter plus the state of the API models (see the module docstring)."""

    def __init__(
        self,
        source: SourceFile,
        assume: dict[str, Any] | None = None,
        registry: Any = None,
        project: Project | None = None,
    ) -> None:
        super().__init__(source, project)
        self.registry = registry  # apis.registry.ApiModels
        self.assume: dict[str, Any] = dict(assume or {})
        self.cli_args: dict[str, Any] = {}  # dest → apis.cli.CliArg
        self._forward_depth = 0
        self._has_bn_memo: dict[ast.AST, bool] = {}
        self._detached_calls: set[int] = set()  # calls whose result is `.detach()`ed right away
        self._sibling_forwards: dict[tuple, Value] = {}  # nn._own_forward: what a layer's forward returned
        self._wrapper_tests: dict[int, tuple] = {}  # nn._wrapper_check: isinstance(x, DDP) call → x
