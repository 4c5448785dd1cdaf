"""Sparse (SPLADE) models and token embeddings: TEI's ``/embed_sparse`` and ``/embed_all``.

The reference is sentence-transformers' own ``SparseEncoder`` on a tiny
random BERT masked-LM that sentence-transformers itself saves in its sparse
layout (MLMTransformer + SpladePooling), so the files are exactly what the
reference library writes. tokenq must give the same weights through the hf
backend directly (inputs of different lengths in one padded batch), through
the in-process ``Batcher``, and through a real worker, real Redis and the
gateway's ``/embed_sparse`` (TEI's ``[{"index", "value"}]`` per input).

Token embeddings (the request option ``output: tokens``, TEI's
``/embed_all``) must equal the transformer's last hidden states, per token,
run alone by plain transformers, through the ``Batcher`` and through a
worker and the gateway, within the bounds on their size.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("sentence_transformers") is None:  # looked up, not imported (~4 s)
    pytest.skip("sentence_transformers is not installed", allow_module_level=True)
testclient = pytest.importorskip("fastapi.testclient")

from tests.redis_server import RedisServer  # noqa: E402
from tests.serve_process import (  # noqa: E402
    TEI_CHECKS,
    TEI_SPEC,
    schemathesis,
    start_gateway,
)
from tests.tiny_bert import (  # noqa: E402
    tiny_vocab,
    write_sentence_transformers_files,
    write_tiny_bert,
)
from tests.workers import WorkerProcess  # noqa: E402
from tokenq.producer.serve import bounds  # noqa: E402
from tokenq.shared import wire  # noqa: E402
from tokenq.shared.errors import BadRequest, ConfigError, RemoteError  # noqa: E402
from tokenq.shared.request_options import ModelFacts, parse_options  # noqa: E402
from tokenq.shared.settings import ServeSettings  # noqa: E402
from tokenq.worker.backends.base import TextInput  # noqa: E402
from tokenq.worker.backends.hf.backend import HFBackend, HFOptions  # noqa: E402

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog, again and again and again",
    "cat",
    "a long passage about cats and dogs and foxes that goes on for a while",
]
ATOL = 1e-5
TIMEOUT_S = 60.0


def write_tiny_splade(path: Path, *, strategy: str = "max", activation: str = "relu",
                      seed: int = 0) -> Path:
    """A tiny random BERT masked-LM saved by ``SparseEncoder.save`` (MLMTransformer, SpladePooling).

    ``initializer_range`` is large so the logits spread on both sides of 0:
    some vocabulary weights are zero, some not, in every row.
    """
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    mlm = path.parent / f"{path.name}-mlm"
    mlm.mkdir(parents=True, exist_ok=True)
    vocab = tiny_vocab()
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    tokenizer.model_max_length = 64
    tokenizer.save_pretrained(str(mlm))
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64, initializer_range=0.2)
    torch.manual_seed(seed)
    BertForMaskedLM(config).eval().save_pretrained(str(mlm))
    modules = [MLMTransformer(str(mlm)),
               SpladePooling(pooling_strategy=strategy, activation_function=activation)]
    SparseEncoder(modules=modules, device="cpu").save(str(path))
    return path


def reference(path: Path, texts: list[str]) -> np.ndarray:
    """sentence-transformers' SparseEncoder's rows, dense (rows x vocabulary)."""
    from sentence_transformers import SparseEncoder

    encoder = SparseEncoder(str(path), device="cpu")
    return encoder.encode(texts, convert_to_tensor=True).to_dense().float().numpy()


@pytest.fixture(scope="module")
def splade(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_splade(tmp_path_factory.mktemp("splade") / "model", seed=31)


def load(path: Path, **options) -> HFBackend:
    return HFBackend.load(HFOptions(model=str(path), task="sparse", device="cpu", **options))


@pytest.mark.parametrize(("strategy", "activation"),
                         [("max", "relu"), ("sum", "log1p_relu")])
def test_the_hf_backend_gives_sparse_encoders_weights_in_one_padded_batch(
    tmp_path: Path, strategy: str, activation: str
) -> None:
    model = write_tiny_splade(tmp_path / "m", strategy=strategy, activation=activation, seed=32)
    backend = load(model)
    assert backend.info.task == "sparse" and backend.info.dim == len(tiny_vocab())
    assert backend.info.extra["runtime"] == "torch"
    rows = backend.run(backend.tokenize([TextInput(text) for text in TEXTS], None))
    expected = reference(model, TEXTS)
    np.testing.assert_allclose(np.stack(rows), expected, atol=ATOL, rtol=1e-5)
    for text, row in zip(TEXTS, rows, strict=True):  # a padded row equals the row alone
        (alone,) = backend.run(backend.tokenize([TextInput(text)], None))
        np.testing.assert_allclose(row, alone, atol=ATOL, rtol=1e-5)
    nonzero = (expected > 0).sum(axis=1)
    assert (nonzero > 0).all() and (nonzero < expected.shape[1]).all()  # really sparse


def test_the_batcher_gives_sparse_encoders_weights(splade: Path) -> None:
    from tokenq.worker.local import Batcher

    async def main() -> list[np.ndarray]:
        async with Batcher(load(splade), max_batch_tokens=256, max_batch_size=4,
                           linger_ms=1) as batcher:
            return await asyncio.gather(*(batcher.submit(text) for text in TEXTS))

    rows = asyncio.run(main())
    np.testing.assert_allclose(np.stack(rows), reference(splade, TEXTS), atol=ATOL, rtol=1e-5)


def test_a_splade_model_is_refused_as_an_embedder_and_on_onnx_naming_the_fix(
    splade: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="--task sparse"):
        HFBackend.load(HFOptions(model=str(splade), task="embed", device="cpu"))
    with pytest.raises(ConfigError, match="--runtime torch"):
        load(splade, runtime="onnx")
    other = tmp_path / "other"
    other.mkdir()
    for name in os.listdir(splade):
        if (splade / name).is_file():
            (other / name).write_bytes((splade / name).read_bytes())
    (other / "1_SpladePooling").mkdir()
    (other / "1_SpladePooling" / "config.json").write_text(
        json.dumps({"pooling_strategy": "mean", "activation_function": "relu"}))
    with pytest.raises(ConfigError, match="pooling_strategy 'mean'"):
        load(other)
    modules = json.loads((other / "modules.json").read_text())
    (other / "modules.json").write_text(json.dumps(modules[:1]))
    with pytest.raises(ConfigError, match="not supported for --task sparse"):
        load(other)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e6, width=32) | st.just(0.0),
                min_size=1, max_size=300))
def test_a_dense_row_survives_the_sparse_reply_exactly(values: list[float]) -> None:
    """Finisher's nonzero pairs, packed and decoded, rebuild the backend's row bit for bit."""
    from tokenq.worker.pipeline.finisher import sparse_entries

    row = np.array(values, dtype=np.float32)
    indices, weights = sparse_entries(row)
    reply = wire.decode_reply(wire.encode_reply(
        wire.sparse_reply("r", indices, weights, row.size, tokens=3)))
    rebuilt = np.zeros(row.size, dtype=np.float32)
    for index, weight in reply.sparse_pairs():
        rebuilt[index] = weight
    assert rebuilt.tobytes() == row.tobytes()
    assert len(indices) == 4 * np.count_nonzero(row) <= 4 * row.size


# ------------------------------------------------------------------ through the queue


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny sentence-transformers embedder (mean pooling, Normalize), max 24 tokens."""
    root = tmp_path_factory.mktemp("embedder")
    return write_sentence_transformers_files(write_tiny_bert(root / "embed", seed=33),
                                             pooling="mean", normalize=True)


EMBED_LIMIT = 24
"""The tiny embedder's max_seq_length: longer inputs are truncated (the queue's policy)."""


def hidden_states(path: Path, text: str) -> np.ndarray:
    """The transformer's last hidden state for each token of ``text`` (truncated), run alone."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path))
    with torch.no_grad():
        encoded = tokenizer(text, truncation=True, max_length=EMBED_LIMIT, return_tensors="pt")
        return model.eval()(**encoded)[0][0].numpy()


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, splade: Path, embedder: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """hf workers serving the tiny SPLADE model (``--task sparse``) and the tiny embedder,
    and a sim embedder (which offers no token embeddings)."""
    env = dict(os.environ, TOKENQ_REDIS_URL=redis_server.url, PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    logs = tmp_path_factory.mktemp("sparse-workers")
    sparse, sim, embed = (f"{kind}{uuid.uuid4().hex[:10]}" for kind in ("sp", "se", "em"))
    workers = [
        (WorkerProcess(env, logs, "--queue", sparse, "--backend", "hf", "--model", str(splade),
                       "--task", "sparse", "--heartbeat-s", "0.5", name="sparse"), sparse),
        (WorkerProcess(env, logs, "--queue", embed, "--backend", "hf", "--model", str(embedder),
                       "--heartbeat-s", "0.5", name="embed"), embed),
        (WorkerProcess(env, logs, "--queue", sim, "--backend", "sim", "--heartbeat-s", "0.5",
                       name="sim"), sim),
    ]
    client = redis.Redis.from_url(redis_server.url)
    try:
        for worker, queue in workers:
            worker.wait_ready(client, queue, timeout=120)
        yield SimpleNamespace(url=redis_server.url, sparse=sparse, sim=sim, embed=embed)
    finally:
        client.close()
        for worker, _ in workers:
            worker.close()


def http(url: str, queue: str) -> testclient.TestClient:
    from tokenq.producer.serve.app import create_app

    app = create_app(ServeSettings(redis_url=url, queue=queue, timeout_s=TIMEOUT_S))
    return testclient.TestClient(app, raise_server_exceptions=True)


def pairs_of(row: np.ndarray) -> list[tuple[int, float]]:
    return [(int(i), float(row[i])) for i in np.flatnonzero(row)]


def assert_pairs(got: list[tuple[int, float]], row: np.ndarray) -> None:
    want = pairs_of(row)
    assert [index for index, _ in got] == [index for index, _ in want]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], atol=ATOL, rtol=1e-5)


@pytest.mark.slow  # an hf worker: torch's import and the model's load
def test_a_worker_and_embed_sparse_answer_sparse_encoders_pairs(fleet, splade: Path) -> None:
    from tokenq.producer import Client

    expected = reference(splade, TEXTS)
    with Client(fleet.url, fleet.sparse, timeout_s=TIMEOUT_S) as client:
        results = client.infer_many(TEXTS)
    for result, row in zip(results, expected, strict=True):
        assert result.embedding is None and result.dim == expected.shape[1]
        assert result.sparse is not None
        assert_pairs(list(result.sparse), row)
    with http(fleet.url, fleet.sparse) as api:
        answer = api.post("/embed_sparse", json={"inputs": TEXTS})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert len(body) == len(TEXTS)
        for entries, row in zip(body, expected, strict=True):
            assert all(set(entry) == {"index", "value"} for entry in entries)
            assert_pairs([(e["index"], e["value"]) for e in entries], row)
        one = api.post("/embed_sparse", json={"inputs": TEXTS[0], "truncate": True})
        assert one.status_code == 200 and len(one.json()) == 1
        assert_pairs([(e["index"], e["value"]) for e in one.json()[0]], expected[0])
        root = api.post("/", json={"inputs": TEXTS[:2]})  # TEI routes a SPLADE model's POST /
        assert root.status_code == 200 and len(root.json()) == 2, root.text
        for entries, row in zip(root.json(), expected[:2], strict=True):
            assert_pairs([(e["index"], e["value"]) for e in entries], row)
        for route, body_of in (("/predict", {"inputs": "hello"}),
                               ("/rerank", {"query": "a", "texts": ["b"]}),
                               ("/v1/embeddings", {"input": "a", "model": fleet.sparse})):
            refused = api.post(route, json=body_of)  # refused before anything is enqueued
            assert refused.status_code == 424, (route, refused.text)
        info = api.get("/info").json()
        assert info["model_type"] == {"embedding": {"pooling": "splade"}}
        assert api.post("/embed_sparse", json={"inputs": []}).status_code == 400
        left = api.post("/embed_sparse", json={"inputs": "a", "truncation_direction": "Left"})
        assert left.status_code == 422
        ids = api.post("/embed_sparse", json={"inputs": [[1, 2, 3]]})
        assert ids.status_code == 422 and "token-id" in ids.json()["error"]
        embed = api.post("/embed", json={"inputs": "hello"})
        assert embed.status_code == 424 and embed.json()["error_type"] == "Backend"


def test_embed_sparse_on_an_embedding_queue_is_refused_by_name(fleet) -> None:
    with http(fleet.url, fleet.sim) as api:
        answer = api.post("/embed_sparse", json={"inputs": ["hello"]})
    assert answer.status_code == 424 and answer.json()["error_type"] == "Backend"
    assert "not a sparse (SPLADE) model" in answer.json()["error"]


# ------------------------------------------------------------------ token embeddings


def test_output_tokens_are_the_last_hidden_states_beside_pooled_rows(
    embedder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one batch with default requests, which keep their pooled, unit-length vectors."""
    from tokenq.worker.local import Batcher

    backend = HFBackend.load(HFOptions(model=str(embedder), device="cpu"))
    assert backend.info.token_dim == 32

    async def main() -> list[np.ndarray]:
        async with Batcher(backend, max_batch_tokens=512, max_batch_size=8,
                           linger_ms=20) as batcher:
            tokens = [batcher.submit(text, output="tokens") for text in TEXTS]
            pooled = [batcher.submit(text) for text in TEXTS]
            return await asyncio.gather(*tokens, *pooled)

    rows = asyncio.run(main())
    for text, row, vector in zip(TEXTS, rows[:len(TEXTS)], rows[len(TEXTS):], strict=True):
        states = hidden_states(embedder, text)
        np.testing.assert_allclose(row, states, atol=ATOL, rtol=1e-5)
        mean = states.mean(axis=0)
        np.testing.assert_allclose(vector, mean / np.linalg.norm(mean), atol=ATOL)

    monkeypatch.setattr(wire, "MAX_TOKEN_EMBEDDING_FLOATS", 32 * 3)  # three tokens

    async def over() -> None:
        async with Batcher(backend, max_batch_tokens=512, max_batch_size=8,
                           linger_ms=1) as batcher:
            assert (await batcher.submit("cat", output="tokens")).shape == (3, 32)
            await batcher.submit("hello world", output="tokens")

    with pytest.raises(RemoteError, match="over the reply's limit of 96 floats"):
        asyncio.run(over())


@pytest.mark.parametrize(("opts", "facts", "message"), [
    ({"output": "pooled"}, ModelFacts(embeds=True), "output must be one of"),
    ({"output": 1}, ModelFacts(embeds=True), "output must be one of"),
    ({"output": "tokens", "dimensions": 8}, ModelFacts(embeds=True), "no dimensions"),
    ({"output": "tokens", "normalize": False}, ModelFacts(embeds=True), "no dimensions"),
    ({"output": "tokens"}, ModelFacts(embeds=False), "applies to embeddings"),
    ({"output": "tokens"}, ModelFacts(embeds=False, sparse=True), "sparse"),
    ({"output": "tokens"}, ModelFacts(embeds=True, can_output_tokens=False), "does not answer"),
    ({"dimensions": 8}, ModelFacts(embeds=False, sparse=True), "sparse"),
    ({"raw_scores": True}, ModelFacts(embeds=False, sparse=True), "sparse"),
])
def test_options_that_cannot_apply_are_refused_by_name(opts, facts, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options(opts, facts)
    assert parse_options({"output": "tokens"}, ModelFacts(embeds=True)).output_tokens


def test_the_gateway_bounds_a_token_answer_by_its_worst_case() -> None:
    per_input = 512 * 1024
    most = bounds.MAX_TOKEN_ANSWER_FLOATS // per_input
    bounds.check_token_answer(most, 512, 1024, "inputs")
    with pytest.raises(bounds.ApiError, match=f"send at most {most} inputs") as refused:
        bounds.check_token_answer(most + 1, 512, 1024, "inputs")
    assert refused.value.status == 413
    # One input is never refused here: each worker caps its own reply.
    bounds.check_token_answer(1, 8192, 4096, "inputs")
    bounds.check_token_answer(10**6, None, 1024, "inputs")  # limits unknown: the workers bound


@pytest.mark.slow  # hf workers
def test_embed_all_answers_each_tokens_hidden_state_through_a_worker(
    fleet, embedder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenq.producer import Client

    with Client(fleet.url, fleet.embed, timeout_s=TIMEOUT_S) as client:
        (result,) = client.infer_many(TEXTS[:1], output="tokens")
        with pytest.raises(BadRequest, match="no dimensions"):  # refused before the enqueue
            client.infer_many(TEXTS[:1], output="tokens", dimensions=4)
    assert result.embedding is None and result.dim == 32
    np.testing.assert_allclose(np.array(result.token_embeddings),
                               hidden_states(embedder, TEXTS[0]), atol=ATOL, rtol=1e-5)
    with http(fleet.url, fleet.embed) as api:
        answer = api.post("/embed_all", json={"inputs": TEXTS})
        assert answer.status_code == 200, answer.text
        for text, vectors in zip(TEXTS, answer.json(), strict=True):
            np.testing.assert_allclose(np.array(vectors), hidden_states(embedder, text),
                                       atol=ATOL, rtol=1e-5)
        monkeypatch.setattr(bounds, "MAX_TOKEN_ANSWER_FLOATS", 2 * EMBED_LIMIT * 32)
        assert api.post("/embed_all", json={"inputs": TEXTS[:2]}).status_code == 200
        big = api.post("/embed_all", json={"inputs": TEXTS[:3]})
        assert big.status_code == 413 and "send at most 2 inputs" in big.json()["error"]
    with http(fleet.url, fleet.sparse) as api:
        refused = api.post("/embed_all", json={"inputs": ["hello"]})
        assert refused.status_code == 424 and refused.json()["error_type"] == "Backend"
    with http(fleet.url, fleet.sim) as api:  # the sim offers no token embeddings
        refused = api.post("/embed_all", json={"inputs": ["hello"]})
        assert refused.status_code == 422, refused.text
        assert "does not answer token embeddings" in refused.json()["error"]


TEI_KIND_ROUTES = {"sparse": ("/embed_sparse", "/info", "/health"),
                   "embed": ("/embed_all", "/embed", "/similarity", "/info")}
"""TEI's routes a SPLADE queue and an hf embedder's (with real token embeddings) serve."""


@pytest.mark.slow  # hf workers
@pytest.mark.parametrize("kind", list(TEI_KIND_ROUTES))
def test_schemathesis_finds_nothing_against_teis_spec_for_sparse_and_token_answers(
    fleet, kind, spawn, tmp_path
) -> None:
    pytest.importorskip("schemathesis")
    url = start_gateway(spawn, fleet.url, getattr(fleet, kind), tmp_path / "serve.log",
                        "--timeout-s", "60")
    include = [arg for path in TEI_KIND_ROUTES[kind] for arg in ("--include-path", path)]
    run = schemathesis(str(TEI_SPEC), url, tmp_path, "--checks", TEI_CHECKS, *include,
                       examples=10)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-2000:]
