# `make demo` and `make test` set everything up on a fresh machine.
# They use the active virtual environment, or create .venv when none is active.
# TORCH_SPEC picks the torch build: the default is the CPU build; on a GPU machine
# use e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"`.

SHELL := /bin/bash
TORCH_SPEC ?= torch==2.13.0
ifdef VIRTUAL_ENV
VENV := $(VIRTUAL_ENV)
else
VENV := $(CURDIR)/.venv
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megasemface-installed
PYTEST_ARGS ?=
# Two test files at a time: a launched run spends much of its time in one process (imports),
# so the second core would idle. A file's tests stay in one worker (its fixtures run once).
TEST_JOBS ?= 2
DEMO_ARGS ?=

.PHONY: setup demo test lint format bench clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[dev,export]'
	@touch $(STAMP)

demo: setup
	$(PY) -m megasemface.demo $(DEMO_ARGS)

test: setup lint
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf demo runs .pytest_cache .ruff_cache
