# The commands of the README's quick start. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: test test-all test-leg1 test-leg2 leg2-kernels generate serve bench clean proto

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test,parity]'
	touch $@

# Leg 2 runs on the GPU machine's versions: Python 3.12 and jax 0.11.2, without the `parity` extra
# (the local torch wheel is for 3.11 only), so the parity tests skip there. Python 3.12 from pyenv,
# else python3.12 on PATH.
VENV312 ?= .venv312
PY312 := $(VENV312)/bin/python
JAX_PINS ?= jax==0.11.2 jaxlib==0.11.2
# pytest-xdist workers per leg (a module stays on one worker, with its fixtures): the CI machine's
# two cores, which take the suite from about 10 to about 6.5 minutes in leg 1
TEST_WORKERS ?= 2
# found once, when first needed (the eval keeps the answer)
PYTHON312 ?= $(eval PYTHON312 := $(shell for p in "$$(pyenv prefix 3.12.1 2>/dev/null)/bin/python3.12" \
	"$$(pyenv prefix 3.12 2>/dev/null)/bin/python3.12" "$$(command -v python3.12)"; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done))$(PYTHON312)

$(VENV312)/.test: pyproject.toml
	$(PYTHON312) -m venv $(VENV312)
	$(PY312) -m pip install -q --upgrade pip
	$(PY312) -m pip install -q -e '.[test]' $(JAX_PINS)
	touch $@

# numba's CPU kernels compiled once per virtualenv, before its tests (pallas_kernels/compile_cpu_kernels.py):
# else both workers, and the multi-device tests' subprocesses, compile the same kernels at the same
# time. Again when a kernel source changes (numba's cache then recompiles them anyway). In .venv they
# need only the runtime packages, so they compile while pip installs the test extras (torch the
# largest). In two processes, but one each where test-all readies both virtualenvs side by side.
KERNEL_SOURCES := $(wildcard pallas_kernels/*.py)
KERNEL_JOBS ?= 2

$(VENV)/.kernels: $(VENV)/.base $(KERNEL_SOURCES)
	$(PY) -m pallas_kernels.compile_cpu_kernels --jobs $(KERNEL_JOBS)
	touch $@

$(VENV312)/.kernels: $(VENV312)/.test $(KERNEL_SOURCES)
	$(PY312) -m pallas_kernels.compile_cpu_kernels --jobs $(KERNEL_JOBS)
	touch $@

# `make test` (what CI runs, on 2 cores): leg 1 without the tests marked slow, so that it stays well
# under 15 minutes on such a machine (docs/PERFORMANCE.md, "Decisions in the code"). `make test-all`: both
# legs, slow tests included in leg 1 (the demo model, multi-device and multi-host parity); run it
# before closing work that touches the engine, the models, the kernels or jax's version.
# Leg 1: Python 3.11 with the parity extra (torch, transformers' models as ground truth); GPU tests
# skip themselves without a GPU. Leg 2: the GPU machine's Python 3.12 and jax 0.11.2, every test but
# the slow ones and LEG2_LEG1_ONLY; tests that need torch skip, saying so. test-all sets up the two
# virtualenvs and their kernels side by side first: pip and numba's compiler each keep about one
# core busy (docs/PERFORMANCE.md, "Decisions in the code").
test:
	@$(MAKE) --no-print-directory -j2 $(VENV)/.kernels $(VENV)/.test
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

test-all:
	@$(MAKE) --no-print-directory -j2 $(VENV)/.kernels $(VENV)/.test leg2-kernels KERNEL_JOBS=1
	@$(MAKE) --no-print-directory test-leg1 test-leg2

leg2-kernels:
	@if [ -n "$(PYTHON312)" ]; then $(MAKE) --no-print-directory PYTHON312="$(PYTHON312)" $(VENV312)/.kernels; fi

test-leg1: $(VENV)/.kernels $(VENV)/.test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Leg 2 is there for jax 0.11.2: these modules test the HTTP and gRPC front ends and the packaging
# (hostile input, structured output over HTTP, the batch file runner, gRPC, the runtime-only
# processes), whose jax-facing part is the engine that the engine tests cover in both legs. They
# run in leg 1 only; test_server.py stays in both, the front end's check on Python 3.12.
LEG2_LEG1_ONLY := test_hostile.py test_structured_server.py test_run_batch.py test_grpc.py test_runtime_deps.py

test-leg2: leg2-kernels
	@if [ -z "$(PYTHON312)" ]; then echo "test leg 2 (Python 3.12, jax 0.11.2) skipped: no Python 3.12" \
	  "found (pyenv prefix 3.12.1, pyenv prefix 3.12, python3.12 on PATH)"; \
	else set -x; $(PY312) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile \
	  $(addprefix --ignore=tests/,$(LEG2_LEG1_ONLY)); fi

# Offline generation on the demo model (fetched once into ~/.cache/jaxsched).
generate: $(VENV)/.base
	$(VENV)/bin/jaxsched generate --max-model-len 2048 --max-num-seqs 8 --prompt "$(PROMPT)"

# The OpenAI-compatible server on the demo model, on http://127.0.0.1:8000 (see README: Server).
serve: $(VENV)/.base
	$(VENV)/bin/jaxsched serve --max-model-len 2048 --max-num-seqs 8

bench: $(VENV)/.base
	$(PY) scripts/bench_offline.py

clean:
	rm -rf $(VENV) $(VENV312) .pytest_cache

# The gRPC stubs (committed) from jaxsched/proto/jaxsched.proto, with the test extras' grpcio-tools;
# tests/test_grpc.py fails when the committed ones differ from what this writes.
proto: $(VENV)/.test
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. jaxsched/proto/jaxsched.proto
