"""What every test module shares: the repository's paths and `ddpdoctor` run in-process.

A CLI test needs a subprocess only for what a process has and a call does not: its own environment, standard
streams that are closed, pipes or devices, signals, the installed entry point. Everything else runs through
`ddpdoctor.cli.main(argv)` in this process (`run_cli`, or the `cli` fixture): the same code path after the
command line is parsed, without paying an interpreter and typer's import per call (about 0.3 s each, a minute of
the fast suite)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`ddpdoctor ARGS` in this process: its exit code, stdout and stderr as a finished process would give them."""
    from ddpdoctor.cli import main

    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    try:
        os.chdir(cwd or REPO)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(["ddpdoctor", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    """`cli("check", "x.py", "--static")` → CompletedProcess (returncode, stdout, stderr), run in-process."""
    return run_cli


@pytest.fixture(scope="session")
def _launch_pool():
    """This worker's running launch for in-process probe runs (tests/launchpool.py)."""
    from launchpool import Pool

    pool = Pool(str(REPO))
    yield pool
    pool.close()


@pytest.fixture(autouse=True, scope="module")
def _pooled_launches(request: pytest.FixtureRequest):
    """A module's in-process probe runs, its module-scoped fixtures' included, are orders of the worker's running
    launch (tests/launchpool.py), unless the module is marked `own_launch` or DDPDOCTOR_TEST_POOL=0 is set."""
    from launchpool import POOL_ENV, install

    if request.node.get_closest_marker("own_launch") is not None or os.environ.get(POOL_ENV) == "0":
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        install(request.getfixturevalue("_launch_pool"), patch)
        yield


@pytest.fixture(autouse=True)
def _own_launch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked `own_launch` in a pooled module: its runs are launched alone."""
    if request.node.get_closest_marker("own_launch") is not None:
        from launchpool import uninstall

        uninstall(monkeypatch)


@pytest.fixture(autouse=True)
def _report_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Text reports are as wide as `COLUMNS` says (in a pipe too): every test reads them at the 100 columns a pipe
    gets without it, whatever the shell that runs the suite exports (a terminal's COLUMNS=80 broke the golden text
    reports). The processes a test starts inherit it; a test about widths sets its own."""
    monkeypatch.setenv("COLUMNS", "100")


@pytest.fixture(autouse=True, scope="session")
def _interruptible() -> None:
    """Ctrl-C reaches the processes the tests start, as it does a user's: a pytest-xdist worker ignores SIGINT
    (its controller handles Ctrl-C), and an ignored signal is inherited across exec — a `ddpdoctor` started there
    would never see the SIGINT a test sends it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's, which marks each grouped test's node id with `@group`
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with multi-rank tests first, the others after them (file order kept within each kind).

    `make test` runs pytest-xdist workers (one per core) with `--dist loadgroup`: a module grouped with
    `xdist_group` (its tests share runs that a module-scoped fixture makes once) is one unit of work, scheduled
    largest first; every other test is a unit of its own, handed out in collection order. A multi-rank test takes
    seconds to minutes, an in-process one milliseconds: collected last (test_user_files.py, test_usertree.py...),
    multi-rank tests kept one worker busy alone after the other had finished; collected first, the in-process
    modules' 1,500 tests fill the end and the workers finish together. Whole modules move, never single tests: a
    module's tests stay together, so a module-scoped fixture is made once per worker as before."""
    heavy = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in heavy)
    _groups_reach_the_scheduler(config, items)


def _groups_reach_the_scheduler(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a `--dist loadgroup` worker the `xdist_group` marks must reach the scheduler (as an `@group` suffix of the
    node id). With pytest 9.2 and pytest-xdist 3.8 they silently did not (pytest-dev/pytest-xdist#1386): every module
    sharing its runs made them on both workers, the triage e2e runs twice over. Refuse to run so (the worker stops;
    pytest_configure says why on the controller for the known pair)."""
    if not getattr(config.option, "loadgroup", False):  # set by pytest-xdist on its workers only
        return
    grouped = [item for item in items if item.get_closest_marker("xdist_group") is not None]
    if grouped and not any("@" in item.nodeid for item in grouped):
        raise pytest.UsageError(
            "pytest-xdist ignores xdist_group with this pytest (pytest-dev/pytest-xdist#1386): install the test "
            "extra's pytest (pip install -e '.[test]': pytest<9.2)")



def pytest_configure(config: pytest.Config) -> None:
    """`--dist loadgroup` with the pair of versions that ignores `xdist_group` (pytest-dev/pytest-xdist#1386): one
    line saying so, not a suite that silently runs the shared runs on both workers."""
    if config.getoption("dist", "no") != "loadgroup" or hasattr(config, "workerinput"):
        return
    import xdist

    if tuple(pytest.version_tuple[:2]) >= (9, 2) and tuple(int(p) for p in xdist.__version__.split(".")[:2]) <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} ignores xdist_group "
            "(pytest-dev/pytest-xdist#1386): install the test extra's pytest (pip install -e '.[test]': pytest<9.2)")
