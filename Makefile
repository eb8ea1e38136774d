# jpaged: the two set-up commands are `make demo` and `make test`.
# Each creates .venv (Python >= 3.12, pinned to the GPU machine's versions) if it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0

.PHONY: demo test test-all test-gpu test-tpu lint format bench-decode goldens venv clean

$(VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(PY) || "$$(tools/python312.sh)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	@touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/generate.py

# The CPU suite compiles XLA programs at LLVM -O0 (about a fifth less wall time on 2 cores;
# what runs is mostly interpreter callbacks and tiny programs). `make test` leaves out the
# cases marked slow (opt-in kernel paths' extra cases, boundary repeats); `make test-all` runs
# every case.
CPU_XLA_FLAGS := --xla_backend_optimization_level=0

CPU_PYTEST = XLA_FLAGS="$(CPU_XLA_FLAGS) $${XLA_FLAGS:-}" $(PY) -m pytest -n 2 -q

test: $(VENV)/.installed
	$(CPU_PYTEST) -m "not slow"

test-all: $(VENV)/.installed
	$(CPU_PYTEST)

test-gpu: $(VENV)/.installed
	$(PY) -m pytest -m gpu -q

test-tpu: $(VENV)/.installed
	$(PY) -m pytest -m tpu -q

# ruff, then tools/check_wording.py: no history wording in tracked files
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) tools/check_wording.py

format: $(VENV)/.installed
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench-decode: $(VENV)/.installed
	$(PY) benchmarks/decode_attention.py

# Tiny HF checkpoints + goldens (tests/checkpoints, tests/goldens) from transformers, in a
# Python 3.11 venv of its own (torch's CPU wheel is for 3.11); the library never imports torch.
TORCH_VENV ?= .venv-torch
PYTHON311 ?= python3.11

$(TORCH_VENV)/.installed:
	@test -x $(TORCH_VENV)/bin/python || $(PYTHON311) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q torch==2.13.0 transformers==5.24.0 safetensors tokenizers
	@touch $@

goldens: $(TORCH_VENV)/.installed
	$(TORCH_VENV)/bin/python tools/make_goldens.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
