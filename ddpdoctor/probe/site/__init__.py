"""The directory put first on PYTHONPATH inside a probe run: its `sitecustomize` instruments processes that the
script itself starts (children of torch.multiprocessing.spawn / multiprocessing with the spawn or forkserver
start method), which re-import the script and would otherwise run uninstrumented."""

from __future__ import annotations

import os


def site_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))
