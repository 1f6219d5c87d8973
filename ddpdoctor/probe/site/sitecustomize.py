"""ddpdoctor probe hook, active only inside a probe run (DDPDOCTOR_RUN_DIR set).

First, before anything else can run (a project's own sitecustomize may take seconds): a process started by the
probe's launcher machinery (DDPDOCTOR_PARENT_PID is its parent's pid) asks to die with its parent, so a rank
whose launcher is SIGKILLed during start-up does not run on (ddpdoctor.probe.procs.die_with_parent). Then chains
to any other sitecustomize on sys.path, so a project's or a distribution's own sitecustomize still runs. Then
instruments children started by multiprocessing's spawn/forkserver machinery (torch patches are installed
lazily, when the child imports torch) — the fork server instrumented, so that the processes it forks are too
— and redirects the file writes of any other Python process the script starts (ddpdoctor.probe.fsview)."""

import os
import sys


def _die_with_parent() -> None:
    expected = os.environ.get("DDPDOCTOR_PARENT_PID", "")
    if not expected.isdigit() or not os.environ.get("DDPDOCTOR_RUN_TAG"):
        return
    parent = int(expected)
    if os.getppid() == parent:
        from ddpdoctor.probe.procs import die_with_parent

        die_with_parent(parent)
        return
    try:  # not a child of the launcher (a DataLoader worker of a rank): leave alone, unless the launcher is gone
        os.kill(parent, 0)
    except ProcessLookupError:
        os._exit(1)
    except OSError:
        pass


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if p and os.path.abspath(p) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["_ddpdoctor_chained_sitecustomize"] = module


class _BeforeTheMainModule:
    """A one-shot meta-path finder: the first import once the interpreter has put the working directory first on
    sys.path (after this file and any usercustomize ran), runpy itself aside, is runpy looking up the module of
    `python -m MODULE`.
    When the module is ddpdoctor's own (the agent, the ranks' bootstrap), the entry goes: a project's
    `tokenize.py` there must not be imported by ddpdoctor (the package itself was imported above, before the entry
    existed, so its own check found nothing to remove). A user's `python -m theirs` keeps it."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib protocol
        if fullname == "runpy":
            return None  # the interpreter's own first step to run the module
        try:
            if sys.path[0] not in ("", os.getcwd()):
                return None  # still starting (usercustomize): the entry is not there yet
        except (IndexError, OSError):
            pass
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        if fullname.partition(".")[0] == "ddpdoctor":
            from ddpdoctor import leave_the_working_directory_to_the_user

            leave_the_working_directory_to_the_user()
        return None


def _keep_the_working_directory_out_of_ddpdoctor() -> None:
    if sys.argv[:1] == ["-m"]:
        sys.meta_path.insert(0, _BeforeTheMainModule())


def _is_forkserver() -> bool:
    """This process is multiprocessing's fork server: `python -c 'from multiprocessing.forkserver import main;
    main(...)'` (multiprocessing.forkserver.ensure_running)."""
    argv = list(getattr(sys, "orig_argv", None) or ())
    if "-c" not in argv[:-1]:
        return False
    return argv[argv.index("-c") + 1].startswith("from multiprocessing.forkserver import main")


def _activate() -> None:
    if not os.environ.get("DDPDOCTOR_RUN_DIR"):
        return
    from ddpdoctor.probe.settings import ProbeSettings
    from ddpdoctor.records import LaunchMode

    settings = ProbeSettings.from_env()
    if settings is None:
        return
    if "--multiprocessing-fork" in sys.argv:  # a rank (or worker) started by multiprocessing's spawn
        from ddpdoctor.probe.instrument import instrument_process

        instrument_process(settings, "spawned")
        return
    if _is_forkserver():
        # multiprocessing's forkserver: it forks every process of the "forkserver" start method (ranks included)
        # from itself, so it is instrumented like a rank, and its children inherit that (role "forked")
        from ddpdoctor.probe.instrument import instrument_process

        instrument_process(settings, "forkserver")
        return
    parent = os.environ.get("DDPDOCTOR_PARENT_PID", "")
    if settings.mode is LaunchMode.ATTACH or (parent.isdigit() and int(parent) == os.getppid()):
        return  # started by the probe's launcher: the launcher itself, or a rank the bootstrap instruments
    # any other Python process of the run (the script runs `python eval.py`): its writes are redirected too
    from ddpdoctor.probe import session
    from ddpdoctor.probe.instrument import redirect_writes

    redirect_writes(session.start(settings, "child"))


try:
    _die_with_parent()
except Exception as _exc:  # noqa: BLE001 - never break the interpreter start of a rank
    sys.stderr.write(f"ddpdoctor: parent-death check failed: {_exc}\n")
try:
    _chain()
except Exception as _exc:  # noqa: BLE001 - a broken chained sitecustomize must not be blamed on us, nor break the child
    sys.stderr.write(f"ddpdoctor: chained sitecustomize failed: {_exc}\n")
try:
    _keep_the_working_directory_out_of_ddpdoctor()
except Exception as _exc:  # noqa: BLE001 - never break the interpreter start
    sys.stderr.write(f"ddpdoctor: sys.path set-up failed: {_exc}\n")
try:
    _activate()
except Exception as _exc:  # noqa: BLE001 - the child runs uninstrumented rather than not at all
    sys.stderr.write(f"ddpdoctor: probe instrumentation failed in child: {_exc}\n")
