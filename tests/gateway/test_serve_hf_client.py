"""``huggingface_hub``'s ``InferenceClient(base_url=gateway)`` gets the reference
library's numbers, and TEI's spec holds for every model kind.

Three tiny random BERTs, each run by an hf worker on its own queue with a ``tokenq serve``
process in front (``POST /`` answers by the queue's kind, as TEI's does): an embedder (a
sentence-transformers folder), a three-label classifier and a one-logit reranker. The
client's ``feature_extraction`` and ``sentence_similarity`` must equal sentence-transformers'
``encode`` and cosine on the same files, ``text_classification`` transformers' pipeline;
``/tokenize`` and ``/decode`` the tokenizer's own ids and text. Then schemathesis holds each
gateway to TEI's published spec on the routes its kind serves. docs/MIGRATING.md shows the
same client code.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import redis

from tests.redis_server import RedisServer
from tests.serve_process import (
    DOC_URL,
    TEI_CHECKS,
    TEI_SPEC,
    run_migrating_code,
    schemathesis,
    start_gateway,
)
from tests.workers import WorkerProcess

hub = pytest.importorskip("huggingface_hub")
if importlib.util.find_spec("sentence_transformers") is None:  # looked up, not imported (~4 s)
    pytest.skip("sentence_transformers is not installed", allow_module_level=True)
pytest.importorskip("transformers")

TEXT = "the quick brown fox"
OTHERS = ["hello world", "the dog", "the quick brown fox", "cat and dog"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
KIND_ROUTES = {
    "embed": ("/", "/embed", "/similarity", "/tokenize", "/decode", "/info"),
    "classify": ("/", "/predict", "/info"),
    "rerank": ("/", "/rerank", "/info"),
}
"""TEI's routes each kind of queue serves; ``POST /`` is checked by httpx (TEI's spec does not
list it)."""


def _with_tokenizer_json(path: Path) -> Path:
    """Add tokenizer.json (a fast tokenizer's file), which the worker publishes and the
    gateway's ``/tokenize`` loads."""
    from transformers import BertTokenizerFast

    BertTokenizerFast.from_pretrained(str(path)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def served(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[SimpleNamespace]:
    """One hf worker and one gateway per kind; ``.url[kind]``, ``.model[kind]``."""
    from tests.tiny_bert import write_sentence_transformers_files, write_tiny_bert

    root = tmp_path_factory.mktemp("hf-client-models")
    models = {
        "embed": write_sentence_transformers_files(
            _with_tokenizer_json(write_tiny_bert(root / "embed", seed=41)),
            pooling="mean", normalize=True),
        "classify": _with_tokenizer_json(write_tiny_bert(
            root / "classify", head="classify", num_labels=3, seed=42, id2label=LABELS)),
        "rerank": _with_tokenizer_json(write_tiny_bert(
            root / "rerank", head="classify", num_labels=1, seed=43)),
    }
    tasks = {"embed": (), "classify": ("--task", "classify"), "rerank": ("--task", "rerank")}
    env = dict(os.environ, TOKENQ_REDIS_URL=redis_server.url, PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    logs = tmp_path_factory.mktemp("hf-client-logs")
    queues = {kind: f"h{uuid.uuid4().hex[:12]}" for kind in models}
    workers = [WorkerProcess(env, logs, "--queue", queues[kind], "--backend", "hf", "--model",
                             str(models[kind]), *tasks[kind], "--heartbeat-s", "0.5", name=kind)
               for kind in models]
    gateways: list = []

    def spawn(argv: list[str], **kwargs):
        import subprocess

        gateways.append(subprocess.Popen(argv, **kwargs))
        return gateways[-1]

    client = redis.Redis.from_url(redis_server.url)
    try:
        for worker, kind in zip(workers, models, strict=True):
            worker.wait_ready(client, queues[kind], timeout=120)
        urls = {kind: start_gateway(spawn, redis_server.url, queues[kind],
                                    logs / f"serve-{kind}.log", "--timeout-s", "60")
                for kind in models}
        yield SimpleNamespace(url=urls, model=models, logs=logs)
    finally:
        client.close()
        for process in gateways:
            process.kill()
            process.wait(timeout=10)
        for worker in workers:
            worker.close()


@pytest.mark.slow  # three hf workers and three gateways: about a minute to start
def test_inference_client_matches_sentence_transformers_and_the_pipeline(served, monkeypatch):
    from sentence_transformers import SentenceTransformer

    # The suite runs with HF_HUB_OFFLINE=1 (no hub downloads), which huggingface_hub applies
    # to every request it makes, a local base_url's too; a user's client has it unset.
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    from transformers import pipeline

    reference = SentenceTransformer(str(served.model["embed"]), device="cpu")

    # docs/MIGRATING.md's code, as written (only its URLs changed):
    shown = run_migrating_code("`huggingface_hub`", {
        DOC_URL: served.url["embed"],
        DOC_URL.replace("tokenq-serve", "tokenq-classify"): served.url["classify"]})
    assert shown["similarities"] == pytest.approx(
        shown["client"].sentence_similarity(TEXT, other_sentences=OTHERS[:2]), abs=1e-6)
    vector, top = shown["vector"], shown["top"]
    similarities = shown["client"].sentence_similarity(TEXT, other_sentences=OTHERS)

    expected = reference.encode([TEXT], normalize_embeddings=True)
    np.testing.assert_allclose(np.asarray(vector).reshape(1, -1), expected, atol=1e-5)
    own = reference.encode([TEXT, *OTHERS], normalize_embeddings=True)
    np.testing.assert_allclose(similarities, own[1:] @ own[0], atol=1e-5)
    assert similarities[2] == pytest.approx(1.0, abs=1e-5)  # the same sentence

    classify = pipeline("text-classification", model=str(served.model["classify"]),
                        device="cpu", top_k=None)
    scores = {item["label"]: item["score"] for item in classify([TEXT])[0]}
    best = max(scores, key=scores.get)
    answered = top if isinstance(top, list) else [top]
    assert answered[0].label == best and answered[0].score == pytest.approx(scores[best],
                                                                            abs=1e-5)


@pytest.mark.slow
def test_tokenize_and_decode_are_the_tokenizers_own(served):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(served.model["embed"]))
    url = served.url["embed"]
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": [TEXT, "hello world"]}).json()
    for row, text in zip(tokens, [TEXT, "hello world"], strict=True):
        assert [token["id"] for token in row] == tokenizer(text)["input_ids"]
        assert row[0]["special"] and row[0]["start"] is None  # [CLS]
        for token in row[1:-1]:
            assert text[token["start"]:token["stop"]] == token["text"]
    plain = httpx.post(f"{url}/tokenize", json={"inputs": TEXT, "add_special_tokens": False})
    assert [token["id"] for token in plain.json()[0]] == tokenizer(
        TEXT, add_special_tokens=False)["input_ids"]
    ids = tokenizer([TEXT, "hello world"])["input_ids"]
    decoded = httpx.post(f"{url}/decode", json={"ids": ids}).json()
    assert decoded == tokenizer.batch_decode(ids, skip_special_tokens=True)
    one = httpx.post(f"{url}/decode", json={"ids": ids[0], "skip_special_tokens": False})
    assert one.json() == [tokenizer.decode(ids[0], skip_special_tokens=False)]
    for bad in ({"ids": [-1]}, {"ids": [2**32]}, {"ids": "12"}, {"ids": [[1], 2]}):
        refused = httpx.post(f"{url}/decode", json=bad)
        assert refused.status_code == 422 and refused.json()["error_type"] == "Validation", bad


@pytest.mark.slow
def test_post_root_answers_as_the_route_of_each_kind(served):
    pairs = {"query": TEXT, "texts": OTHERS}
    for kind, body, route in (("embed", {"inputs": [TEXT]}, "/embed"),
                              ("classify", {"inputs": TEXT}, "/predict"),
                              ("rerank", pairs, "/rerank")):
        root = httpx.post(f"{served.url[kind]}/", json=body, timeout=60)
        direct = httpx.post(f"{served.url[kind]}{route}", json=body, timeout=60)
        assert root.status_code == direct.status_code == 200, (kind, root.text)
        assert root.json() == direct.json(), kind
    for kind in served.url:
        assert httpx.get(f"{served.url[kind]}/").status_code == 200
        assert httpx.get(f"{served.url[kind]}/ping").status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KIND_ROUTES))
def test_schemathesis_finds_nothing_against_teis_spec_for_each_kind(served, kind, tmp_path):
    include = [arg for path in KIND_ROUTES[kind] for arg in ("--include-path", path)]
    run = schemathesis(str(TEI_SPEC), served.url[kind], tmp_path, "--checks", TEI_CHECKS,
                       *include, examples=10)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-2000:]
