"""Every refusal names its parameter, and the gateway answers with that name.

A table over each ``BadRequest`` the public client API can raise: each
carries ``param`` (the argument at fault, set where it is raised), and the
HTTP gateway's error body names it as its ``param``: the option itself when
the request sent that option, else the route's input field. A worker's
refusal travels the same way, as the error reply's ``param``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import redis

from tokenq.producer import BadRequest, Client
from tokenq.producer.call_options import WORKER_OPTIONS
from tokenq.producer.replies import outcome
from tokenq.producer.serve.errors import from_exception
from tokenq.shared import keys, wire
from tokenq.shared.errors import RemoteError
from tokenq.shared.request_options import ModelFacts, OptionError, parse_options
from tokenq.shared.settings import ClientSettings

pytest_plugins = ("tests.cli_fixtures",)

ITEMS = "input"
"""The input field of the route the gateway answers for (``/v1/embeddings``)."""

NOW_MS = int(time.time() * 1000)

Case = tuple[str, Callable[[Client], Any], str]

CALLS: list[Case] = [
    ("text not a string", lambda c: c.submit(5), "text"),  # type: ignore[arg-type]
    ("empty text", lambda c: c.submit(""), "text"),
    ("text_pair not a string", lambda c: c.submit("a", text_pair=5), "text_pair"),
    ("deadline_s not a number", lambda c: c.submit("a", deadline_s="x"), "deadline_s"),
    ("deadline_s negative", lambda c: c.submit("a", deadline_s=-1), "deadline_s"),
    ("deadline_s past 30 days", lambda c: c.submit("a", deadline_s=1e8), "deadline_s"),
    ("deadline_ms not an int", lambda c: c.submit("a", deadline_ms=1.5), "deadline_ms"),
    ("deadline_ms passed", lambda c: c.submit("a", deadline_ms=1), "deadline_ms"),
    ("deadline_ms too far", lambda c: c.submit("a", deadline_ms=NOW_MS + 10**11), "deadline_ms"),
    ("both deadlines", lambda c: c.submit("a", deadline_s=1, deadline_ms=NOW_MS + 9000),
     "deadline_ms"),
    ("priority out of range", lambda c: c.submit("a", priority=99), "priority"),
    ("reply_to empty", lambda c: c.submit("a", reply_to=""), "reply_to"),
    ("opts not a mapping", lambda c: c.submit("a", opts=[1]), "opts"),
    ("opts not msgpack", lambda c: c.submit("a", opts={"x": 2**70}), "opts"),
    ("opts too big", lambda c: c.submit("a", opts={"x": "y" * 70_000}), "opts"),
    ("an option twice", lambda c: c.submit("a", dimensions=4, opts={"dimensions": 4}),
     "dimensions"),
    ("dimensions zero", lambda c: c.submit("a", dimensions=0), "dimensions"),
    ("dimensions not an int", lambda c: c.submit("a", dimensions="4"), "dimensions"),
    ("normalize not a flag", lambda c: c.submit("a", normalize="yes"), "normalize"),
    ("truncate not a flag", lambda c: c.submit("a", truncate=1), "truncate"),
    ("raw_scores not a flag", lambda c: c.submit("a", raw_scores="no"), "raw_scores"),
    ("prompt not a string", lambda c: c.submit("a", prompt=5), "prompt"),
    ("prompt and prompt_name", lambda c: c.submit("a", prompt="p", prompt_name="q"),
     "prompt_name"),
    ("prompt_name not a string", lambda c: c.submit("a", prompt_name=5), "prompt_name"),
    ("output unknown", lambda c: c.submit("a", output="words"), "output"),
    ("texts a string", lambda c: c.submit_many("abc"), "texts"),
    ("texts not iterable", lambda c: c.submit_many(5), "texts"),  # type: ignore[arg-type]
    ("a batch item not a string", lambda c: c.submit_many(["a", 5]), "texts"),
    ("a batch tuple of one", lambda c: c.submit_many([("a",)]), "texts"),
    ("a batch pair not a string", lambda c: c.submit_many([("a", 5)]), "text_pair"),
    ("infer timeout_s", lambda c: c.infer("a", timeout_s=-1), "timeout_s"),
    ("results a string", lambda c: c.results("abc"), "request_ids"),
    ("results an empty id", lambda c: c.results([""]), "request_ids"),
    ("result timeout_s", lambda c: c.result("abc", timeout_s=0), "timeout_s"),
]

CONFIG: dict[str, str] = {
    "task": "embed", "dim": "8", "pairs": "0", "max_input_tokens": "4", "policy": "reject",
    "prompts": json.dumps({"query": "query: "}),
}
"""A queue whose config lets the client refuse more early (see CONFIGURED)."""

CONFIGURED: list[Case] = [
    ("a pair to a single-text model", lambda c: c.submit("a", text_pair="b"), "text_pair"),
    ("over the token limit", lambda c: c.submit("word " * 50), "text"),
    ("a batch item over the token limit", lambda c: c.submit_many(["a", "word " * 50]),
     "texts"),
    ("more dimensions than the model", lambda c: c.submit("a", dimensions=16), "dimensions"),
    ("an unknown prompt", lambda c: c.submit("a", prompt_name="nope"), "prompt_name"),
    ("raw_scores on an embedder", lambda c: c.submit("a", raw_scores=True), "raw_scores"),
]

CLIENTS: list[tuple[str, dict[str, Any], str]] = [
    ("config_ttl_s negative", {"config_ttl_s": -1}, "config_ttl_s"),
    ("estimator unknown", {"estimator": "magic"}, "estimator"),
    ("estimator not callable", {"estimator": 5}, "estimator"),
    ("a bad setting", {"max_queue_length": -1}, "max_queue_length"),
    ("a bad queue name", {"queue": "no spaces"}, "queue"),
]


@pytest.fixture
def client(redis_url: str, queue_name: str) -> Iterator[Client]:
    with Client(redis_url, queue_name, timeout_s=2, estimator="heuristic") as made:
        yield made


@pytest.fixture
def configured(redis_url: str, queue_name: str, r: redis.Redis) -> Iterator[Client]:
    r.hset(keys.config(keys.QueueRef(queue_name)), mapping=CONFIG)
    with Client(redis_url, queue_name, timeout_s=2, estimator="heuristic") as made:
        yield made


def refusal(call: Callable[[Client], Any], client: Client) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        call(client)
    return caught.value


def assert_gateway_names(error: BadRequest, param: str, options: set[str]) -> None:
    """The gateway's body names ``param`` when the request sent it as an option, else the
    route's input field (the client's argument names are not the route's fields)."""
    body = from_exception(error, options, ITEMS).openai_body()["error"]
    assert body["param"] == (param if param in options else ITEMS)


def sent_options(param: str) -> set[str]:
    """What the gateway would have sent as options for a refusal of ``param``."""
    return {param} & WORKER_OPTIONS


@pytest.mark.parametrize(("why", "call", "param"), CALLS, ids=[case[0] for case in CALLS])
def test_each_refusal_names_its_param(client: Client, why: str, call: Callable, param: str):
    error = refusal(call, client)
    assert error.param == param, f"{why}: {error}"
    assert_gateway_names(error, param, sent_options(param))


@pytest.mark.parametrize(("why", "call", "param"), CONFIGURED,
                         ids=[case[0] for case in CONFIGURED])
def test_each_early_refusal_the_config_allows_names_its_param(
    configured: Client, why: str, call: Callable, param: str
):
    error = refusal(call, configured)
    assert error.param == param, f"{why}: {error}"
    assert_gateway_names(error, param, sent_options(param))


def test_an_estimator_that_misbehaves_is_named(redis_url: str, queue_name: str):
    with Client(redis_url, queue_name, timeout_s=2, estimator=lambda text: -1) as client:
        assert refusal(lambda c: c.submit("a"), client).param == "estimator"


def test_an_oversize_text_is_named(redis_url: str, queue_name: str):
    settings = ClientSettings(redis_url=redis_url, queue=queue_name, max_request_bytes=4)
    with Client(settings=settings, timeout_s=2) as client:
        assert refusal(lambda c: c.submit("hello"), client).param == "text"
        assert refusal(lambda c: c.submit_many(["hello"]), client).param == "texts"


@pytest.mark.parametrize(("why", "arguments", "param"), CLIENTS,
                         ids=[case[0] for case in CLIENTS])
def test_a_bad_client_argument_is_named(redis_url: str, queue_name: str, why: str,
                                        arguments: dict[str, Any], param: str):
    given: dict[str, Any] = {"queue": queue_name, **arguments}
    with pytest.raises(BadRequest) as caught:
        Client(redis_url, **given)
    assert caught.value.param == param, f"{why}: {caught.value}"


OPTION_REFUSALS: list[tuple[dict[str, Any], ModelFacts, str]] = [
    ({"dimensions": 9}, ModelFacts(embeds=True, dim=8), "dimensions"),
    ({"dimensions": 4}, ModelFacts(embeds=False), "dimensions"),
    ({"normalize": True}, ModelFacts(sparse=True), "normalize"),
    ({"raw_scores": True}, ModelFacts(embeds=True), "raw_scores"),
    ({"raw_scores": True}, ModelFacts(sparse=True), "raw_scores"),
    ({"output": "tokens", "dimensions": 4}, ModelFacts(embeds=True), "output"),
    ({"output": "tokens"}, ModelFacts(embeds=True, can_output_tokens=False), "output"),
    ({"prompt": "x" * 5000}, ModelFacts(), "prompt"),
    ({"prompt_name": "nope"}, ModelFacts(prompts={"query": "q: "}), "prompt_name"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("opts", "facts", "param"), OPTION_REFUSALS)
def test_a_worker_refusal_travels_with_its_param(opts: dict, facts: ModelFacts, param: str):
    """What the worker refuses names the option, in the reply and in the gateway's body."""
    with pytest.raises(OptionError) as caught:
        parse_options(opts, facts)
    assert caught.value.param == param
    raw = wire.encode_reply(wire.error_reply("r1", "bad_request", f"opts: {caught.value}",
                                             caught.value.param))
    error = outcome(wire.decode_reply(raw))
    assert isinstance(error, RemoteError) and error.param == param
    body = from_exception(error, set(opts), ITEMS).openai_body()["error"]
    assert body["param"] == param and body["code"] == "bad_request"


@pytest.mark.unit
def test_a_reply_without_param_still_decodes():
    """Replies of workers that predate ``param`` (and bad ``param`` values) read as None."""
    for extra in ({}, {"param": 5}, {"param": "x" * (wire.MAX_PARAM_CHARS + 1)}):
        body = {"id": "r1", "ok": False, "error": {"code": "bad_request", "message": "m", **extra}}
        reply = wire.decode_reply(msgpack.packb(body))
        assert reply.error is not None and reply.error.param is None


def test_a_worker_names_the_option_it_refuses(sim_worker, redis_url: str, queue_name: str):
    """A real worker's refusal reaches the caller with ``param``, and the gateway's body."""
    sim_worker()
    with Client(redis_url, queue_name, timeout_s=20, refuse_early=False) as client:
        (refused,) = client.infer_many(["a"], dimensions=10**4, return_exceptions=True)
    assert isinstance(refused, RemoteError) and refused.code == "bad_request", refused
    assert refused.param == "dimensions" and refused.message.startswith("opts: dimensions")
    body = from_exception(refused, {"dimensions"}, ITEMS).openai_body()["error"]
    assert body["param"] == "dimensions" and body["message"].startswith("dimensions ")
