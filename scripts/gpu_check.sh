#!/usr/bin/env bash
# One short check of tokenq's Hugging Face backend on a CUDA GPU (see gpu_check.py).
# Prints a summary; exits 0 with "no CUDA device; skipped" on a machine without one.
# Python: $PYTHON if set, else the repo's .venv, else python3.
#
# GPU_CHECK_ONNX=1: before the run, install onnxruntime-gpu (and onnx) into that
# Python, so check e (ONNX Runtime's CUDA provider against torch fp16) runs
# instead of being skipped. Only where torch sees a CUDA device, and only when
# the CUDA provider is missing. The CPU package `onnxruntime` is removed first:
# both install the same module, and a mix of the two loads either. It is put
# back if onnxruntime-gpu fails to install; otherwise the GPU package serves
# the worker's CPU runtime too. torch is never installed or upgraded here
# (onnxruntime-gpu does not depend on it): the provider uses the CUDA and cuDNN
# libraries the CUDA torch already brought. Without the variable nothing is
# installed.
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
if [ "${GPU_CHECK_ONNX:-0}" = "1" ] \
    && "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
    && ! "$python" -c 'import sys, onnx, onnxruntime as o
sys.exit(0 if "CUDAExecutionProvider" in o.get_available_providers() else 1)' 2>/dev/null
then
    echo "gpu_check: GPU_CHECK_ONNX=1: installing onnxruntime-gpu and onnx" >&2
    had_cpu_package=0
    if "$python" -m pip show --quiet onnxruntime >/dev/null 2>&1; then
        had_cpu_package=1
        "$python" -m pip uninstall --yes --quiet onnxruntime >&2
    fi
    if ! "$python" -m pip install --quiet onnxruntime-gpu onnx >&2; then
        echo "gpu_check: onnxruntime-gpu did not install; check e will be skipped" >&2
        if [ "$had_cpu_package" = "1" ]; then  # leave the worker's CPU runtime as it was
            "$python" -m pip install --quiet onnxruntime >&2 || true
        fi
    fi
fi
exec "$python" scripts/gpu_check.py "$@"
