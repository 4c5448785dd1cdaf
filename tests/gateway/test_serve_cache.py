"""The gateway's way to the request option ``cache: false``: the OpenAI body's ``cache``
(the SDK's ``extra_body``) or the ``X-Tokenq-Cache: false`` header on any route; either
computes afresh what the result cache holds."""

from __future__ import annotations

import pytest

from tokenq.shared import keys

pytest_plugins = ("tests.cli_fixtures",)

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi.testclient")
from tests.gateway.test_serve import TEXTS, assert_vectors, gateway  # noqa: E402
from tests.support import wait_for  # noqa: E402


def rows(worker) -> int:
    return sum(batch["rows"] for batch in worker.batches())


def test_extra_body_and_a_header_turn_the_cache_off_through_the_openai_sdk(
        sim_worker, redis_url, r, queue_name):
    worker = sim_worker("--cache-bytes", "1000000")
    with gateway(redis_url, queue_name) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                               http_client=http, max_retries=0)
        client.embeddings.create(model="m", input=TEXTS)
        wait_for(lambda: r.hlen(keys.cache(keys.QueueRef(queue_name))[0]) == len(TEXTS))
        computed = rows(worker)
        cached = client.embeddings.create(model="m", input=TEXTS)
        assert rows(worker) == computed  # answered from the cache
        fresh = [client.embeddings.create(model="m", input=TEXTS, extra_body={"cache": False}),
                 client.embeddings.create(model="m", input=TEXTS,
                                          extra_headers={"X-Tokenq-Cache": "false"})]
        assert rows(worker) == computed + 2 * len(TEXTS)  # each computed afresh
        on = client.embeddings.create(model="m", input=TEXTS,
                                      extra_headers={"X-Tokenq-Cache": "true"})
        assert rows(worker) == computed + 2 * len(TEXTS)
        for created in (cached, *fresh, on):
            assert_vectors([item.embedding for item in created.data], TEXTS)
        bad = http.post("/embed", json={"inputs": "x"}, headers={"X-Tokenq-Cache": "maybe"})
        assert bad.status_code == 400 and "X-Tokenq-Cache" in bad.text
        # TEI's /embed (normalize: true, another digest), cached, then computed afresh
        assert http.post("/embed", json={"inputs": TEXTS}).status_code == 200
        wait_for(lambda: r.hlen(keys.cache(keys.QueueRef(queue_name))[0]) == 2 * len(TEXTS))
        tei = http.post("/embed", json={"inputs": TEXTS}, headers={"X-Tokenq-Cache": "false"})
        assert tei.status_code == 200
        assert rows(worker) == computed + 4 * len(TEXTS)
