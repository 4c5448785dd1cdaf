"""Settings built from exactly a deployment's environment, as the process in it would build them.

``tests/project/test_docker.py`` (compose) and ``tests/project/test_k8s.py`` (manifests)
check that what a deployment sets is what the code reads; both build the
settings classes here, with this test process's own ``TOKENQ_*`` variables
taken away first.
"""

from __future__ import annotations

import os

import pytest
from pydantic_settings import BaseSettings

from tokenq.shared.settings import ENV_PREFIX


def settings_from(env: dict[str, str], cls: type[BaseSettings],
                  monkeypatch: pytest.MonkeyPatch) -> BaseSettings:
    """``cls`` from the ``TOKENQ_*`` entries of ``env`` alone."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith(ENV_PREFIX):
            monkeypatch.setenv(name, value)
    return cls()
