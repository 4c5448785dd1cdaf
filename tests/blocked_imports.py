"""A subprocess that cannot import given modules: how a test simulates a smaller install.

Building a venv per install shape is slow, so :func:`blocking_env` writes a
``sitecustomize`` that puts a finder first on ``sys.meta_path`` refusing every
named top-level module, and returns an environment whose ``PYTHONPATH`` loads it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

_BLOCKER = """
import sys

BLOCKED = frozenset({blocked!r})


class _Bare:
    \"\"\"Refuse the modules this install would not have.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Bare())
"""


def blocking_env(folder: Path, blocked: Iterable[str]) -> dict[str, str]:
    """This process's environment (less ``TOKENQ_*`` and ``PYTHON*``) for a subprocess in
    which importing any of ``blocked`` (top-level names) raises ModuleNotFoundError."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_BLOCKER.format(blocked=sorted(blocked)))
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("TOKENQ_", "PYTHON"))}
    return {**env, "PYTHONPATH": str(folder), "PYTHONUNBUFFERED": "1"}
