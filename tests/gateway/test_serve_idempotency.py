"""``Idempotency-Key`` at the gateway: one answer per key, the first attempt's, on any replica.

Each gateway here is its own app (its own memory), all on one real Redis and
a real sim worker, so what a retry finds can only come from Redis
(docs/RELIABILITY.md, "Idempotent retries").
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.support import wait_for, wait_lane_ready
from tokenq.producer.serve import delivery as idempotency
from tokenq.shared import keys
from tokenq.shared.settings import ServeSettings

pytest_plugins = ("tests.cli_fixtures",)

openai = pytest.importorskip("openai")
testclient = pytest.importorskip("fastapi.testclient")
from tokenq.producer.serve.app import create_app  # noqa: E402  (after the skips)

TEXTS = ["one answer per key", "kept in Redis", "同じ答え"]


def replica(redis_url: str, queue: str, **settings: Any) -> testclient.TestClient:
    """One gateway replica: an app of its own, nothing shared with another but Redis."""
    return testclient.TestClient(create_app(ServeSettings(redis_url=redis_url, queue=queue,
                                                          **settings)))


@contextlib.contextmanager
def replicas(redis_url: str, queue: str, *timeouts_s: float, **settings: Any
             ) -> Iterator[tuple[testclient.TestClient, testclient.TestClient]]:
    """Two replicas of one gateway (``timeouts_s``: each one's ``--timeout-s``)."""
    first_s, then_s = timeouts_s or (30.0, 30.0)
    with replica(redis_url, queue, timeout_s=first_s, **settings) as one, \
            replica(redis_url, queue, timeout_s=then_s, **settings) as two:
        yield one, two


def added(r: redis.Redis, queue: str, shards: int = 1) -> int:
    """Entries ever added to every stream of the queue: each is one input computed once."""
    total = 0
    for lane in {*keys.lanes_of(keys.QueueRef(queue), shards), keys.QueueRef(queue)}:
        with contextlib.suppress(redis.ResponseError):  # no such stream
            total += int(r.xinfo_stream(keys.requests(lane))["entries-added"])
    return total


def record_of(queue: str, key: str) -> str:
    return keys.idempotent_answer(keys.QueueRef(queue), idempotency.key_digest(key))


def post(http: testclient.TestClient, key: str, texts: list[str] = TEXTS,
         route: str = "/v1/embeddings") -> httpx.Response:
    return http.post(route, json={"model": "m", "input": texts},
                     headers={"Idempotency-Key": key})


def test_a_sharded_queue_computes_each_input_once_for_two_posts_of_one_key(
    sim_worker, r, redis_url, queue_name, monkeypatch
):
    worker = sim_worker("--shards", "2", wait=False)
    wait_lane_ready(worker, r, queue_name, 2)
    stored = idempotency.Claim.store

    async def died_before_storing(claim: idempotency.Claim, status: int, body: bytes) -> None:
        """The first attempt's gateway answered and died: nothing stored, so its retry
        queues the inputs again, which only their shard's dedupe can drop."""

    with replicas(redis_url, queue_name) as (one, two):
        # the same replica twice: its round robin would take the other shard the second time
        for retry_on in (one, two):
            key = str(uuid.uuid4())
            monkeypatch.setattr(idempotency.Claim, "store", died_before_storing)
            first = post(one, key, TEXTS[:2])
            monkeypatch.setattr(idempotency.Claim, "store", stored)
            again = post(retry_on, key, TEXTS[:2])
            assert first.status_code == again.status_code == 200, (first.text, again.text)
            assert again.json()["data"] == first.json()["data"]
            replayed = post(one, key, TEXTS[:2])  # the retry stored it: a replay now
            assert replayed.content == again.content and replayed.headers["idempotent-replayed"]
    assert added(r, queue_name, 2) == 4  # two inputs for each of the two keys
class LostFirstAnswer(httpx.BaseTransport):
    """Sends the first request to ``first`` and loses its answer; the rest go to ``then``."""

    def __init__(self, first: testclient.TestClient, then: testclient.TestClient) -> None:
        self.first, self.then = first, then
        self.lost: Any = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        sent = {"content": request.read(), "headers": dict(request.headers)}
        if self.lost is None:
            self.lost = self.first.request(request.method, str(request.url), **sent)
            raise httpx.ReadError("the answer was lost on its way back", request=request)
        got = self.then.request(request.method, str(request.url), **sent)
        return httpx.Response(got.status_code, headers=dict(got.headers), content=got.content)


def test_the_sdks_retry_after_a_lost_200_gets_the_same_answer_from_another_replica(
    sim_worker, r, redis_url, queue_name
):
    sim_worker()
    key = str(uuid.uuid4())
    with replicas(redis_url, queue_name) as (one, two):
        lossy = LostFirstAnswer(one, two)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=2,
                               http_client=httpx.Client(transport=lossy))
        started = time.monotonic()
        created = client.embeddings.with_raw_response.create(
            model="m", input=TEXTS, extra_headers={"Idempotency-Key": key})
        waited = time.monotonic() - started
    assert lossy.lost is not None and lossy.lost.status_code == 200
    assert created.http_response.content == lossy.lost.content
    assert created.headers["idempotent-replayed"] == "true"
    assert waited < 10  # a replay, not a wait for --timeout-s (30 s)
    assert added(r, queue_name) == len(TEXTS)
    assert 0 < r.pttl(record_of(queue_name, key)) <= 60_000  # the dedupe window


def while_in_flight(r: redis.Redis, queue: str, key: str, first: testclient.TestClient,
                    then: testclient.TestClient) -> dict[str, httpx.Response]:
    """POST ``key`` to ``first`` and, once its claim is in Redis, again to ``then``."""
    answers: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: answers.update(first=post(first, key)))
    thread.start()
    try:
        wait_for(lambda: r.exists(record_of(queue, key)), what="the first attempt's claim")
        answers["retry"] = post(then, key)
    finally:
        thread.join()
    return answers


def test_a_retry_while_the_first_is_in_flight_waits_for_its_answer(
    sim_worker, r, redis_url, queue_name
):
    sim_worker("--sim-batch-ms", "1000")
    key = str(uuid.uuid4())
    with replicas(redis_url, queue_name) as (one, two):
        answers = while_in_flight(r, queue_name, key, one, two)
    assert answers["first"].status_code == answers["retry"].status_code == 200
    assert answers["retry"].content == answers["first"].content
    assert answers["retry"].headers["idempotent-replayed"] == "true"  # waited, then replayed
    assert added(r, queue_name) == len(TEXTS)


def test_a_key_reused_with_another_body_or_route_is_refused_naming_the_header(
    sim_worker, r, redis_url, queue_name
):
    sim_worker()
    key = str(uuid.uuid4())
    with replica(redis_url, queue_name) as http:
        assert post(http, key).status_code == 200
        other_body = post(http, key, ["something else"])
        other_route = post(http, key, route="/embeddings")
        tei = http.post("/embed", json={"inputs": TEXTS}, headers={"Idempotency-Key": key})
    for refused in (other_body, other_route):
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["param"] == "Idempotency-Key"
        assert refused.json()["error"]["code"] == "idempotency_key_reused"
    assert tei.status_code == 422 and "Idempotency-Key" in tei.json()["error"]
    assert added(r, queue_name) == len(TEXTS)


def test_an_answer_redis_refuses_to_store_still_reaches_the_caller_and_its_retry(
    sim_worker, r, redis_url, queue_name, monkeypatch
):
    sim_worker()
    key = str(uuid.uuid4())
    store = idempotency.Claim.store
    refused: list[bool] = []

    async def store_at_maxmemory(claim: idempotency.Claim, status: int, body: bytes) -> None:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)  # every write refused with OOM from here
        try:
            await store(claim, status, body)
        finally:
            r.config_set("maxmemory", 0)
        refused.append(not claim.stored)

    monkeypatch.setattr(idempotency.Claim, "store", store_at_maxmemory)
    with replicas(redis_url, queue_name) as (one, two):
        first = post(one, key)
        monkeypatch.setattr(idempotency.Claim, "store", store)
        retry = post(two, key)
    assert refused == [True]
    assert first.status_code == retry.status_code == 200, (first.text, retry.text)
    # recomputed from the kept replies: the same vectors, no input queued again
    assert retry.json()["data"] == first.json()["data"]
    assert "idempotent-replayed" not in retry.headers
    assert added(r, queue_name) == len(TEXTS)


def test_without_a_window_the_key_only_names_the_requests(sim_worker, r, redis_url, queue_name):
    sim_worker()
    key = str(uuid.uuid4())
    with replica(redis_url, queue_name, dedupe_ttl_s=0) as http:
        assert post(http, key).status_code == 200
    assert not r.exists(record_of(queue_name, key))


def test_an_answer_over_the_body_limit_is_not_kept_and_its_retry_rebuilds_it(
    sim_worker, r, redis_url, queue_name
):
    sim_worker()
    key, texts = str(uuid.uuid4()), [f"input {i}" for i in range(20)]
    with replicas(redis_url, queue_name, max_body_bytes=1024) as (one, two):
        first = post(one, key, texts)
        assert len(first.content) > 1024
        retry = post(two, key, texts)
    assert first.status_code == retry.status_code == 200
    assert retry.json()["data"] == first.json()["data"]
    assert "idempotent-replayed" not in retry.headers
    assert len(r.get(record_of(queue_name, key)) or b"") < 200  # the claim alone
    assert added(r, queue_name) == len(texts)


def test_a_retry_after_the_first_attempts_504_takes_over_and_reads_its_replies(
    sim_worker, r, redis_url, queue_name
):
    sim_worker("--sim-batch-ms", "2500")
    key = str(uuid.uuid4())
    with replicas(redis_url, queue_name, 1, 1) as (one, two):
        first = post(one, key)
        assert first.status_code == 504, first.text
        assert first.headers.get("x-should-retry") != "false"  # a retry can fix it
        retries = [post(two, key) for _ in range(2)]
        while retries[-1].status_code == 504 and len(retries) < 8:
            retries.append(post(two, key))
    assert retries[-1].status_code == 200, [answer.text for answer in retries]
    assert added(r, queue_name) == len(TEXTS)  # the first attempt's requests, computed once


def test_replies_past_their_deadline_are_a_504_no_retry_of_the_key_can_fix(
    sim_worker, r, redis_url, queue_name
):
    sim_worker("--sim-batch-ms", "2500")
    key = str(uuid.uuid4())
    with replica(redis_url, queue_name, timeout_s=1) as http:
        blocker = threading.Thread(target=post, args=(http, str(uuid.uuid4()), ["blocker"]))
        blocker.start()
        try:
            wait_for(lambda: added(r, queue_name) == 1, what="the blocker queued")
            time.sleep(0.3)  # the worker is running the blocker's batch
            answers = [post(http, key)]  # waits behind it past its 1 s deadline
            while answers[-1].headers.get("x-should-retry") != "false" and len(answers) < 8:
                answers.append(post(http, key))
        finally:
            blocker.join()
    assert answers[-1].status_code == 504, [answer.text for answer in answers]
    assert answers[-1].headers["x-should-retry"] == "false"
    assert "deadline" in answers[-1].text
    assert added(r, queue_name) == 1 + len(TEXTS)  # the blocker and the keyed inputs, once


def test_a_retry_that_outwaits_its_timeout_is_told_to_come_back(
    sim_worker, r, redis_url, queue_name
):
    sim_worker("--sim-batch-ms", "2500")
    key = str(uuid.uuid4())
    with replicas(redis_url, queue_name, 10, 1) as (one, impatient):
        answers = while_in_flight(r, queue_name, key, one, impatient)
        answers["later"] = post(impatient, key)
    early = answers["retry"]
    assert early.status_code == 409, early.text
    assert early.json()["error"]["code"] == "idempotency_key_in_flight"
    assert early.headers["x-should-retry"] == "true" and early.headers["retry-after"] == "1"
    assert answers["first"].status_code == 200
    assert answers["later"].content == answers["first"].content
    assert added(r, queue_name) == len(TEXTS)
