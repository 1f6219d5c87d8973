"""Severity and confidence: the two scales every finding and every rule is placed on.

A leaf module (it imports nothing of ddpdoctor), so the rules, the finding model and the configuration can all
use it without importing each other.
"""

from __future__ import annotations

import enum


class Severity(enum.IntEnum):
    """How much a cause can cost accuracy. Ordered: info < low < medium < high < critical."""

    INFO = 0
    LOW = 1
    MEDIUM = 2
    HIGH = 3
    CRITICAL = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> "Severity":
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(
                f"unknown severity {text!r} (expected one of: {', '.join(s.label for s in cls)})"
            ) from None


class Confidence(enum.IntEnum):
    """How sure we are. certain = observed on the ranks or certain from syntax; likely = inferred through
    names/aliases/data flow; possible = heuristic."""

    POSSIBLE = 0
    LIKELY = 1
    CERTAIN = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> "Confidence":
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown confidence {text!r}") from None
