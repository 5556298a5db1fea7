# Kernels are compiled ahead of time into one cubin per source and architecture:
# sm_90 (H100/H200), sm_100 (B200), sm_103 (B300). The package loads the one that matches.
# kernels/build.py holds the rules (pip's builds run the same script through setup.py); it
# needs only the standard library and rebuilds what is stale. NVCC=/path/to/nvcc picks the
# compiler (default: $$CUDA_HOME/bin/nvcc, then nvcc on PATH).
NVCC      ?=
PYTHON    ?= python3
ARCHS     ?= 90 100 103
VENV      := .venv
VPY       := $(VENV)/bin/python
FFI_PYTHON ?= $(VPY)

.PHONY: all cubins ffi header test gpu-test bench demo clean setup

all: cubins

cubins:
	$(PYTHON) kernels/build.py $(if $(NVCC),--nvcc "$(NVCC)") --archs "$(ARCHS)"

# The JAX FFI library (native/ffi) for the jaxlib of the python given (skipped without one).
ffi:
	$(FFI_PYTHON) kernels/build.py --ffi-only --optional

header:
	$(PYTHON) kernels/build.py --header-only

# A fresh machine: a virtual environment with the package and its test extra.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

# The CPU suite (GPU tests skip with a reason where no GPU is present). The frameworks are
# optional: their tests skip where torch or JAX is missing, and the summary says which (CI
# installs them from .ci/requirements-frameworks.txt and runs them).
test: setup cubins ffi
	$(VPY) -m pytest -q tests

# On a GPU machine whose python already has the dependencies (the H200 image).
gpu-test: cubins
	PYTHONPATH=. $(PYTHON) -m pytest -q -m gpu tests

bench: cubins
	PYTHONPATH=. $(PYTHON) -m ep_a2a.bench

# The main job: a dispatch/combine demo on the GPUs present (NumPy reference without one).
demo: setup cubins
	$(VPY) -m ep_a2a

clean:
	rm -rf ep_a2a/cubins kernels/generated build *.egg-info
