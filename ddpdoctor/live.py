"""What the other ddpdoctor processes running right now write into the user's folders, so that a probe's
before/after fingerprint of those folders (ddpdoctor.probe.usertree) does not blame the script for another
ddpdoctor's files.

Two `ddpdoctor check` runs in one folder (`ddpdoctor check a.py > a.txt & ddpdoctor check b.py -o b.json`): each
one's stdout file grows and its report appears while the other one's probe runs. The other runs are found where
the operating system lists them, not in files of ours (which a SIGKILL would leave behind): every process whose
command line is ddpdoctor's CLI (`python -m ddpdoctor ...`, the `ddpdoctor` script), read from /proc — its stdout
and stderr when they are files (device, inode), and the `--output`/`-o` file its command line names (with the
temporary file beside it that the report is written to first and renamed from).

A probe looks before its first fingerprint, while its ranks run and before its second fingerprint
(`Neighbours.look`), and keeps everything it saw: another run lives from its start to its end, much longer than
the second between two looks, and writes its report before it ends. Where there is no /proc, nothing is found
(the other run's files are then reported as changed, as before). Stdlib only.
"""

from __future__ import annotations

import os
import stat

PROC = "/proc"
_OUTPUT_OPTIONS = ("-o", "--output")


def _is_cli(argv: list[str]) -> bool:
    """`argv` starts ddpdoctor's command line: `python -m ddpdoctor ...` or the `ddpdoctor` script."""
    for i, arg in enumerate(argv[:3]):
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] == "ddpdoctor":
            return True
        if os.path.basename(arg) == "ddpdoctor":
            return True
    return False


def _outputs(argv: list[str], cwd: str) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        value = None
        if arg in _OUTPUT_OPTIONS and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--output="):
            value = arg[len("--output="):]
        elif arg.startswith("-o") and len(arg) > 2 and not arg.startswith("--"):
            value = arg[2:]
        if value and value != "-":
            out.append(os.path.realpath(os.path.join(cwd, value)))  # as write_output resolves it
    return out


class Neighbours:
    """The output files of the other ddpdoctor processes seen so far (see the module docstring)."""

    def __init__(self) -> None:
        self.files: set[tuple[int, int]] = set()
        self.paths: set[str] = set()

    def look(self) -> None:
        try:
            pids = [int(n) for n in os.listdir(PROC) if n.isdigit()]
        except OSError:
            return
        me = os.getpid()
        for pid in pids:
            if pid == me:
                continue
            base = os.path.join(PROC, str(pid))
            try:
                with open(os.path.join(base, "cmdline"), "rb") as fh:
                    argv = [os.fsdecode(a) for a in fh.read().split(b"\0") if a]
            except OSError:
                continue
            if not _is_cli(argv):
                continue
            for fd in ("1", "2"):
                try:
                    st = os.stat(os.path.join(base, "fd", fd))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    self.files.add((st.st_dev, st.st_ino))
            try:
                cwd = os.readlink(os.path.join(base, "cwd"))
            except OSError:
                continue
            self.paths.update(_outputs(argv, cwd))

    def wrote(self, path: str, st: os.stat_result | None) -> bool:
        """`path` (with its stat, None when it is gone) is another ddpdoctor's output: its stdout or stderr file,
        its --output report, or the temporary file that report is written to first."""
        if st is not None and (st.st_dev, st.st_ino) in self.files:
            return True
        if path in self.paths:
            return True
        folder, name = os.path.split(path)
        return any(
            os.path.dirname(p) == folder and name.startswith(f".{os.path.basename(p)}.") and name.endswith(".tmp")
            for p in self.paths
        )
