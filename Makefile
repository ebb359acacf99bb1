# The commands of the README's quick start. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: test generate serve bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# Run the whole suite (CPU; slow tests included, GPU tests skip themselves without a GPU).
test: $(VENV)/.test
	$(PY) -m pytest -q

# Offline generation on the demo model (fetched once into ~/.cache/jaxsched).
generate: $(VENV)/.base
	$(VENV)/bin/jaxsched generate --max-model-len 2048 --max-num-seqs 8 --prompt "$(PROMPT)"

# The OpenAI-compatible server on the demo model, on http://127.0.0.1:8000 (see README: Server).
serve: $(VENV)/.base
	$(VENV)/bin/jaxsched serve --max-model-len 2048 --max-num-seqs 8

bench: $(VENV)/.base
	$(PY) scripts/bench_offline.py

clean:
	rm -rf $(VENV) .pytest_cache
