# Kernels are compiled ahead of time into one cubin per source and architecture:
# sm_90 (H100/H200), sm_100 (B200), sm_103 (B300). The package loads the one that matches.
NVCC      ?= nvcc
PYTHON    ?= python3
ARCHS     ?= 90 100 103
NVCCFLAGS ?= -O3 -std=c++17 -lineinfo -Xptxas -warn-spills
CUBIN_DIR := ep_a2a/cubins
SOURCES   := $(wildcard kernels/*.cu)
HEADERS   := $(wildcard kernels/*.cuh) kernels/generated/params.cuh
CUBINS    := $(foreach a,$(ARCHS),$(patsubst kernels/%.cu,$(CUBIN_DIR)/%.sm_$(a).cubin,$(SOURCES)))
VENV      := .venv
VPY       := $(VENV)/bin/python

.PHONY: all cubins test gpu-test bench demo clean setup

all: cubins

cubins: $(CUBINS)

kernels/generated/params.cuh: ep_a2a/layout.py
	@mkdir -p $(dir $@)
	$(PYTHON) -m ep_a2a.layout --header > $@.tmp && mv $@.tmp $@

define CUBIN_RULE
$(CUBIN_DIR)/%.sm_$(1).cubin: kernels/%.cu $(HEADERS)
	@mkdir -p $(CUBIN_DIR)
	$(NVCC) -cubin -arch=sm_$(1) $(NVCCFLAGS) -o $$@ $$<
endef
$(foreach a,$(ARCHS),$(eval $(call CUBIN_RULE,$(a))))

# A fresh machine: a virtual environment with the package and its test extra.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

# The CPU suite (GPU tests skip with a reason where no GPU is present).
test: setup cubins
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
	rm -rf $(CUBIN_DIR) kernels/generated
