"""The generic interpreter of the static analysis: Python statements, expressions, calls, values and frames over
abstract objects, with no knowledge of any library. See `interpreter` for how it walks a script and `hooks` for
where library models plug in (`ddpdoctor.static.apis`)."""

from __future__ import annotations

from ddpdoctor.static.engine.interpreter import Interpreter
from ddpdoctor.static.engine.support import Args, SourceFile, SourceIndex

__all__ = ["Args", "Interpreter", "SourceFile", "SourceIndex"]
