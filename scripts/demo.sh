#!/usr/bin/env bash
# The main job on a fresh machine: install, then run Redis + workers + a producer
# over the bundled sample of English and Chinese text, and print a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python scripts/demo.py "$@"
