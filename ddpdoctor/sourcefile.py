"""Reading the user's source files the way Python does, and refusing what is not one, in one place.

Every reader of user source (static analysis, the launch plan, the run directory's source snapshot) goes through
`read_source`:

- **Only regular files.** A FIFO, a character device or a terminal would block the read forever or never end
  (`/dev/zero`); files under /proc, /sys and /dev look regular but are not source (`/proc/kmsg` blocks until the
  kernel logs something). They are refused before anything is read, and the read itself never blocks
  (O_NONBLOCK).
- **Bounded.** A file larger than MAX_SOURCE_BYTES is refused with one line: static analysis costs about 20 s per
  MB here and Ctrl-C cannot interrupt the parser, and no hand-written training script is that large (generated
  code or data is).
- **Decoded as Python decodes it** (PEP 263): a UTF-8 BOM, or a `# -*- coding: latin-1 -*-` cookie on one of the
  first two lines (tokenize.detect_encoding); UTF-8 otherwise.
- **Notebooks refused.** A `.ipynb` file is JSON, not Python: Python would not run it and the probe must not
  execute its JSON. The message says how to export its code.
"""

from __future__ import annotations

import codecs
import io
import os
import stat
import tokenize
from pathlib import Path

from ddpdoctor.errors import UsageError

MAX_SOURCE_BYTES = 1_000_000
_PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def check_source_path(path: Path) -> os.stat_result:
    """Refuse what cannot be a script (one-line UsageError); returns its stat."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path}: not a file")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path}: not a regular file (a pipe, device or socket is not a script)")
    real = os.path.realpath(path)
    if any(real == fs or real.startswith(fs + os.sep) for fs in _PSEUDO_FILESYSTEMS):
        raise UsageError(f"{path}: a kernel pseudo-file ({real}), not a script")
    if str(path).lower().endswith(".ipynb"):
        raise UsageError(
            f"{path}: a Jupyter notebook, not a Python script; export its code first "
            f"(jupyter nbconvert --to script {Path(path).name})"
        )
    if st.st_size > MAX_SOURCE_BYTES:
        raise UsageError(
            f"{path}: {_mb(st.st_size)} is larger than the {_mb(MAX_SOURCE_BYTES)} ddpdoctor analyses "
            "(a training script this large is generated code or data)"
        )
    return st


def read_source_bytes(path: Path) -> bytes:
    """The raw bytes of a user source file, after `check_source_path`; never blocks, never reads past the limit."""
    check_source_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the check and the open
            raise UsageError(f"{path}: not a regular file")
        chunks: list[bytes] = []
        total = 0
        while True:
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                raise UsageError(f"{path}: reading it would block (not a regular file)") from None
            except OSError as exc:
                raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
            if not chunk:
                break
            total += len(chunk)
            if total > MAX_SOURCE_BYTES:
                raise UsageError(f"{path}: larger than the {_mb(MAX_SOURCE_BYTES)} ddpdoctor analyses")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode_source(data: bytes, path: Path | str) -> str:
    """Bytes → text as Python decodes a source file (PEP 263 cookie or BOM, else UTF-8)."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:  # no valid cookie and not UTF-8, or an unknown cookie: Python refuses it too
        detail = str(getattr(exc, "msg", None) or exc).split(" for ")[0]
        raise UsageError(f"{path}: not UTF-8 text and no valid coding declaration ({detail})") from None
    try:
        text = data.decode(encoding)
    except (UnicodeDecodeError, LookupError) as exc:
        where = f" (byte {exc.start}: {exc.reason})" if isinstance(exc, UnicodeDecodeError) else ""
        raise UsageError(f"{path}: not valid {codecs.lookup(encoding).name} text{where}") from None
    if _looks_like_notebook(text):
        raise UsageError(
            f"{path}: a Jupyter notebook (JSON), not a Python script; export its code first "
            f"(jupyter nbconvert --to script)"
        )
    return text.removeprefix("\ufeff")


def _looks_like_notebook(text: str) -> bool:
    head = text.lstrip()[:2000]
    return head.startswith("{") and '"cells"' in head and ('"nbformat"' in text[-4000:] or '"metadata"' in head)


def read_source(path: Path) -> str:
    """A user source file as text: regular, bounded, decoded as Python decodes it (see the module docstring)."""
    return decode_source(read_source_bytes(path), path)
