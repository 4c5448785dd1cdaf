"""A hub model while the Hugging Face Hub cannot be reached: refused in seconds, saying why.

Without the check huggingface_hub retries each file for about 25 s and the
worker then calls the model "not found". The end-to-end test makes a real
attempt from a process with an empty cache and ``HF_HUB_OFFLINE=0``: on a
machine without network (this one) that is huggingface.co itself; where the
Hub answers, ``HF_ENDPOINT`` names a host that never resolves (``.invalid``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.redis_server import free_ports
from tokenq.shared.exit_codes import EXIT_USAGE
from tokenq.worker.backends.hf.load import unreachable

NEVER_RESOLVES = "https://tokenq-hub-check.invalid"
"""A Hub endpoint no DNS answers (RFC 2606 reserves ``.invalid``)."""


def test_a_host_no_dns_knows_is_named() -> None:
    why = unreachable(NEVER_RESOLVES)
    assert why is not None and why.startswith("the DNS lookup of tokenq-hub-check.invalid failed")


def test_a_refused_connection_is_named() -> None:
    port = free_ports()
    why = unreachable(f"http://127.0.0.1:{port}")
    assert why is not None and f"connecting to 127.0.0.1:{port} failed" in why


def test_a_host_that_answers_is_reachable() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert unreachable(f"http://127.0.0.1:{port}") is None


def test_behind_a_proxy_nothing_is_concluded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("https_proxy", "http://proxy.example:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert unreachable(NEVER_RESOLVES) is None


def test_a_worker_asked_for_an_uncached_hub_model_says_the_hub_cannot_be_reached(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")  # the hf backend is the one that asks the Hub
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("TOKENQ_", "HF_", "TRANSFORMERS_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0", PYTHONUNBUFFERED="1")
    if unreachable("https://huggingface.co") is None:  # this machine has network
        env["HF_ENDPOINT"] = NEVER_RESOLVES
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tokenq.shared.cli", "worker", "--model", "BAAI/bge-small-en-v1.5",
         "--redis-url", f"redis://127.0.0.1:{free_ports()}/0"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    took = time.monotonic() - started
    assert done.returncode == EXIT_USAGE, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenq worker: ") and "BAAI/bge-small-en-v1.5" in last
    assert "is not in the local Hugging Face cache and the Hub" in last
    assert "cannot be reached" in last and "HF_HUB_OFFLINE=1" in last and "hf download" in last
    assert "Traceback" not in done.stderr and "Retrying" not in done.stderr
    assert took < 20, f"took {took:.1f}s"
