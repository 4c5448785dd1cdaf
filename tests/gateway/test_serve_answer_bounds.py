"""Every route's answer and the gateway's working memory are bounded, and big answers are built
off the event loop (docs/SECURITY.md, "What one HTTP request may cost, per route").

Each test starts a gateway process of its own and sends it the largest body the route
accepts, in the worst shape for that route, measuring the gateway's peak resident memory
(``VmHWM``, reset just before), the answer's size, and ``/health`` while the request runs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.serve_process import start_gateway
from tokenq.producer.serve.bounds import (
    MAX_DECODE_BYTES,
    MAX_TOKENIZE_BYTES,
    MAX_TOKENIZE_TOKENS,
)
from tokenq.shared import keys

pytest_plugins = ("tests.cli_fixtures",)
pytest.importorskip("fastapi")
from tokenq.producer.serve.render import Raw, encode  # noqa: E402  (after the skip)

MAX_BODY = 16 << 20
"""``--max-body-bytes``' default: the largest body any route accepts."""

BATCH = 2048
"""``--max-client-batch-size``' default: the most inputs one request carries."""

DIM = 1024
"""The sim's vector size here: a large model's, so one vector per input is a big answer."""

HEALTH_S = 1.5
"""``/health`` answers within this while any big request runs."""

MIB = 1 << 20
TOKENIZE_MEMORY = 128 * MIB
"""``/tokenize``'s working memory at its caps (measured: 90 MiB for the largest answer)."""
LONG_TOKEN = "x" * 200
"""The test tokenizer's longest token: ``/decode``'s worst id."""


@dataclass
class Measured:
    status: int
    answer: bytes
    growth: int
    """The gateway's peak resident memory during the request, over its resident memory before."""
    slowest_health_s: float

    def json(self) -> object:
        return json.loads(self.answer)


@dataclass
class Gateway:
    url: str
    pid: int

    def measure(self, path: str, body: bytes) -> Measured:
        """POST ``body`` to ``path`` while ``/health`` is asked every 50 ms."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_kib(self.pid, "VmRSS")
        outcome: dict[str, httpx.Response] = {}

        def post() -> None:
            outcome["answer"] = httpx.post(self.url + path, content=body, timeout=120,
                                           headers={"Content-Type": "application/json"})

        thread = threading.Thread(target=post)
        thread.start()
        slowest = 0.0
        with httpx.Client(timeout=30) as probe:
            while thread.is_alive():
                started = time.monotonic()
                assert probe.get(self.url + "/health").status_code == 200
                slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.05)
        thread.join()
        growth = (_status_kib(self.pid, "VmHWM") - before) * 1024
        answer = outcome["answer"]
        return Measured(answer.status_code, answer.content, growth, slowest)


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


@pytest.fixture
def gateway(spawn, redis_url: str, queue_name: str, tmp_path: Path
            ) -> Callable[..., Gateway]:
    """``gateway(*flags)``: a ``tokenq serve`` process on this test's queue."""

    def start(*flags: str) -> Gateway:
        started = []

        def spawning(argv, **kwargs):
            started.append(spawn(argv, **kwargs))
            return started[-1]

        url = start_gateway(spawning, redis_url, queue_name, tmp_path / "gateway.log", *flags)
        return Gateway(url, started[0].pid)

    return start


@pytest.fixture
def tokenizer_queue(r, queue_name: str, tmp_path: Path) -> None:
    """The queue's config hash names a word-level tokenizer (``a``, ``b`` and a 200-character
    token; ``[CLS] ... [SEP]`` around each text), as a worker would publish it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "a": 3, "b": 4, LONG_TOKEN: 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    r.hset(keys.config(keys.QueueRef(queue_name)), mapping={"tokenizer": str(path)})


def _body(**fields: object) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode()


def _words(count: int) -> str:
    """``count`` one-character tokens separated by spaces: a token for every two bytes."""
    return " ".join("a" * count)


def test_tokenize_answers_at_most_its_token_cap_and_refuses_beyond(tokenizer_queue, gateway):
    served = gateway()
    served.measure("/tokenize", _body(inputs=_words(150_000)))  # parsers and threads started

    largest = served.measure("/tokenize", _body(inputs=_words(MAX_TOKENIZE_TOKENS - 2)))
    assert largest.status == 200, largest.answer[:300]
    tokens = largest.json()[0]
    assert len(tokens) == MAX_TOKENIZE_TOKENS and tokens[1]["text"] == "a"
    assert len(largest.answer) <= 70 * MAX_TOKENIZE_TOKENS
    assert largest.growth <= TOKENIZE_MEMORY, largest.growth
    assert largest.slowest_health_s <= HEALTH_S

    over = served.measure("/tokenize", _body(inputs=_words(MAX_TOKENIZE_BYTES // 2)))
    assert over.status == 413 and str(MAX_TOKENIZE_TOKENS) in over.json()["error"]
    assert over.growth <= TOKENIZE_MEMORY, over.growth
    assert over.slowest_health_s <= HEALTH_S

    body = _body(inputs=_words(MAX_BODY // 2 - 8))
    assert len(body) <= MAX_BODY
    biggest = served.measure("/tokenize", body)
    assert biggest.status == 413 and str(MAX_TOKENIZE_BYTES) in biggest.json()["error"]
    assert biggest.growth <= 6 * len(body), biggest.growth
    assert biggest.slowest_health_s <= HEALTH_S


@pytest.mark.unit
@pytest.mark.parametrize("family", ["wordpiece", "unigram", "byte-level-bpe"])
def test_tokenize_counts_a_long_text_in_pieces_as_the_whole_text_counts(family, monkeypatch):
    """Pieces cut before whitespace count no more than the whole text does (a ``Strip``
    normalizer counts fewer), so the pieces' count refuses nothing the whole
    text's count would answer; what passes is counted whole."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    from tokenq.producer.serve import tei_api
    from tokenq.producer.serve.errors import ApiError

    words = ["hello", "world", "éclair", "日本語", "naïve", "don't", "3.14", "🙂", "\n", "a"]
    text = " ".join(words[i * 7 % len(words)] + " " * (i % 3) for i in range(3000))
    if family == "wordpiece":
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer()
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer: object = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"])
    elif family == "unigram":
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.normalizer = normalizers.Strip()
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=200, unk_token="[UNK]",
                                          special_tokens=["[UNK]"])
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=300,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[UNK] $A [UNK]", special_tokens=[("[UNK]", 0)])
    monkeypatch.setattr(tei_api, "PIECE", 256)
    pieces = list(tei_api._pieces(text))
    assert "".join(pieces) == text and len(pieces) > 50
    whole = len(tokenizer.encode(text))
    counted = sum(map(len, tokenizer.encode_batch(pieces, add_special_tokens=False))) + 2
    assert counted <= whole

    monkeypatch.setattr(tei_api, "MAX_TOKENIZE_TOKENS", whole - 1)
    with pytest.raises(ApiError, match=f"{whole} tokens, over the limit"):  # the exact count
        tei_api.tokenize_answer(tokenizer, [text], True)
    monkeypatch.setattr(tei_api, "MAX_TOKENIZE_TOKENS", whole // 2)
    with pytest.raises(ApiError, match="tokens or more, over the limit"):  # refused in pieces
        tei_api.count_tokens(tokenizer, [text], True)
    monkeypatch.setattr(tei_api, "MAX_TOKENIZE_TOKENS", whole)
    assert len(json.loads(tei_api.tokenize_answer(tokenizer, [text], True)[0].data)) == whole


def test_decode_answers_at_most_its_text_cap_and_refuses_beyond(tokenizer_queue, gateway):
    served = gateway()
    served.measure("/decode", _body(ids=[3] * 200_000))  # parsers started (a 413: over the cap)
    most = MAX_DECODE_BYTES // (len(LONG_TOKEN) + 1)

    largest = served.measure("/decode", _body(ids=[5] * most))
    assert largest.status == 200, largest.answer[:300]
    assert largest.json() == [" ".join([LONG_TOKEN] * most)]
    assert len(largest.answer) <= MAX_DECODE_BYTES
    assert largest.growth <= 5 * MAX_DECODE_BYTES, largest.growth
    assert largest.slowest_health_s <= HEALTH_S

    over = served.measure("/decode", _body(ids=[5] * (most + 1)))
    assert over.status == 413 and str(MAX_DECODE_BYTES) in over.json()["error"]

    body = _body(ids=[5] * (MAX_BODY // 2 - 8))
    biggest = served.measure("/decode", body)
    assert biggest.status == 413, biggest.answer[:300]
    assert biggest.growth <= 10 * len(body), biggest.growth
    assert biggest.slowest_health_s <= HEALTH_S


def test_a_vector_per_input_is_bounded_by_the_batch_and_built_off_the_loop(sim_worker, gateway):
    sim_worker("--sim-dim", str(DIM))
    served = gateway()
    inputs = ["a"] * BATCH  # the shortest inputs: the most answer per body byte
    served.measure("/embed", _body(inputs=["a"] * 60_000))  # over the batch: a 413

    for path, body, most in [
        ("/embed", _body(inputs=inputs), 24 * BATCH * DIM),
        ("/v1/embeddings", _body(input=inputs, model="m"), 24 * BATCH * DIM + 64 * BATCH),
        ("/v1/embeddings", _body(input=inputs, model="m", encoding_format="base64"),
         6 * BATCH * DIM + 64 * BATCH),
        ("/similarity", _body(inputs={"source_sentence": "a", "sentences": inputs[1:]}),
         24 * BATCH),
    ]:
        measured = served.measure(path, body)
        assert measured.status == 200, (path, measured.answer[:300])
        assert len(measured.answer) <= most, (path, len(measured.answer))
        assert measured.growth <= 6 * most, (path, measured.growth)
        assert measured.slowest_health_s <= HEALTH_S, path


def test_rerank_answers_are_bounded_by_the_body(sim_worker, gateway):
    sim_worker("--backend", "tests.plugins_for_tests:sim_reranker", "--sim-dim", "1")
    served = gateway()
    texts = ["a" * (MAX_BODY // BATCH - 16)] * BATCH  # the largest body, every text echoed
    for path, body in [
        ("/rerank", _body(query="a", texts=texts, return_text=True)),
        ("/v1/rerank", _body(query="a", documents=texts, model="m", return_documents=True)),
        ("/v2/rerank", _body(query="a", documents=texts, model="m")),
    ]:
        assert len(body) <= MAX_BODY
        measured = served.measure(path, body)
        assert measured.status == 200, (path, measured.answer[:300])
        assert len(measured.answer) <= len(body) + 96 * BATCH, (path, len(measured.answer))
        assert measured.growth <= 10 * len(body), (path, measured.growth)
        assert measured.slowest_health_s <= HEALTH_S, path


def test_predict_answers_a_score_per_label_per_input(sim_worker, gateway):
    labels = 32
    sim_worker("--backend", "tests.plugins_for_tests:sim_classifier", "--sim-dim", str(labels))
    served = gateway()
    measured = served.measure("/predict", _body(inputs=[["a"]] * BATCH, raw_scores=True))
    assert measured.status == 200, measured.answer[:300]
    assert len(measured.answer) <= 64 * BATCH * labels, len(measured.answer)
    assert measured.growth <= 1024 * BATCH * labels, measured.growth
    assert measured.slowest_health_s <= HEALTH_S


@pytest.mark.unit
def test_encoding_a_piece_at_a_time_spells_what_one_json_dumps_spells():
    from array import array

    vector = array("f", [0.5, -1.25, 3.0])
    answer = {"data": [{"embedding": vector, "index": i, "text": "é\n\""} for i in range(70)],
              "rows": [["x"] * 70, [], [1, 2.5, None, True]], "raw": Raw(b'[{"id":1}]'),
              "empty": {}, "model": "m"}
    plain = {**answer, "data": [{**item, "embedding": vector.tolist()} for item in answer["data"]],
             "raw": [{"id": 1}]}
    assert json.loads(encode(answer)) == plain
    assert encode(plain) == json.dumps(plain, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.unit
def test_a_sparse_answer_over_its_weight_cap_is_refused_before_it_is_written(monkeypatch):
    from tokenq.producer import Result
    from tokenq.producer.serve import tei_api
    from tokenq.producer.serve.errors import ApiError

    results = [Result(id=str(i), dim=8, embedding=None, scores=None, tokens=None,
                      sparse=((1, 0.5), (7, 2.0))) for i in range(3)]
    assert json.loads(encode(tei_api.sparse_answer(results, "m"))) == [
        [{"index": 1, "value": 0.5}, {"index": 7, "value": 2.0}]] * 3
    monkeypatch.setattr(tei_api, "MAX_TOKEN_ANSWER_FLOATS", 5)
    with pytest.raises(ApiError) as refused:
        tei_api.sparse_answer(results, "m")
    assert refused.value.status == 413 and "6 nonzero weights" in refused.value.message
