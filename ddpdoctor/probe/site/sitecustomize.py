"""ddpdoctor probe hook, active only inside a probe run (DDPDOCTOR_RUN_DIR set) and only in children started by
multiprocessing's spawn/forkserver machinery. Chains to any other sitecustomize on sys.path first, so a project's
or a distribution's own sitecustomize still runs. Installs torch patches lazily, when the child imports torch."""

import os
import sys


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


def _activate() -> None:
    if not os.environ.get("DDPDOCTOR_RUN_DIR") or "--multiprocessing-fork" not in sys.argv:
        return
    from ddpdoctor.probe.settings import ProbeSettings
    from ddpdoctor.probe.instrument import instrument_process

    settings = ProbeSettings.from_env()
    if settings is not None:
        instrument_process(settings, "spawned")


try:
    _chain()
except Exception as _exc:  # a broken chained sitecustomize must not be blamed on us, nor break the child
    sys.stderr.write(f"ddpdoctor: chained sitecustomize failed: {_exc}\n")
try:
    _activate()
except Exception as _exc:
    sys.stderr.write(f"ddpdoctor: probe instrumentation failed in child: {_exc}\n")
