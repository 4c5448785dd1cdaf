"""A reply is never removed before it is in hand: one lost on its way is read again.

Each way a producer waits (``infer`` on its own key, ``infer_many`` on a
shared key, ``submit`` + ``results`` on many own keys, ``AsyncClient``'s
listener) is run through :class:`~tests.lossy_proxy.LossyProxy`, which lets
Redis answer and then loses that answer, with the connection, the moment it
holds the request's reply. Before the fix a BLPOP had already removed the
reply from Redis, so the caller timed out (docs/RELIABILITY.md, seen in the
AOF of a failing restart test); now the caller reconnects, reads the reply
again and gets the right vector, and the reply keys are gone afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import redis

from tests.lossy_proxy import LossyProxy
from tests.worker.test_e2e_core import DIM, MAX_INPUT, assert_vector, start_worker  # noqa: F401
from tokenq.producer import AsyncClient, Client
from tokenq.shared import keys
from tokenq.worker.backends.sim import expected_vector


@pytest.fixture
def proxy(redis_server) -> Iterator[LossyProxy]:
    lossy = LossyProxy(redis_server.port)
    yield lossy
    lossy.close()


def _infer(client: Client, texts: list[str], arm: Callable[[str], None]) -> list:
    client.infer("warm up: connections and the config read", timeout_s=20)
    arm(texts[0])
    return [client.infer(texts[0], timeout_s=20)]


def _infer_many(client: Client, texts: list[str], arm: Callable[[str], None]) -> list:
    arm(texts[len(texts) // 2])
    return client.infer_many(texts, timeout_s=20)


def _results(client: Client, texts: list[str], arm: Callable[[str], None]) -> list:
    ids = client.submit_many(texts)
    arm(texts[-1])
    return client.results(ids, timeout_s=20)


def _async_infer(client: Client, texts: list[str], arm: Callable[[str], None]) -> list:
    async def run() -> list:
        async with AsyncClient(redis_url=client.settings.redis_url,
                               queue=client.queue) as aclient:
            await aclient.infer("warm up", timeout_s=20)
            arm(texts[1])
            return await asyncio.gather(*(aclient.infer(t, timeout_s=20) for t in texts))
    return asyncio.run(run())


@pytest.mark.parametrize("wait", [_infer, _infer_many, _results, _async_infer],
                         ids=["infer", "infer_many", "results", "async_infer"])
def test_a_reply_lost_on_its_way_is_read_again(
    start_worker, proxy, r: redis.Redis, queue_name: str, wait  # noqa: F811
) -> None:
    start_worker("--linger-ms", "0")
    texts = [f"request {i} about tokens and batches" for i in range(6)]
    marked: dict[str, str] = {}

    def arm(text: str) -> None:
        marked["text"] = text
        proxy.lose_reply_with(vector_marker(text))

    with Client(redis_url=proxy.url, queue=queue_name) as client:
        results = wait(client, texts, arm)
    assert proxy.lost == 1, "the proxy never saw the reply it was to lose"
    expected = texts[: len(results)] if len(results) == len(texts) else [marked["text"]]
    for text, result in zip(expected, results, strict=True):
        assert_vector(list(result.embedding), text)
    assert not r.keys(keys.reply(keys.QueueRef(queue_name), "*")), "reply keys were left behind"


def vector_marker(text: str) -> bytes:
    """Bytes only this text's reply holds: the start of its sim vector, as the reply packs it."""
    return expected_vector(text, DIM, MAX_INPUT).astype("<f4").tobytes()[:16]
