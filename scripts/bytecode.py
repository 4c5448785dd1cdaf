"""Byte-compile the installed packages tokenq's light processes import, and tokenq itself.

A test run starts hundreds of workers, gateways and ``tokenq`` commands. Where
``PYTHONDONTWRITEBYTECODE`` is set no import writes a ``.pyc``, so without this each of
those processes compiles redis, pydantic, numpy and fastapi from source again (about 1 s
of CPU a start on a 2-core VM against about 0.6 s with them). The model
libraries (torch, transformers) are left as they are: compiling them takes a minute of CPU
and only the hf backend's processes load them.

Usage: ``.venv/bin/python scripts/bytecode.py`` (scripts/setup.sh runs it).
"""

from __future__ import annotations

import compileall
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ENTRY_MODULES = (
    "tokenq.worker.cli", "tokenq.worker.process", "tokenq.worker.backends.sim",
    "tokenq.worker.tooling.up", "tokenq.producer.serve.app", "tokenq.producer.serve.cli",
    "uvicorn", "tokenq.producer.aio", "tokenq.producer.client", "tokenq.producer.ops.top",
    "tokenq.producer.ops.dlq", "tokenq.producer.ops.embed", "tokenq.producer.ops.functions",
    "tokenq.producer.ops.snapshot", "tokenq.shared.cli",
)
"""What a sim worker, the gateway and the ``tokenq`` commands import."""

SKIPPED = frozenset({"torch", "transformers", "tokenizers", "onnxruntime", "optimum"})
"""Model libraries: large, and loaded only by the hf backend."""

_PROBE = (
    "import importlib, json, sys\n"
    "for name in sys.argv[1:]:\n"
    "    try: importlib.import_module(name)\n"
    "    except ImportError: pass  # an extra not installed\n"
    "print(json.dumps(sorted({m.partition('.')[0] for m in sys.modules})))\n"
)


def imported_packages(entries: tuple[str, ...] = ENTRY_MODULES) -> list[str]:
    """The top-level names of every module a fresh interpreter loads importing ``entries``."""
    out = subprocess.run([sys.executable, "-c", _PROBE, *entries], check=True,
                         capture_output=True, text=True)
    return list(json.loads(out.stdout))


def targets(names: list[str], site: Path) -> list[Path]:
    """The installed folders and modules of ``names`` under ``site``, less the model libraries."""
    found = []
    for name in names:
        if name in SKIPPED:
            continue
        for path in (site / name, site / f"{name}.py"):
            if path.exists():
                found.append(path)
    return found


def main() -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    paths = [*targets(imported_packages(), site),
             *(ROOT / folder for folder in ("shared", "producer", "worker"))]
    for path in paths:  # a file that does not compile (a package's test data) is left as it is
        if path.is_dir():
            compileall.compile_dir(path, quiet=2, workers=0)
        else:
            compileall.compile_file(path, quiet=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
