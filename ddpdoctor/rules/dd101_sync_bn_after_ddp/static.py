"""DD101 sync-bn-after-ddp: `convert_sync_batchnorm` applied to a model that DDP already wraps.

What it flags: a `convert_sync_batchnorm` (or apex `convert_syncbn_model`) call whose argument is a DDP wrapper,
or a module that a DDP call wrapped earlier in execution order — also when the wrap and the conversion happen in
different functions or methods (`self.model = DDP(...)` in `__init__`, conversion in `setup()`).

What stays silent: conversion before wrapping (the documented order), conversion of a different model (a teacher,
an EMA copy), a wrap that only happens after the conversion.

Confidence: certain when both calls sit in the same function body on names; likely when the model reached the
conversion through parameters, attributes or return values, or the API was recognised by its name only.
"""

from __future__ import annotations

from typing import Iterator

from ddpdoctor.findings import Confidence, Finding
from ddpdoctor.rules.dd101_sync_bn_after_ddp import CODE
from ddpdoctor.static.model import ScriptModel, cap_unreached


def check(script: ScriptModel) -> Iterator[Finding]:
    for conv in script.of("convert_syncbn"):
        for obj in conv.data["target"]:
            if obj.kind == "wrapper" and obj.wrapper_kind == "ddp":
                wrap = script.wrap_event_of(obj)
            else:
                wrap = script.wrap_event_before(obj, conv)
            if wrap is None or wrap.seq > conv.seq or wrap.exclusive_with(conv):
                continue
            same_body = wrap.frame == conv.frame
            confidence = Confidence.CERTAIN if same_body else Confidence.LIKELY
            if conv.data.get("heuristic") or wrap.data.get("heuristic"):
                confidence = min(confidence, Confidence.LIKELY)
            confidence = cap_unreached(confidence, conv, wrap)
            wrapped_text = script.text(wrap.data["args"].node(0, "module"))
            converted_text = script.text(conv.data.get("arg_node"))
            yield script.finding(
                CODE,
                line=conv,
                message=f"DDP wraps `{wrapped_text}` at {script.place(wrap, conv)} but convert_sync_batchnorm is "
                f"applied to `{converted_text}` at line {conv.line}, after the wrapping",
                confidence=confidence,
                evidence={
                    "wrap_line": wrap.line,
                    "convert_line": conv.line,
                    "wrapped": wrapped_text,
                    "converted": converted_text,
                    "converted_is_wrapper": obj.kind == "wrapper",
                },
            )
            break
