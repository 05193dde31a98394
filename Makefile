# Two commands run everything on a fresh machine: `make demo` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench-cpu clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on this kind of machine's disk; pyproject keeps a range for GPU users.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,triton]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/halfbyte generate --fetch --chat --temperature 0 --max-tokens 64 \
		--prompt "What is the capital of France?"

test: $(STAMP)
	$(VENV)/bin/halfbyte fetch-default
	$(PY) -m pytest -q -m "not slow"

# also the slow tests (conversion peak-memory measurement in subprocesses)
test-all: $(STAMP)
	$(VENV)/bin/halfbyte fetch-default
	$(PY) -m pytest -q

bench-cpu: $(STAMP)
	$(PY) bench/cpu_decode.py

clean-venv:
	rm -rf $(VENV)
