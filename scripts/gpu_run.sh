#!/usr/bin/env bash
# On a lent GPU machine, in one call (scripts/gpu_pack.sh made .gpu/ here first; the device
# tool carries it): install .gpu/'s wheels beside the image's torch, then scripts/gpu_check.sh
# and scripts/bench/gpu_seed.py (the seed mix at every setting; queries alone in one process
# and two), each with the same batches' forward alone, every output kept under $OUT. About
# five minutes on an H100 or H200.
#   REQUESTS  gpu_seed's requests per setting (default 20000); QUERIES the queries run's (60000)
#   DEVICE    cpu: try the path on a machine without a GPU (fp32, 64 requests, one setting)
#   PYTHON    the Python holding torch (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
site=/tmp/tokenq-gpu-site
out=${OUT:-/tmp/tokenq-gpu-out}
model=$PWD/.gpu/model  # whole: the workers start in scripts/bench
mkdir -p "$out"
if ! compgen -G ".gpu/wheels/*.whl" > /dev/null || [ ! -d .gpu/model ]; then
    echo "gpu_run: no .gpu/ here: run scripts/gpu_pack.sh where pip works, and carry .gpu" >&2
    exit 2
fi
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .gpu/wheels/*.whl
export PYTHONPATH=$site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
if [ "${DEVICE:-cuda}" = "cpu" ]; then
    seed_flags=(--device cpu --dtype fp32 --requests 64 --settings 2048)
else
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
    PYTHON=$python bash scripts/gpu_check.sh --model "$model" 2>&1 | tee "$out/gpu_check.txt"
    seed_flags=(--requests "${REQUESTS:-20000}")
fi
"$python" scripts/bench/gpu_seed.py --model "$model" "${seed_flags[@]}" \
    --json "$out/gpu_seed.json" 2>&1 | tee "$out/gpu_seed.txt"
if [ "${DEVICE:-cuda}" != "cpu" ]; then  # short text, one process and two (the GIL's limit)
    "$python" scripts/bench/gpu_seed.py --model "$model" --mix queries --settings 65536 \
        --processes 1 2 --requests "${QUERIES:-60000}" --json "$out/gpu_queries.json" 2>&1 \
        | tee "$out/gpu_queries.txt"
fi
