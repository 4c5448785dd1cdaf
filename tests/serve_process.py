"""``tokenq serve`` as a process on a free port: for clients that need a real URL
(huggingface_hub's InferenceClient, schemathesis' CLI)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.redis_server import free_port


def start_gateway(spawn: Callable[..., subprocess.Popen], redis_url: str, queue: str,
                  log: Path, *flags: str) -> str:
    """Start ``tokenq serve`` on ``queue`` (killed by ``spawn`` at teardown); its base URL
    once ``/health`` answers 200."""
    port = free_port()
    out = log.open("wb")
    spawn([sys.executable, "-m", "tokenq.shared.cli", "serve", "--redis-url", redis_url,
           "--queue", queue, "--port", str(port), *flags], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                out.close()
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    out.close()
    raise AssertionError(log.read_text())


SCHEMATHESIS_CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "404", "413", "422", "429"]
"""
"""A schema-valid body may still be refused for what only the queue's model knows (its
prompts, its length limit, its kind, whether it publishes a tokenizer; docs/DECISIONS.md,
"TEI routes and OpenAPI"): those refusals are TEI's documented 400/413/422, never a 5xx."""

TEI_SPEC = Path(__file__).parent / "data" / "tei_openapi.json"
"""TEI's published API (tests/data/README.md says where it comes from)."""

TEI_CHECKS = ("not_a_server_error,status_code_conformance,response_schema_conformance,"
              "content_type_conformance")
"""What TEI's spec is held to: no 5xx, only its statuses, its bodies, its content types."""


def schemathesis(location: str, url: str, tmp: Path, *args: str,
                 examples: int = 20) -> subprocess.CompletedProcess[str]:
    """schemathesis' CLI against ``url``, bounded: ``examples`` per operation, a fixed seed,
    no example database (nothing is kept between runs), each request at most 30 s."""
    config = tmp / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    command = [str(Path(sys.executable).with_name("schemathesis")), "--config-file",
               str(config), "run", location, "--url", url, "--max-examples", str(examples),
               "--seed", "24", "--generation-database", "none", "--no-color",
               "--request-timeout", "30", "--workers", "1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp)
