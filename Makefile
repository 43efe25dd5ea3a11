# Two entry points for a fresh machine: `make demo` (install + the offline DAPO run) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; pinned first so no later install pulls a CUDA build.
TORCH ?= torch==2.13.0

.PHONY: install install-deepspeed demo test lint format

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# DeepSpeed for the ZeRO accelerate configs, from its source distribution; the torch already in the venv satisfies it.
install-deepspeed: install
	$(PY) -m pip install -q -e ".[deepspeed]"

demo: install
	$(PY) recipes/dapo_math.py --config recipes/configs/tiny_cpu.yaml

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest

format: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .
