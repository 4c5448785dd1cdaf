"""Hostile requests against ``tokenq serve``: what one HTTP request may cost, asserted.

The bounds live in producer/serve/bounds.py and are stated in
docs/SECURITY.md ("The gateway: what one HTTP request may cost"). Each test
here tries to break one:

* validation is linear: hostile bodies (a list of strings ending in an
  integer, ``[[1],[1],...]``, empty containers, deep nesting, many tiny
  items, one huge item) are parsed under hypothesis with their time and
  traced memory bounded by the body's size, on every route's model, and
  posted to every route: a 4xx, never a 500;
* the loop stays free: ``/health`` answers within 0.5 s while a hostile
  body of the largest accepted size is being validated, and the process's
  peak memory stays within the stated multiple of it;
* amplification: the bytes one request puts into Redis (its stream entries'
  fields and values, summed) are at most ``MAX_AMPLIFICATION`` times its
  body plus a fixed size per entry; a ``/rerank`` over it is a 413 that
  writes nothing;
* admission: at most ``--max-concurrent-requests`` requests are in flight,
  the next is a 429 in TEI's shape; slow clients (408 after ``--timeout-s``),
  clients that leave mid-body (499) and oversized headers do not keep a
  place or break the gateway.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cli_support import wait_for
from tests.redis_server import alive, cmdline, descendants, free_port
from tokenq.producer.serve import bounds, schemas, tei_api
from tokenq.producer.serve.errors import ApiError
from tokenq.shared import keys
from tokenq.shared.settings import ServeSettings

pytest_plugins = ("tests.cli_fixtures",)

testclient = pytest.importorskip("fastapi.testclient")
from tests.gateway.test_serve import assert_vectors  # noqa: E402
from tokenq.producer.serve.app import create_app  # noqa: E402  (after the skip)
from tokenq.producer.serve.bounds import (  # noqa: E402
    MAX_AMPLIFICATION,
    OFFLOAD_BYTES,
    PARSE_MEMORY_FACTOR,
    PARSE_PROCESSES,
)

MODELS = (schemas.OpenAIEmbeddings, schemas.TEIEmbed, schemas.TEIRerank, schemas.TEIPredict,
          tei_api.TEITokenize, tei_api.TEIDecode)
FIELD = {schemas.OpenAIEmbeddings: "input", schemas.TEIEmbed: "inputs",
         schemas.TEIRerank: "texts", schemas.TEIPredict: "inputs",
         tei_api.TEITokenize: "inputs", tei_api.TEIDecode: "ids"}

SECONDS_PER_MB = 2.0
"""Generous on a shared 2-core machine: the parse takes about 0.1 s per MB alone."""


# ------------------------------------------------------------- hostile bodies

ITEMS = {
    "text": b'"ab"', "char": b'"a"', "int": b"1", "float": b"0.5", "tokens": b"[1]",
    "empty_list": b"[]", "empty_object": b"{}", "null": b"null", "bool": b"true",
    "texts": b'["a"]', "pair": b'["a","b"]', "unicode": '"é✓"'.encode(),
}


@dataclass(frozen=True)
class HostileBody:
    """A body built from many copies of one item, then a different tail (or not)."""

    field: str
    item: str
    count: int
    tail: str | None

    def raw(self, model: type) -> bytes:
        items = [ITEMS[self.item]] * self.count + ([ITEMS[self.tail]] if self.tail else [])
        value = b"[" + b",".join(items) + b"]"
        extra = b'"query":"q",' if model is schemas.TEIRerank and self.field != "query" else b""
        return b'{"model":"m",' + extra + b'"' + self.field.encode() + b'":' + value + b"}"


def hostile_bodies(field: st.SearchStrategy[str]) -> st.SearchStrategy[HostileBody]:
    return st.builds(
        HostileBody, field, st.sampled_from(sorted(ITEMS)),
        st.integers(1, 60_000), st.none() | st.sampled_from(sorted(ITEMS)),
    )


def deep(depth: int, field: str = "input") -> bytes:
    return b'{"model":"m","' + field.encode() + b'":' + b"[" * depth + b"]" * depth + b"}"


def parse_and_build(model: type, raw: bytes) -> None:
    """What a route does with a body before anything is sent (refusals are ApiErrors)."""
    body = schemas.parse(model, raw)
    if model is schemas.OpenAIEmbeddings:
        schemas.openai_job(body)
    elif model is schemas.TEIEmbed:
        schemas.tei_embed_job(body)
    elif model is schemas.TEIRerank:
        schemas.rerank_job(body)
    elif model is schemas.TEIPredict:
        schemas.predict_job(body)
    # /tokenize and /decode: the parse is all that comes before the tokenizer


def assert_bounded(model: type, raw: bytes) -> None:
    """Parsing ``raw`` is an answer or an ApiError, within time and memory linear in its size.

    Timed without tracemalloc (which slows every allocation), then traced. The time is
    this thread's CPU time with the collector paused: a quadratic parse shows in it, while
    a loaded machine, another thread of this process (a tokenizer's pool spinning) or a
    collection of an earlier test's garbage do not.
    """
    gc.collect()
    gc.disable()
    try:
        started = time.thread_time()
        refused(model, raw)
        seconds = time.thread_time() - started
    finally:
        gc.enable()
    assert seconds <= 0.2 + SECONDS_PER_MB * len(raw) / 1e6, (seconds, len(raw))
    tracemalloc.start()
    try:
        refused(model, raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= PARSE_MEMORY_FACTOR * len(raw) + 64 * 1024, (peak, len(raw))


def refused(model: type, raw: bytes) -> ApiError | None:
    try:
        parse_and_build(model, raw)
    except ApiError as error:
        assert error.status in (400, 413, 422) and error.message
        return error
    return None


# Each example parses a body of up to a megabyte twice, once under tracemalloc (about a
# second of CPU); the shapes the issue names are each parsed at a megabyte below.
HOSTILE = settings(max_examples=30, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@HOSTILE
@given(st.sampled_from(MODELS), st.data())
def test_validation_is_linear_in_the_body_for_any_shape(model, data):
    body = data.draw(hostile_bodies(st.sampled_from([FIELD[model], "query", "model", "extra"])))
    assert_bounded(model, body.raw(model))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("shape", [
    "strings then an int", "tokens then a string", "empty lists", "empty objects", "deep",
    "one huge text",
])
def test_the_shapes_the_issue_names_are_linear_at_a_megabyte(model, shape):
    field = FIELD[model]
    many = 200_000
    raw = {
        "strings then an int": HostileBody(field, "text", many, "int").raw(model),
        "tokens then a string": HostileBody(field, "tokens", many, "text").raw(model),
        "empty lists": HostileBody(field, "empty_list", many * 2, None).raw(model),
        "empty objects": HostileBody(field, "empty_object", many * 2, None).raw(model),
        "deep": deep(500_000, field),
        "one huge text": json.dumps({"model": "m", "query": "q", field: "x" * 1_000_000,
                                     }).encode(),
    }[shape]
    assert_bounded(model, raw)


@pytest.mark.unit
@pytest.mark.parametrize(("value", "param"), [
    (["a", "b", 3], "input[2]"),
    ([[1], [2], "c"], "input[2]"),
    ([1, 2, [3]], "input[2]"),
    ([[1], [2, "x"]], "input[1]"),
    ({"a": 1}, "input"),
])
def test_a_mixed_list_is_a_422_naming_the_field_and_index(value, param):
    with pytest.raises(ApiError) as caught:
        schemas.parse(schemas.OpenAIEmbeddings, json.dumps({"model": "m", "input": value}).encode())
    assert (caught.value.status, caught.value.param) == (422, param)
    assert caught.value.message.startswith(param)


json_items = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False)
    | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner,
                                                                  max_size=2),
    max_leaves=8,
)


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.lists(json_items, max_size=12),
       st.sampled_from([bounds.TEXT, bounds.TOKEN, bounds.TEXTS, bounds.TOKENS,
                        bounds.TEXT_OR_TOKENS]))
def test_the_type_pass_finds_the_same_first_misfit_as_checking_each_item(items, variant):
    """``first_misfit`` uses C-level passes over types; the oracle checks item by item."""
    def fits(item: Any) -> bool:
        if variant.flat and type(item) in variant.flat:
            return True
        return (variant.nested is not None and type(item) is list
                and all(type(part) in variant.nested for part in item))

    expected = next((index for index, item in enumerate(items) if not fits(item)), None)
    assert variant.first_misfit(items) == expected


@pytest.mark.unit
@pytest.mark.parametrize("raw", [
    b"[1]", b'"text"', b"nope", b"\xff\xfe{}", b"[" * 100_000, b'{"input": [' * 50_000,
    b'{"model": "m", "input": ' + b"1" * 5000 + b"}", b'{"model": "m", "input": "a"',
])
def test_a_body_that_is_not_a_json_object_is_a_422_naming_body(raw):
    """JSON of another shape is a 422; a body that is not JSON at all a 400, as OpenAI and
    TEI answer."""
    status = 422 if raw in (b"[1]", b'"text"') else 400
    for model in MODELS:
        error = refused(model, raw)
        assert error is not None and (error.status, error.param) == (status, "body"), error


def test_a_lone_surrogate_is_refused_by_name_not_a_server_error(redis_server):
    app = create_app(ServeSettings(redis_url=redis_server.url, queue="surrogates",
                                   timeout_s=0.1, cold_start_s=5))
    with testclient.TestClient(app, raise_server_exceptions=True) as http:
        for route, body in (("/embed", b'{"inputs": ["a", "\\ud800"]}'),
                            ("/rerank", b'{"query": "\\udfff", "texts": ["a"]}')):
            answer = http.post(route, content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 422, answer.text


# ----------------------------------------------------------- amplification


def entry_bytes(client: redis.Redis, queue: str) -> tuple[int, int]:
    """(entries, bytes written for them): the request stream's field names and values, and
    each entry's ``seen`` key (retry dedupe) and its value."""
    q = keys.QueueRef(queue)
    entries = client.xrange(keys.requests(q))
    written = sum(len(k) + len(v) for _, fields in entries for k, v in fields.items())
    for key in client.scan_iter(match=keys.seen(q, "*"), count=1000):
        written += len(key) + len(client.get(key) or b"")
    return len(entries), written


ENTRY_FIXED_BYTES = 512
"""A stated bound on what one entry writes besides its text and options: its id, reply_to,
tokens, timeout, field names and its seen key (about 460 bytes with a 128-character queue
name, the longest allowed, which the property test uses)."""


def post_rerank(http: Any, query: str, texts: list[str]) -> tuple[httpx.Response, int]:
    raw = json.dumps({"query": query, "texts": texts}).encode()
    answer = http.post("/rerank", content=raw, headers={"content-type": "application/json"})
    return answer, len(raw)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(query=st.integers(1, 40_000), count=st.integers(1, 300), text=st.integers(1, 200))
def test_what_one_request_writes_to_redis_is_bounded_by_its_body(
    redis_server, query, count, text
):
    queue = f"amp{os.urandom(6).hex()}".ljust(128, "q")  # the longest name: the most per entry
    client = redis.Redis.from_url(redis_server.url)
    app = create_app(ServeSettings(redis_url=redis_server.url, queue=queue, timeout_s=0.1,
                                   retries=0, cold_start_s=5))  # no worker: queued
    try:
        with testclient.TestClient(app) as http:
            answer, size = post_rerank(http, "q" * query, ["t" * text] * count)
        entries, written = entry_bytes(client, queue)
        assert written <= MAX_AMPLIFICATION * size + ENTRY_FIXED_BYTES * entries
        if (query + text) * count > MAX_AMPLIFICATION * size:
            assert answer.status_code == 413 and written == 0, answer.text
            assert f"{MAX_AMPLIFICATION}" in answer.json()["error"]
        else:
            assert answer.status_code == 504 and entries == count  # no worker: it waited
    finally:
        client.delete(keys.requests(keys.QueueRef(queue)))
        client.close()


ROUTES = {schemas.OpenAIEmbeddings: "/v1/embeddings", schemas.TEIEmbed: "/embed",
          schemas.TEIRerank: "/rerank", schemas.TEIPredict: "/predict",
          tei_api.TEITokenize: "/tokenize", tei_api.TEIDecode: "/decode"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(st.sampled_from(MODELS), st.data())
def test_hostile_bodies_through_the_gateway_are_answered_and_bounded_in_redis(
    redis_server, model, data
):
    """Every route, any hostile body: a 4xx (or 504: valid, sent, and no worker), never a
    500, and what reached Redis within the amplification bound."""
    field = data.draw(st.sampled_from([FIELD[model], "query", "extra"]))
    body = data.draw(hostile_bodies(st.just(field)).filter(lambda b: b.count <= 3000))
    raw = body.raw(model)
    queue = f"fuzz{os.urandom(6).hex()}"
    client = redis.Redis.from_url(redis_server.url)
    app = create_app(ServeSettings(redis_url=redis_server.url, queue=queue, timeout_s=0.1,
                                   max_client_batch_size=4096, cold_start_s=5))
    try:
        with testclient.TestClient(app, raise_server_exceptions=True) as http:
            answer = http.post(ROUTES[model], content=raw,
                               headers={"content-type": "application/json"})
        assert answer.status_code in (400, 413, 422, 504), answer.text
        entries, written = entry_bytes(client, queue)
        assert written <= MAX_AMPLIFICATION * len(raw) + ENTRY_FIXED_BYTES * entries
    finally:
        client.delete(keys.requests(keys.QueueRef(queue)))
        client.close()


def test_the_issues_rerank_wrote_1700_times_its_body_and_is_now_refused(redis_server, r):
    queue = f"amp{os.urandom(6).hex()}"
    app = create_app(ServeSettings(redis_url=redis_server.url, queue=queue, timeout_s=0.1))
    with testclient.TestClient(app) as http:
        answer, _ = post_rerank(http, "q" * 30_000, ["t"] * 1_000)
    assert answer.status_code == 413 and answer.json()["error_type"] == "Validation"
    assert entry_bytes(r, queue) == (0, 0)


def test_an_option_sent_with_every_input_counts_once_per_input(redis_server, r):
    """``prompt_name`` goes in every request's ``opts``: 60 KB of it over 2,048 inputs."""
    queue = f"amp{os.urandom(6).hex()}"
    app = create_app(ServeSettings(redis_url=redis_server.url, queue=queue, timeout_s=0.1,
                                   cold_start_s=5))  # no worker: queued
    with testclient.TestClient(app) as http:
        answer = http.post("/embed", json={"inputs": ["a"] * 2048, "prompt_name": "p" * 60_000})
        assert answer.status_code == 413 and "inputs" in answer.json()["error"], answer.text
        assert entry_bytes(r, queue) == (0, 0)
        fine = http.post("/embed", json={"inputs": ["a"] * 8, "prompt_name": "query"})
        assert fine.status_code == 504  # no worker: it was sent, and waited for
    assert entry_bytes(r, queue)[0] == 8


# ------------------------------------------------ the gateway as a process


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


CHILD_BASELINE = 150 << 20
"""A parser process's own interpreter and imports (pydantic, fastapi), before any body."""


@dataclass
class Served:
    url: str
    port: int
    process: subprocess.Popen
    log: Path

    def peak_rss(self) -> int:
        """The gateway process's own peak resident memory."""
        return peak_rss(self.process.pid)

    def parsers(self) -> list[int]:
        """Its body parsers' processes (``spawn``ed by its pool)."""
        return [pid for pid in descendants(self.process.pid)
                if alive(pid) and "spawn_main" in cmdline(pid)]

    def children_peak_rss(self) -> int:
        """The peak resident memory of its living child processes, summed."""
        return sum(peak_rss(pid) for pid in descendants(self.process.pid) if alive(pid))

    def raw(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def in_flight(self) -> float:
        """The gateway's ``tokenq_serve_in_flight`` gauge."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith("tokenq_serve_in_flight "):
                return float(line.split()[1])
        raise AssertionError("no tokenq_serve_in_flight")


@pytest.fixture
def serve(redis_url, queue_name, spawn, tmp_path) -> Callable[..., Served]:
    """``tokenq serve`` as a process on a free port with ``flags``, once it answers."""
    def start(*flags: str) -> Served:
        port = free_port()
        log = tmp_path / f"serve{port}.log"
        process = spawn([sys.executable, "-m", "tokenq.shared.cli", "serve", "--redis-url",
                         redis_url, "--queue", queue_name, "--port", str(port), *flags],
                        stdout=log.open("wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return Served(url, port, process, log)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(log.read_text())
    return start


def health_latencies(client: httpx.Client, url: str, busy: threading.Event) -> list[float]:
    """How long each /health took, asked every 50 ms while ``busy`` is set."""
    latencies = []
    while not busy.is_set():
        time.sleep(0.005)
    while busy.is_set():
        started = time.perf_counter()
        assert client.get(f"{url}/health").status_code == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.05)
    return latencies


@pytest.mark.parametrize("megabytes", [1, pytest.param(16, marks=pytest.mark.slow)])
def test_health_answers_while_a_hostile_body_is_validated(serve, megabytes):
    served = serve()
    size = megabytes * (1 << 20) - 64
    raw = HostileBody("input", "text", size // 5, "int").raw(schemas.OpenAIEmbeddings)
    warm = HostileBody("input", "text", OFFLOAD_BYTES // 5 + 1, "int").raw(
        schemas.OpenAIEmbeddings)  # starts the parser processes, which a busy machine delays
    assert httpx.post(f"{served.url}/v1/embeddings", content=warm, timeout=60).status_code == 422
    before = served.peak_rss()
    busy = threading.Event()
    latencies: list[float] = []
    prober = httpx.Client(timeout=10)  # connected before: the connect is not a sample
    assert prober.get(f"{served.url}/health").status_code == 200
    watcher = threading.Thread(target=lambda: latencies.extend(
        health_latencies(prober, served.url, busy)))
    watcher.start()
    try:
        busy.set()
        started = time.perf_counter()
        answer = httpx.post(f"{served.url}/v1/embeddings", content=raw, timeout=120,
                            headers={"content-type": "application/json"})
        seconds = time.perf_counter() - started
    finally:
        busy.clear()
        watcher.join()
        prober.close()
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == f"input[{size // 5}]"
    assert seconds <= 1 + SECONDS_PER_MB * megabytes, seconds
    assert latencies and max(latencies) < 0.5, latencies
    # the gateway itself holds the body and little more; the parsers expand it
    assert served.peak_rss() - before <= 4 * len(raw) + (16 << 20), served.peak_rss() - before
    children = served.children_peak_rss()
    assert children <= PARSE_PROCESSES * CHILD_BASELINE + PARSE_MEMORY_FACTOR * len(raw), children


def test_the_parsers_end_when_the_gateway_is_killed(serve):
    """A parser process holds both ends of its pool's pipe, so it would not see the gateway
    go: it watches its parent instead, and ends within about a second of SIGKILL."""
    served = serve()
    big = HostileBody("input", "text", OFFLOAD_BYTES // 5 + 1, "int").raw(
        schemas.OpenAIEmbeddings)
    assert httpx.post(f"{served.url}/v1/embeddings", content=big, timeout=60).status_code == 422
    parsers = served.parsers()
    assert parsers
    served.process.kill()
    served.process.wait()
    wait_for(lambda: not any(map(alive, parsers)), timeout=10,
             what="the parser processes to end")


def test_big_valid_bodies_are_parsed_apart_and_answered(serve, sim_worker):
    """Over ``OFFLOAD_BYTES`` a body is parsed in a child process; the job comes back whole."""
    sim_worker()
    served = serve()
    texts = [f"text {i} " + "word " * 80 for i in range(700)]
    assert len(json.dumps(texts)) > OFFLOAD_BYTES
    openai = httpx.post(f"{served.url}/v1/embeddings", json={"model": "m", "input": texts},
                        timeout=60)
    assert openai.status_code == 200, openai.text
    assert [item["index"] for item in openai.json()["data"]] == list(range(len(texts)))
    assert_vectors([item["embedding"] for item in openai.json()["data"]], texts)
    tei = httpx.post(f"{served.url}/embed", json={"inputs": texts, "normalize": True},
                     timeout=60)
    assert tei.status_code == 200, tei.text
    assert_vectors(tei.json(), texts)
    for route, body in (("/rerank", {"query": "q", "texts": texts}),
                        ("/predict", {"inputs": [[text] for text in texts]})):
        answer = httpx.post(f"{served.url}{route}", json=body, timeout=60)
        assert answer.status_code == 424, answer.text  # parsed, then refused: the sim embeds
        assert answer.json()["error_type"] == "Backend" and "model" in answer.json()["error"]


def test_over_the_concurrency_cap_is_429_in_teis_shape(serve, sim_worker):
    sim_worker("--sim-batch-ms", "1500")
    served = serve("--max-concurrent-requests", "2")
    results: list[httpx.Response] = []

    def embed() -> None:
        results.append(httpx.post(f"{served.url}/embed", json={"inputs": "x"}, timeout=30))

    threads = [threading.Thread(target=embed) for _ in range(5)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    statuses = sorted(answer.status_code for answer in results)
    assert statuses == [200, 200, 429, 429, 429], [a.text for a in results]
    refused = next(answer for answer in results if answer.status_code == 429)
    assert refused.json()["error_type"] == "Overloaded" and "2" in refused.json()["error"]
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert httpx.post(f"{served.url}/embed", json={"inputs": "x"}, timeout=30).status_code == 200
    assert httpx.get(f"{served.url}/info").json()["max_concurrent_requests"] == 2


def request_head(path: str, length: int, extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n").encode() + extra + b"\r\n"


def test_slow_clients_and_clients_that_leave_do_not_keep_a_place(serve, sim_worker):
    """With one place, a client that leaves mid-body and one that never finishes its
    body (408 after --timeout-s) both give it back; oversized headers are refused."""
    sim_worker()
    served = serve("--max-concurrent-requests", "1", "--timeout-s", "1")
    with served.raw() as gone:
        gone.sendall(request_head("/embed", 1000) + b'{"inputs": "')
        wait_for(lambda: served.in_flight() == 1, what="the first body being read")
    wait_for(lambda: served.in_flight() == 0, what="the place given back")
    assert httpx.post(f"{served.url}/embed", json={"inputs": "x"}, timeout=10).status_code == 200
    with served.raw() as slow:
        slow.sendall(request_head("/embed", 1000) + b'{"inputs": "')
        wait_for(lambda: served.in_flight() == 1, what="the slow body being read")
        busy = httpx.post(f"{served.url}/embed", json={"inputs": "x"}, timeout=10)
        assert busy.status_code == 429  # the slow one holds the only place ...
        answer = slow.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer  # ... for at most --timeout-s
    assert httpx.post(f"{served.url}/embed", json={"inputs": "x"}, timeout=10).status_code == 200
    for extra in (b"X-Big: " + b"a" * 100_000 + b"\r\n",
                  b"".join(b"X-%d: a\r\n" % i for i in range(20_000))):
        with served.raw() as headers:
            headers.sendall(request_head("/embed", 2, extra) + b"{}")
            assert headers.recv(4096).split(b" ")[1].startswith(b"4")
    metrics = httpx.get(f"{served.url}/metrics").text
    assert 'route="/embed",status="499"' in metrics and 'route="/embed",status="408"' in metrics
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert "Traceback" not in served.log.read_text()
