"""The probe: run the user's unmodified script on N ranks, instrumented, and record what happened.

- `launcher.run_probe` (in the ddpdoctor process): plan (plan.py), launch through torch.distributed.run (agent.py)
  or once for self-spawning scripts, timeout with stack dumps, no process left behind (procs.py).
- `bootstrap` (in each rank) / `site/sitecustomize.py` (in children the script spawns): `instrument.py` installs
  the early recorders, then — when the script imports torch — the CUDA emulation and the torch recorders
  (`recorders/`, one module per concern, explicit list in recorders/__init__.py).
- `session.Probe`: the per-process event writer and step/epoch accounting; events are documented in
  ddpdoctor/events.py and read only by ddpdoctor/analyses.
- `python -m ddpdoctor.probe --out DIR SCRIPT ARGS` (attach mode, __main__.py) runs under any launcher.
"""
