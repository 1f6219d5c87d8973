# The README's two commands: `make demo` and `make test`. `make setup` creates .venv only.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_PIN := torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers: one per core (at most 8; WORKERS=N chooses). One more than the cores gained nothing on 2
# cores (fresh clone, quiet: 785 s with 3 workers, 776 s with 2): the suite's time is CPU, mostly the interpreter,
# torch and torch._dynamo of each launch a test cannot share. A module whose tests share their runs
# (test_triage_e2e, test_syncbn, test_compare_bn, test_multinode, test_standins) stays on one worker (xdist_group,
# honoured with the test extra's pytest<9.2; tests/conftest.py refuses the pair that ignores it)
WORKERS ?= $(shell $(PYTHON) -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1; print(min(8, n))")
XDIST ?= -n $(WORKERS) --dist loadgroup

.PHONY: setup bytecode demo lint test test-fast test-gpu bench bench-overhead bench-gpu docs clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned resolve would pull a CUDA build of several GB.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet $(TORCH_PIN)
	$(PIP) install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

# ddpdoctor's bytecode, compiled once before the commands that start it: every process of a probe run (ddpdoctor,
# its agent, each rank, each arm's) imports ddpdoctor, and where PYTHONDONTWRITEBYTECODE=1 (containers, CI images)
# none of them may cache what it compiled, so each compiled the same modules from source again (~0.3 s CPU per
# process, hundreds of processes in `make test`). compileall writes whatever that variable says. checked-hash: the
# interpreter uses a .pyc only while its source hashes the same, so an edit (or a copy that keeps mtimes) never runs
# stale bytecode; recompiling everything takes about a second.
bytecode: setup
	$(PY) -m compileall -q -f --invalidation-mode checked-hash ddpdoctor

demo: bytecode
	@echo "--- ddpdoctor check on the bundled buggy example (fixtures/demo/train.py) ---"
	@# the demo is buggy on purpose: exit 1 (findings at or above --fail-on) is the expected end, said in words
	@$(VENV)/bin/ddpdoctor check fixtures/demo/train.py --base-lr 0.1 --base-batch 32; code=$$?; \
	case $$code in \
	  1) echo "--- exit 1: findings at or above --fail-on (medium), as expected for the buggy demo ---" ;; \
	  0) echo "--- exit 0: no finding at or above --fail-on; the demo should have had some ---"; exit 1 ;; \
	  *) echo "--- exit $$code: ddpdoctor could not analyse the demo (see the error above) ---"; exit $$code ;; \
	esac

# The lint gate (ruff, configured in pyproject.toml); `make test` runs it first.
lint: setup
	$(PY) -m ruff check .

test: bytecode lint
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# Skips the multi-rank tests (seconds each); `make test` runs everything.
test-fast: bytecode lint
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# On a GPU node: the gpu-marked tests (skipped everywhere else).
test-gpu: bytecode
	$(PY) -m pytest -m gpu -v -s $(PYTEST_ARGS)

bench: bytecode
	$(PY) benchmarks/bench_static.py
	$(PY) benchmarks/bench_probe.py
	$(PY) benchmarks/bench_compare_bn.py

# The probe against a bare torchrun on a ResNet-style workload (wall time, peak RSS per rank): minutes.
bench-overhead: bytecode
	$(PY) benchmarks/bench_overhead.py

# On a GPU node: the probe's per-step overhead with real CUDA tensors.
bench-gpu: bytecode
	$(PY) benchmarks/bench_gpu_step.py

# The terminal pictures in docs/ that the README shows, captured from real runs of the tool.
docs: bytecode
	$(PY) docs/capture.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
