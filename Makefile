# `make demo` and `make test` set everything up on a fresh machine.
# They use the active virtual environment, or create .venv when none is active.
# TORCH_SPEC picks the torch build: the default is the CPU build; on a GPU machine
# use e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"`.
# `make wheelhouse` collects every wheel an install needs, for a machine without internet.

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
# `make bench-scale`'s options (benchmarks/bench_scale.py --help), e.g. "--sentences 1000000".
SCALE_ARGS ?=
# The wheelhouse's target: a CPython version and a manylinux platform tag (the glibc of the
# machine that installs it; manylinux_2_28 covers RHEL 8 / Ubuntu 20.04 and later).
WHEELHOUSE ?= wheelhouse
WHEEL_PYTHON ?= $(shell $(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
WHEEL_PLATFORM ?= manylinux_2_28_x86_64

.PHONY: setup demo test lint format bench bench-scale wheelhouse clean

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
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=25 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

# The data path at 50M sentences a language (docs/data.md#measuring-at-scale): hours, about
# 7 GB of disk a language and an otherwise idle machine, so not part of `make bench`.
bench-scale: setup
	$(PY) benchmarks/bench_scale.py $(SCALE_ARGS)

# DeepSpeed is published as source only: it is built here as a pure wheel (DS_BUILD_OPS=0,
# no compiled ops; megasemface runs torch's fused Adam and needs none), then every other
# wheel is downloaded for the target: torch from TORCH_SPEC's index first, so that the
# second resolution takes that build from the wheelhouse rather than another from PyPI.
wheelhouse: setup
	mkdir -p $(WHEELHOUSE)
	rm -f $(WHEELHOUSE)/megasemface-*.whl $(WHEELHOUSE)/deepspeed-*.whl
	DS_BUILD_OPS=0 $(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w $(WHEELHOUSE) \
		"deepspeed==$$(sed -n 's/^ *deepspeed==\([^ ;]*\).*/\1/p' setup.cfg)"
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w $(WHEELHOUSE) .
	minor=$$(echo $(WHEEL_PLATFORM) | sed -n 's/^manylinux_2_\([0-9]*\)_.*/\1/p'); \
	arch=$$(echo $(WHEEL_PLATFORM) | sed 's/^manylinux[_0-9]*_//'); \
	platforms="--platform $(WHEEL_PLATFORM)"; \
	for n in $$(seq 17 $${minor:-17}); do platforms+=" --platform manylinux_2_$${n}_$$arch"; done; \
	target="--only-binary=:all: --python-version $(WHEEL_PYTHON) --implementation cp \
		--abi cp$(subst .,,$(WHEEL_PYTHON)) $$platforms --platform manylinux2014_$$arch"; \
	$(PY) -m pip download --quiet -d $(WHEELHOUSE) $$target $(TORCH_SPEC) && \
	$(PY) -m pip download --quiet -d $(WHEELHOUSE) $$target --find-links $(WHEELHOUSE) \
		$(firstword $(TORCH_SPEC)) $(WHEELHOUSE)/megasemface-*.whl $(WHEELHOUSE)/deepspeed-*.whl
	@echo "$(WHEELHOUSE): $$(ls $(WHEELHOUSE)/*.whl | wc -l) wheels for CPython $(WHEEL_PYTHON)" \
		"on $(WHEEL_PLATFORM); install with: pip install --no-index --find-links $(WHEELHOUSE) megasemface"

clean:
	rm -rf demo runs .pytest_cache .ruff_cache
