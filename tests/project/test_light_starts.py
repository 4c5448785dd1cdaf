"""What a process loads to start: a sim worker, ``tokenq stats --help`` and ``import
tokenq.producer`` import only what they use (the model libraries, the producer's clients,
redis and the ``--devices`` supervisor are each behind the path that needs them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

import tokenq.producer
from tests.blocked_imports import blocking_env
from tests.workers import WorkerProcess

MODEL_LIBRARIES = ("torch", "transformers", "tokenizers", "onnxruntime")

STARTS = {
    "import tokenq.producer": (
        "import tokenq.producer",
        ("tokenq.producer.aio", "tokenq.producer.client", "redis", "numpy"),
    ),
    "tokenq stats --help": (
        "from tokenq.shared.cli import main\n"
        "try: main(['stats', '--help'])\n"
        "except SystemExit: pass",
        ("redis", "tokenq.producer.aio", "tokenq.producer.client", "numpy", *MODEL_LIBRARIES),
    ),
    "a sim worker's modules": (
        "from tokenq.worker import cli, process\n"
        "from tokenq.worker.backends.plugins import load_backend\n"
        "from tokenq.shared import lua_scripts\n"
        "from tokenq.shared.flags import parse_settings\n"
        "from tokenq.worker.settings import settings_class_for\n"
        "argv = ['--backend', 'sim']\n"
        "load_backend(parse_settings(settings_class_for(argv), argv, 'tokenq worker'))\n"
        "lua_scripts.library()  # reads the producer's lua/ folder",
        ("tokenq.producer.aio", "tokenq.producer.client", "tokenq.worker.tooling.supervise",
         *MODEL_LIBRARIES),
    ),
}
"""A start, as Python code, and the modules it must not load."""


@pytest.mark.parametrize("start", list(STARTS))
def test_a_start_loads_only_what_it_uses(start: str) -> None:
    code, absent = STARTS[start]
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps(sorted(m for m in {absent!r} if m in sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_a_sim_worker_serves_without_the_model_libraries(
    redis_url: str, queue_name: str, tmp_path: Path, r: redis.Redis
) -> None:
    env = blocking_env(tmp_path / "bare", MODEL_LIBRARIES)
    worker = WorkerProcess(env, tmp_path, "--backend", "sim", "--redis-url", redis_url,
                           "--queue", queue_name)
    try:
        worker.wait_ready(r, queue_name)
        assert worker.terminate() == 0, worker.output()
    finally:
        worker.close()


@pytest.mark.unit
def test_every_public_name_of_the_producer_resolves() -> None:
    from tokenq.producer.aio import AsyncClient
    from tokenq.producer.client import Client

    missing = [name for name in tokenq.producer.__all__ if getattr(tokenq.producer, name) is None]
    assert missing == []
    assert (tokenq.producer.Client, tokenq.producer.AsyncClient) == (Client, AsyncClient)


@pytest.mark.unit
def test_a_name_the_producer_does_not_have_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Clients'"):
        tokenq.producer.Clients  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name '_HOME'"):
        from tokenq.producer import _HOME  # type: ignore[attr-defined]  # noqa: F401
    assert not hasattr(tokenq.producer, "aio_client")
