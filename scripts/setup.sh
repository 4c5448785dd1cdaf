#!/usr/bin/env bash
# Create .venv and install tokenq with everything the demo and the tests need.
# torch is pinned here (not in pyproject) so that this machine takes its local
# CPU wheel; users with GPUs install any torch >= 2.1 they like.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
# One resolve; --no-compile: Python writes the .pyc of what is imported on first import,
# instead of pip compiling every module of torch and the rest (a minute of CPU).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 \
    -e '.[worker,dev,onnx]'
