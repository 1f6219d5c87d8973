"""Automatic fixes (`check --diff` / `--fix` / `--fix --verify`): the engine (`engine`) turns findings into text
edits through each rule's `fix.py`; `command` is what the CLI runs. See CONTRIBUTING.md "A rule's fix"."""
