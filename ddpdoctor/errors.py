"""Errors that mean "could not analyse": the CLI prints them as one line on stderr and exits 2."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user (missing file, syntax error, bad option, unknown rule)."""


class InternalError(Exception):
    """ddpdoctor itself failed; still one line and exit 2, never a traceback."""
