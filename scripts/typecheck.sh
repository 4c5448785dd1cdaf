#!/usr/bin/env bash
# Type-check tokenq.shared and tokenq.producer with mypy (settings: pyproject's [tool.mypy]).
# The packages live in folders named otherwise (package-dir "tokenq.shared" = "shared"),
# which mypy cannot map, so it reads them through a tree of links under build/mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/mypy/tokenq
for package in shared producer worker; do
    ln -sfn "../../../$package" "build/mypy/tokenq/$package"
done
MYPYPATH=build/mypy .venv/bin/mypy "$@"
