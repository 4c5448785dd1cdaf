#!/usr/bin/env bash
# One short check of tokenq's Hugging Face backend on a CUDA GPU (see gpu_check.py).
# Prints a summary; exits 0 with "no CUDA device; skipped" on a machine without one.
# Python: $PYTHON if set, else the repo's .venv, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -n "${PYTHON:-}" ]; then
    python=$PYTHON
elif [ -x .venv/bin/python ]; then
    python=.venv/bin/python
else
    python=python3
fi
exec "$python" scripts/gpu_check.py "$@"
