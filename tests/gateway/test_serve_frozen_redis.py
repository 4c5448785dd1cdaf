"""``tokenq serve`` when Redis hangs (SIGSTOP) rather than dies: every route's 503 within 3 s.

A frozen Redis keeps its connections open and accepts new ones (the kernel
does), but answers nothing, so each command waited the socket's timeout and
every retry: a route answered at ``--timeout-s`` (30 s), not in the 1.5 s a
Redis that refuses connections gets. Every route that reads Redis now waits
under the gateway's probe (``Gateway.ask``, ``delivery.Reachability``), whose
own ``XLEN`` gives up after ``PROBE_TIMEOUT_S``. Here, against a real
redis-server stopped with SIGSTOP (and continued in a ``finally``), a real sim
worker and the in-process gateway: each route answers 503 within 3 s, both
for a request arriving while Redis is frozen and for one queued before, and
after SIGCONT the gateway serves again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.gateway.test_serve_clients import (
    assert_waiting_requests_fail_fast,
    gateway,
    ghost_worker,
)
from tests.redis_server import RedisServer, freezable_server, frozen
from tests.support import SIM_FLAGS, SimModel
from tests.workers import Fleet

ROUTES = [
    ("GET", "/health", None), ("GET", "/", None), ("GET", "/ping", None),
    ("GET", "/ready", None), ("GET", "/info", None),
    ("POST", "/v1/embeddings", {"model": "m", "input": "x"}),
    ("POST", "/embeddings", {"model": "m", "input": "x"}),
    ("POST", "/embed", {"inputs": "x"}), ("POST", "/", {"inputs": "x"}),
    ("POST", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
    ("POST", "/rerank", {"query": "q", "texts": ["a"]}),
    ("POST", "/v1/rerank", {"query": "q", "documents": ["a"]}),
    ("POST", "/predict", {"inputs": "x"}),
    ("POST", "/embed_sparse", {"inputs": "x"}), ("POST", "/embed_all", {"inputs": "x"}),
    ("POST", "/tokenize", {"inputs": "x"}), ("POST", "/decode", {"ids": [1, 2]}),
    ("POST", "/v1/embeddings", {"model": "m", "input": "x"}, {"Idempotency-Key": "frozen"}),
]
"""Every route that reads Redis (the sim's queue refuses some with a 4xx while Redis answers),
and a keyed request, whose claim on its key reads Redis first."""

WITHOUT_REDIS = [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/openapi.json")]
"""Routes that read nothing of Redis: they answer 200 while it is frozen."""

BOUND_S = 3.0
"""Documented: about 1.5 s (docs/RELIABILITY.md); a margin for a busy machine."""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with freezable_server(tmp_path / "redis") as own:
        yield own


def ask(http, route: tuple) -> tuple[int, float, str]:
    method, path, body, *headers = route
    started = time.monotonic()
    answer = http.request(method, path, json=body, headers=headers[0] if headers else None)
    return answer.status_code, time.monotonic() - started, answer.text


def test_every_route_is_503_within_3_s_while_redis_is_frozen_and_serves_after_sigcont(
    server: RedisServer, tmp_path: Path, queue_name: str,
):
    env = {**os.environ, "TOKENQ_REDIS_URL": server.url, "TOKENQ_QUEUE": queue_name,
           "PYTHONUNBUFFERED": "1"}
    fleet = Fleet(env, tmp_path, SIM_FLAGS)
    check = redis.Redis.from_url(server.url)
    try:
        fleet.start(ready=check, queue=queue_name)
        with gateway(server.url, queue_name) as http:
            for route in ROUTES:  # every connection of the pool opened, every read cached
                status, _, text = ask(http, route)
                assert status < 500, (route, text)
            with ThreadPoolExecutor(len(ROUTES)) as pool, frozen(server):
                calls = {(*route[:2], len(route)): pool.submit(ask, http, route)
                         for route in ROUTES}
                for method, path in WITHOUT_REDIS:
                    assert http.request(method, path).status_code == 200, path
                answers = {route: call.result(timeout=60) for route, call in calls.items()}
            for route, (status, took, text) in answers.items():
                assert status == 503 and "Redis" in text, (route, status, text)
                assert took < BOUND_S, (route, took)
            worst = max(took for _, took, _ in answers.values())
            print(f"worst answer while Redis was frozen: {worst:.2f} s")

            health = http.get("/health")  # continued: the gateway serves again
            assert health.status_code == 200, health.text
            vectors = http.post("/embed", json={"inputs": ["after the thaw"]})
            assert vectors.status_code == 200, vectors.text
            assert SimModel().vector_ok(np.asarray(vectors.json()[0], dtype="<f4"),
                                        "after the thaw")
    finally:
        check.close()
        fleet.close()


def test_requests_waiting_when_redis_freezes_are_503_within_3_s(
    server: RedisServer, queue_name: str,
):
    """Queued with nobody to answer them (a liveness key with no worker behind it), then
    Redis freezes: each wait learns it from the probe, not at ``--timeout-s``."""
    check = redis.Redis.from_url(server.url)
    ghost_worker(check, queue_name)
    try:
        with gateway(server.url, queue_name, timeout_s=60) as http:
            assert_waiting_requests_fail_fast(http, check, queue_name, lambda: frozen(server))
            assert http.get("/health").status_code == 200
    finally:
        check.close()
