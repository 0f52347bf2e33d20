# Two set-up commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv on first use, installs torch==2.13.0 first (a looser pin
# pulls a multi-GB CUDA build), then cpkv with its extras.
PYTHON ?= python3.11
# Where pip takes torch from. Empty (the default): the configured index, where
# torch==2.13.0 is the CUDA build on a public registry (right for a GPU machine)
# or a local CPU wheel where one is configured. A CPU-only machine can ask for
# the CPU build: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_PIP_FLAGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench simulate clean gpu-check docs-figures sglang-deps triton-wheels

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_PIP_FLAGS) torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[model,plot,events,kernels,test]'
	touch $(STAMP)

# SGLang's released classes for tests/sglang (the drop-in tests, docs/sglang.md): its wheel without its
# dependencies (they pin torch 2.14 and CUDA packages), then the small packages its allocator, radix cache and
# memory pool import (tests/support/sglang-requirements.txt; never torchvision: tests/support/sglang_classes.py
# stands in for it), with torch held at the version installed above. `make test` runs it once per venv and
# requirements change (its own stamp, so an existing .venv gets it too); where it cannot install, the stamp is
# not written, the next `make test` tries again and those tests skip with the reason.
SGLANG_VERSION ?= 0.5.23
SGLANG_STAMP   := $(VENV)/.sglang-$(SGLANG_VERSION)
$(SGLANG_STAMP): $(STAMP) tests/support/sglang-requirements.txt
	@if $(PY) -m pip install --quiet --disable-pip-version-check --no-deps sglang==$(SGLANG_VERSION) && \
	   $(PY) -m pip install --quiet --disable-pip-version-check -r tests/support/sglang-requirements.txt \
		"torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')"; \
	then touch $@; else echo "sglang-deps: SGLang $(SGLANG_VERSION) did not install; tests/sglang will skip"; fi

sglang-deps: $(SGLANG_STAMP)

# The other Triton releases tests/kernels/test_kernel_compile.py compiles every kernel under for sm_90 (on the CPU),
# besides the venv's own: 3.6.0 (the GPU image's) and 3.8.0 (torch 2.14's, what a plain `pip install .` pulls
# today); cpkv.kernels.compile_check.CHECKED_TRITONS names the same. Each is a `pip install --target` folder in
# the venv (about 0.6-0.9 GB), installed once per venv; where one cannot install, the folder is removed, the next
# `make test` tries again and its compile check skips with the reason.
TRITON_CHECKED := 3.6.0 3.8.0
TRITON_STAMPS  := $(foreach v,$(TRITON_CHECKED),$(VENV)/triton-$(v)/.installed)
$(VENV)/triton-%/.installed: $(STAMP)
	@rm -rf $(VENV)/triton-$*
	@if $(PY) -m pip install --quiet --disable-pip-version-check --no-deps --target $(VENV)/triton-$* triton==$*; \
	then touch $@; else rm -rf $(VENV)/triton-$*; \
	echo "triton-wheels: triton $* did not install; its compile check will skip"; fi

triton-wheels: $(TRITON_STAMPS)

demo: $(STAMP)
	$(VENV)/bin/cpkv run --check --device-pages 8

test: $(STAMP) $(SGLANG_STAMP) $(TRITON_STAMPS)
	$(PY) -m pytest -q -n 2 --durations=10

bench: $(STAMP)
	$(VENV)/bin/cpkv bench all

# on a machine with a CUDA GPU: the one prepared device run (tools/gpu_check.py: kernels, bandwidth, cpkv run
# --device cuda --check at N 1, 2, 4 on one GPU in float32, bfloat16 and FP8, IPC and the fence), within 330 s;
# results.json and log.txt in $(GPU_OUT). Without a GPU: one line, exit 2, nothing written. With the machine's
# own python3 (its torch), or this checkout's .venv where it exists.
GPU_OUT ?= gpu-check
gpu-check:
	@$(if $(wildcard $(PY)),$(PY),python3) tools/gpu_check.py $(GPU_OUT)

# every figure of README.md and docs/ rewritten by the command above it (tools/docs_figures.py): the timed
# ones stamped with today's date and this machine; FIGURES=deterministic (or timed) for one kind only
FIGURES ?=
docs-figures: $(STAMP)
	$(PY) tools/docs_figures.py $(if $(FIGURES),--only $(FIGURES),)

simulate: $(STAMP)
	$(VENV)/bin/cpkv simulate

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
