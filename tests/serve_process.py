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
expected-statuses = ["2xx", "400", "404", "413", "422", "424", "429"]
"""
"""A schema-valid body may still be refused for what only the queue's model knows (its
prompts, its length limit, whether it publishes a tokenizer; docs/decisions/, "TEI routes
and OpenAPI"), or because the route is not for the queue's kind of model (``/rerank`` on an
embedder): those refusals are TEI's documented 400/413/422 and 424, never a 5xx."""

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


DOCS = Path(__file__).resolve().parent.parent
MIGRATING = DOCS / "docs" / "MIGRATING.md"
README = DOCS / "README.md"
DOC_URL = "http://tokenq-serve:8080"
"""The gateway's base URL in docs/MIGRATING.md's code (``tokenq-classify`` names a second one)."""
README_URL = "http://localhost:8080"
"""The gateway's base URL in README.md's code."""


def doc_code(path: Path, heading: str, containing: str = "", language: str = "python") -> str:
    """The ``language`` blocks of ``path`` under the heading that starts with ``heading``
    (those that contain ``containing``), joined: the exact code the docs show, for a test
    to run against a live gateway."""
    blocks: list[str] = []
    current, block, python = "", None, False
    for line in path.read_text().splitlines():
        if block is not None:
            if line.startswith("```"):
                text = "\n".join(block)
                if python and current.startswith(heading) and containing in text:
                    blocks.append(text)
                block = None
            else:
                block.append(line)
        elif line.startswith("```"):  # any fence: a ``# comment`` in a bash block is no heading
            block, python = [], line.strip() == f"```{language}"
        elif line.startswith("#"):
            current = line.lstrip("#").strip()
    if not blocks:
        raise AssertionError(f"{path.name} has no {language} block under {heading!r}")
    return "\n".join(blocks)


def migrating_code(heading: str) -> str:
    """:func:`doc_code` of docs/MIGRATING.md."""
    return doc_code(MIGRATING, heading)


def run_doc_code(code: str, urls: dict[str, str], name: str) -> dict[str, object]:
    """Run ``code`` with each documented URL replaced (``{doc_url: live_url}``); the names
    it left behind."""
    for documented, live in urls.items():
        code = code.replace(documented, live)
    names: dict[str, object] = {}
    exec(compile(code, name, "exec"), names)
    return names


def run_migrating_code(heading: str, urls: dict[str, str]) -> dict[str, object]:
    """:func:`run_doc_code` of :func:`migrating_code`."""
    return run_doc_code(migrating_code(heading), urls, f"docs/MIGRATING.md ({heading})")
