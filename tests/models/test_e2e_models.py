"""Real models end to end: producer -> real Redis -> real worker processes.

Every result that comes back through the queue is compared with the same
model run *directly*, one input at a time and without padding, by plain
transformers (or sentence-transformers, for the real MiniLM). That makes
"batching, padding, truncation, chunking and out-of-memory splits never
change a result" something these tests check rather than assume.

Worker start-up (importing torch, loading a model) costs a few seconds of
CPU, which dominates this file. So one module-scoped fleet starts, all at
once, every worker that the selected tests ask for (each test names its
worker as a fixture) and each test waits only for its own. Every worker has
a queue of its own, used by exactly one test.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.conftest import REPO_ROOT  # noqa: E402
from tests.plugins_for_tests import OOM_ABOVE_ENV  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.support import SimModel  # noqa: E402
from tests.tiny_bert import (  # noqa: E402
    CJK,
    WORDS,
    write_sentence_transformers_files,
    write_tiny_bert,
)
from tests.workers import WorkerProcess  # noqa: E402
from tokenq.producer import Client, Result  # noqa: E402
from tokenq.shared import keys, wire  # noqa: E402
from tokenq.shared.errors import RemoteError  # noqa: E402
from tokenq.worker.backends.chunks import combine_chunks  # noqa: E402
from tokenq.worker.backends.sim import expected_vector  # noqa: E402

LIMIT = 32
"""The tiny embedding model's max input: ``max_seq_length`` in sentence_bert_config.json."""
TINY_POSITIONS = 64
"""The tiny models' position table; the classify/rerank models take this many tokens."""
CHUNK_OVERLAP = 4
TIMEOUT_S = 60.0
"""Reply wait; generous because several workers share two CPUs while they start."""
ATOL = 1e-5

# ---------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The tiny models on disk, written once for the module (seeded, so reproducible)."""
    root = tmp_path_factory.mktemp("models")
    embed = write_sentence_transformers_files(
        write_tiny_bert(root / "embed", max_position_embeddings=TINY_POSITIONS, seed=11),
        pooling="mean",
        normalize=True,
        max_seq_length=LIMIT,
    )
    no_tokenizer = root / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(embed / name, no_tokenizer / name)
    return SimpleNamespace(
        root=root,
        embed=embed,
        no_tokenizer=no_tokenizer,
        classify=write_tiny_bert(root / "classify", head="classify", num_labels=3, seed=12),
        rerank=write_tiny_bert(root / "rerank", head="classify", num_labels=1, seed=13),
    )


class Reference:
    """A model as plain transformers runs it: one input, no padding, no tokenq code.

    For embeddings it applies what the sentence-transformers files of the
    tiny model say (mean pooling, then L2 normalisation); with a single
    unpadded input, mean pooling is just the mean over all token states.
    """

    def __init__(self, path: Path, task: str) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

        self.task = task
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        model_class = AutoModel if task == "embed" else AutoModelForSequenceClassification
        self.model = model_class.from_pretrained(str(path)).eval()

    def ids(self, text: str, pair: str | None = None, max_length: int | None = None) -> Any:
        """Token ids (and type ids) of one input, truncated like tokenq's ``truncate``."""
        return self.tokenizer(
            text, pair, truncation=max_length is not None, max_length=max_length, verbose=False
        )

    def forward(self, ids: Sequence[int], type_ids: Sequence[int] | None = None) -> np.ndarray:
        """One unpadded forward of a token sequence."""
        tensor = torch.tensor([list(ids)])
        kwargs = {"input_ids": tensor, "attention_mask": torch.ones_like(tensor)}
        if type_ids is not None:
            kwargs["token_type_ids"] = torch.tensor([list(type_ids)])
        with torch.inference_mode():
            output = self.model(**kwargs)
        if self.task != "embed":
            return output.logits[0].float().numpy()
        vector = output.last_hidden_state[0].float().mean(dim=0)
        return (vector / vector.norm()).numpy()

    def __call__(self, text: str, pair: str | None = None, max_length: int | None = None):
        encoded = self.ids(text, pair, max_length)
        return self.forward(encoded["input_ids"], encoded.get("token_type_ids") if pair else None)


@pytest.fixture(scope="module")
def embed_ref(models: SimpleNamespace) -> Reference:
    return Reference(models.embed, "embed")


def tiny_texts(rng: random.Random, count: int, low: int, high: int) -> list[str]:
    """Texts of ``low..high`` content tokens that the tiny vocabulary spells without [UNK].

    Mostly one-token pieces (whole words, CJK characters, digits,
    punctuation), with some made-up words of letters that no whole word is
    made of, so they split into exactly one word piece per letter. So the
    length is known, it varies, and batches really have padding.
    """
    singles = [*WORDS, *CJK, *"0123456789", *".,!?"]
    texts = []
    for _ in range(count):
        target, pieces, used = rng.randint(low, high), [], 0
        while used < target:
            if rng.random() < 0.15 and target - used >= 2:
                size = rng.randint(2, min(5, target - used))
                pieces.append("".join(rng.choice("jvxyz") for _ in range(size)))
                used += size
            else:
                pieces.append(rng.choice(singles))
                used += 1
        texts.append(" ".join(pieces))
    return texts


def vector(result: Result) -> np.ndarray:
    assert result.embedding is not None, result
    return np.frombuffer(result.embedding, dtype=np.float32)


# ----------------------------------------------------------------------------- fleet

SIM_DIM = 32
SIM_MAX_INPUT = 256
SIM_CAPACITY_TOKENS = 200
"""The sim device holds 200 padded tokens: below the 256-token max input, on purpose."""
SIM_BUDGET = 4096
HF_OOM_ABOVE = 160
HF_OOM_BUDGET = 4096


@dataclass(frozen=True)
class Spec:
    """One worker the fleet can start: its flags (given the models) and extra environment."""

    flags: Callable[[SimpleNamespace], tuple[str, ...]]
    env: tuple[tuple[str, str], ...] = ()


def _hf(path_of: str, *extra: str) -> Callable[[SimpleNamespace], tuple[str, ...]]:
    return lambda m: ("--backend", "hf", "--model", str(getattr(m, path_of)), *extra)


SPECS: dict[str, Spec] = {
    # ``auto`` on a CPU is the default budget (16,384 here): one worker serves both tests.
    "embed_worker": Spec(_hf("embed", "--max-batch-tokens", "auto")),
    "reject_worker": Spec(_hf("embed", "--policy", "reject")),
    "chunk_worker": Spec(_hf("embed", "--policy", "chunk", "--chunk-overlap", str(CHUNK_OVERLAP))),
    "classify_worker": Spec(_hf("classify", "--task", "classify")),
    "rerank_worker": Spec(_hf("rerank", "--task", "rerank")),
    "sim_oom_worker": Spec(lambda m: (
        *SimModel(SIM_DIM, SIM_MAX_INPUT).flags(),
        "--sim-bytes-per-token", "4096",
        "--sim-capacity-bytes", str(SIM_CAPACITY_TOKENS * 4096),
        "--max-batch-tokens", str(SIM_BUDGET), "--heartbeat-s", "0.2",
    )),
    "hf_oom_worker": Spec(
        lambda m: (
            "--backend", "tests.plugins_for_tests:hf_oom_above", "--model", str(m.embed),
            "--max-batch-tokens", str(HF_OOM_BUDGET), "--heartbeat-s", "0.2",
        ),
        env=((OOM_ABOVE_ENV, str(HF_OOM_ABOVE)),),
    ),
    "minilm_worker": Spec(lambda m: ("--backend", "hf")),
}
"""Fixture name -> worker. A test asks for a worker by taking the fixture of its name."""


@dataclass
class Served:
    """A started worker, the queue it alone serves, and a way to reach both."""

    worker: WorkerProcess
    queue: str
    redis_url: str

    def client(self) -> Client:
        return Client(redis_url=self.redis_url, queue=self.queue, timeout_s=TIMEOUT_S)

    @property
    def q(self) -> keys.QueueRef:
        return keys.QueueRef(self.queue)


def worker_environment(redis_url: str) -> dict[str, str]:
    """A worker subprocess's environment: offline hub, unbuffered, ``tests`` importable.

    One torch thread per worker: a dozen processes share the test machine's
    CPUs, and the tiny models gain nothing from intra-op threads.
    """
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env.update(
        TOKENQ_REDIS_URL=redis_url,
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO_ROOT) + (os.pathsep + path if path else ""),
    )
    return env


class Fleet:
    """Workers started together, handed out one per test (see the module docstring)."""

    def __init__(self, redis_url: str, client: redis.Redis, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.client = client
        self.log_dir = log_dir
        self.served: dict[str, Served] = {}

    def start(self, name: str, spec: Spec, models: SimpleNamespace) -> None:
        queue = f"m{uuid.uuid4().hex[:12]}"
        env = worker_environment(self.redis_url)
        env.update(spec.env)
        flags = ("--queue", queue, *spec.flags(models))
        worker = WorkerProcess(env, self.log_dir, *flags, name=name)
        self.served[name] = Served(worker, queue, self.redis_url)

    def ready(self, name: str) -> Served:
        served = self.served[name]
        served.worker.wait_ready(self.client, served.queue, timeout=120)
        return served

    def stop(self) -> None:
        """Kill every worker.

        These tests check no shutdown behaviour (test_e2e_core does), and a
        graceful stop of a dozen torch processes costs seconds of CPU.
        """
        for served in self.served.values():
            served.worker.close()


@pytest.fixture(scope="module")
def fleet(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    models: SimpleNamespace,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    """Start every worker the selected tests of this module use, all at once."""
    selected = [item for item in request.session.items if item.module is request.module]
    wanted = [name for name in SPECS if any(name in item.fixturenames for item in selected)]
    client = redis.Redis.from_url(redis_server.url)
    pool = Fleet(redis_server.url, client, tmp_path_factory.mktemp("workers"))
    try:
        for name in wanted:
            pool.start(name, SPECS[name], models)
        yield pool
    finally:
        pool.stop()
        client.close()


def _served_fixture(name: str) -> Any:
    @pytest.fixture(name=name)
    def served(fleet: Fleet) -> Served:
        return fleet.ready(name)

    return served


embed_worker = _served_fixture("embed_worker")
reject_worker = _served_fixture("reject_worker")
chunk_worker = _served_fixture("chunk_worker")
classify_worker = _served_fixture("classify_worker")
rerank_worker = _served_fixture("rerank_worker")
sim_oom_worker = _served_fixture("sim_oom_worker")
hf_oom_worker = _served_fixture("hf_oom_worker")
minilm_worker = _served_fixture("minilm_worker")


def heartbeat(r: redis.Redis, served: Served) -> dict[str, Any]:
    """The worker's latest heartbeat from ``tokenq:{q}:workers``."""
    raw = r.hget(keys.workers(served.q), served.worker.name)
    assert raw is not None, served.worker.output()
    return msgpack.unpackb(raw, raw=False)


def send_raw(
    r: redis.Redis, served: Served, inputs: Sequence[str | tuple[str, str]]
) -> list[wire.Reply]:
    """XADD requests as any producer may, and wait for every reply (in input order).

    The Python client refuses some inputs itself once it has read the
    queue's config (pairs on a single-text model, over-long input under
    ``reject``); a producer in another language may not, so the worker's own
    answer to such entries is checked with plain XADDs.
    """
    reply_to = keys.reply(served.q, f"raw-{uuid.uuid4().hex}")
    ids = []
    for index, item in enumerate(inputs):
        text, pair = item if isinstance(item, tuple) else (item, None)
        request_id = f"raw{index}"
        request = wire.Request(request_id, text, 0, reply_to, text_pair=pair)
        r.xadd(keys.requests(served.q), wire.encode_request(request))
        ids.append(request_id)
    replies: dict[str, wire.Reply] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(replies) < len(ids) and time.monotonic() < deadline:
        popped = r.blpop([reply_to], timeout=1)
        if popped is not None:
            reply = wire.decode_reply(popped[1])
            replies[reply.id] = reply
    assert len(replies) == len(ids), f"{len(replies)}/{len(ids)} replies:\n{served.worker.output()}"
    return [replies[request_id] for request_id in ids]


# ------------------------------------------------------------------------ embeddings


def test_embeddings_through_the_queue_equal_single_forwards(
    embed_worker: Served, embed_ref: Reference, r: redis.Redis
) -> None:
    """Mixed lengths in padded batches; over-long input truncated (the default policy)."""
    rng = random.Random(1)
    fitting = tiny_texts(rng, 60, 1, LIMIT - 2)
    lengths = [len(embed_ref.ids(text)["input_ids"]) for text in fitting]
    assert max(lengths) <= LIMIT and len(set(lengths)) > 15, lengths
    over = tiny_texts(rng, 6, 40, 120)
    with embed_worker.client() as client:
        results = client.infer_many([*fitting, *over], timeout_s=TIMEOUT_S)
    for text, length, result in zip(fitting, lengths, results[: len(fitting)], strict=True):
        assert result.dim == 32 and result.tokens == length
        np.testing.assert_allclose(vector(result), embed_ref(text), atol=ATOL, err_msg=text)
    batches = embed_worker.worker.batches()
    padded = [b for b in batches if b["rows"] > 1 and b["padded_tokens"] > b["tokens"]]
    assert padded, f"no batch had padding, so nothing was tested: {batches}"

    for text, result in zip(over, results[len(fitting) :], strict=True):
        assert len(embed_ref.ids(text)["input_ids"]) > LIMIT
        assert result.tokens == LIMIT
        expected = embed_ref(text, max_length=LIMIT)
        np.testing.assert_allclose(vector(result), expected, atol=ATOL, err_msg=text)
    assert not any(b["failed"] for b in batches)

    pair, single = send_raw(r, embed_worker, [("query", "passage"), "hello world"])
    assert not pair.ok and pair.error is not None and pair.error.code == "bad_request"
    assert "text_pair" in pair.error.message
    assert single.ok and single.embedding is not None
    np.testing.assert_allclose(
        np.frombuffer(single.embedding, np.float32), embed_ref("hello world"), atol=ATOL
    )


def test_reject_policy_answers_too_long_with_the_limit(
    reject_worker: Served, embed_ref: Reference, r: redis.Redis
) -> None:
    rng = random.Random(3)
    long_texts, short_texts = tiny_texts(rng, 3, 40, 80), tiny_texts(rng, 3, 2, 12)
    replies = send_raw(r, reject_worker, [*long_texts, *short_texts])
    for text, reply in zip(long_texts, replies[:3], strict=True):
        assert len(embed_ref.ids(text)["input_ids"]) > LIMIT
        assert not reply.ok and reply.error is not None, reply
        assert reply.error.code == "too_long"
        assert f"more than {LIMIT} tokens, the model's limit" in reply.error.message
    for text, reply in zip(short_texts, replies[3:], strict=True):
        assert reply.ok and reply.embedding is not None, reply
        np.testing.assert_allclose(
            np.frombuffer(reply.embedding, np.float32), embed_ref(text), atol=ATOL
        )


def chunk_windows(ids: Sequence[int], limit: int, overlap: int) -> list[list[int]]:
    """The chunk policy's windows, written out here rather than borrowed from tokenq.

    ``[CLS] content [SEP]`` becomes ``[CLS] content[s:s+w] [SEP]`` for
    ``w = limit - 2`` and ``s = 0, w - overlap, 2 (w - overlap), ...`` until the
    content is covered.
    """
    first, content, last = ids[0], list(ids[1:-1]), ids[-1]
    width = limit - 2
    windows, start = [], 0
    while True:
        windows.append([first, *content[start : start + width], last])
        if start + width >= len(content):
            return windows
        start += width - overlap


def test_chunk_policy_combines_window_forwards(
    chunk_worker: Served, embed_ref: Reference
) -> None:
    rng = random.Random(4)
    huge = " ".join(rng.choice(WORDS) for _ in range(50 * LIMIT))
    texts = [*tiny_texts(rng, 2, 3, 12), *tiny_texts(rng, 3, 35, 90), huge]
    with chunk_worker.client() as client:
        results = client.infer_many(texts, timeout_s=TIMEOUT_S)
    for text, result in zip(texts, results, strict=True):
        ids = embed_ref.ids(text)["input_ids"]
        windows = chunk_windows(ids, LIMIT, CHUNK_OVERLAP) if len(ids) > LIMIT else [ids]
        vectors = [embed_ref.forward(window) for window in windows]
        expected = combine_chunks(vectors, [len(w) for w in windows], normalize=True)
        np.testing.assert_allclose(vector(result), expected, atol=ATOL, err_msg=text[:80])
        assert result.tokens == sum(len(w) for w in windows)
    assert len(embed_ref.ids(huge)["input_ids"]) >= 50 * LIMIT
    assert not any(b["failed"] for b in chunk_worker.worker.batches())


# ------------------------------------------------------------------- classify / rerank


def test_classification_scores_equal_single_forwards(
    classify_worker: Served, models: SimpleNamespace
) -> None:
    """Replies carry the softmax of a single forward's logits, with the labels;
    ``raw_scores`` gives the logits themselves."""
    from transformers import AutoConfig

    labels = AutoConfig.from_pretrained(models.classify).id2label
    reference = Reference(models.classify, "classify")
    rng = random.Random(5)
    texts = tiny_texts(rng, 30, 1, 40)
    with classify_worker.client() as client:
        results = client.infer_many(texts, timeout_s=TIMEOUT_S)
        raw = client.infer_many(texts, timeout_s=TIMEOUT_S, raw_scores=True)
    for text, result, logits in zip(texts, results, raw, strict=True):
        assert result.embedding is None and len(result.scores) == 3
        expected = reference(text, max_length=TINY_POSITIONS)
        np.testing.assert_allclose(logits.scores, expected, atol=ATOL, err_msg=text)
        softmax = np.exp(expected - np.max(expected))
        np.testing.assert_allclose(result.scores, softmax / softmax.sum(), atol=ATOL)
        assert result.labels == tuple(labels[i] for i in range(3)) == logits.labels
    batches = classify_worker.worker.batches()
    assert any(b["padded_tokens"] > b["tokens"] for b in batches), batches


def test_a_classifier_publishes_its_labels_and_the_gateway_shows_them(
    classify_worker: Served, models: SimpleNamespace
) -> None:
    import json

    from transformers import AutoConfig

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tokenq.producer.serve.app import create_app
    from tokenq.shared.settings import ServeSettings

    id2label = AutoConfig.from_pretrained(models.classify).id2label
    expected = [id2label[i] for i in range(3)]
    with classify_worker.client() as client:
        assert json.loads(client.config()["labels"]) == expected
    app = create_app(ServeSettings(redis_url=classify_worker.redis_url,
                                   queue=classify_worker.queue))
    with TestClient(app) as http:
        info = http.get("/info").json()
    assert info["model_type"] == {"classifier": {
        "id2label": {str(i): label for i, label in enumerate(expected)},
        "label2id": {label: i for i, label in enumerate(expected)},
    }}


def test_rerank_scores_equal_single_forwards(
    rerank_worker: Served, models: SimpleNamespace
) -> None:
    reference = Reference(models.rerank, "rerank")
    rng = random.Random(6)
    queries, passages = tiny_texts(rng, 20, 1, 5), tiny_texts(rng, 20, 5, 40)
    pairs = list(zip(queries, passages, strict=True))
    with rerank_worker.client() as client:
        batched = client.infer_many(pairs, timeout_s=TIMEOUT_S)
        one = client.infer(queries[0], text_pair=passages[0], timeout_s=TIMEOUT_S)
        unpaired = client.infer_many(
            ["a query without its passage", pairs[1]], timeout_s=TIMEOUT_S, return_exceptions=True
        )
        raw = client.infer_many(pairs, timeout_s=TIMEOUT_S, raw_scores=True)
    for (query, passage), result, logit in zip(pairs, batched, raw, strict=True):
        assert len(result.scores) == 1
        expected = reference(query, passage, max_length=TINY_POSITIONS)
        np.testing.assert_allclose(logit.scores, expected, atol=ATOL, err_msg=query)
        # a single-logit cross-encoder's score is its sigmoid, as CrossEncoder.predict gives
        np.testing.assert_allclose(result.scores, 1 / (1 + np.exp(-expected)), atol=ATOL)
    np.testing.assert_allclose(one.scores, batched[0].scores, atol=ATOL)
    assert isinstance(unpaired[0], RemoteError) and unpaired[0].code == "bad_request"
    assert "text_pair" in unpaired[0].message
    np.testing.assert_allclose(unpaired[1].scores, batched[1].scores, atol=ATOL)


# --------------------------------------------------------------------- out of memory


def sim_words(rng: random.Random, n: int) -> str:
    """n words: n + 2 sim tokens."""
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "token"]) for _ in range(n))


def test_sim_out_of_memory_is_split_lowered_and_recovered(
    sim_oom_worker: Served, r: redis.Redis
) -> None:
    rng = random.Random(7)
    # Each of these fits the device alone; together they are ~40 x its capacity.
    texts = [sim_words(rng, rng.randint(5, SIM_CAPACITY_TOKENS - 10)) for _ in range(80)]
    alone_too_big = sim_words(rng, SIM_MAX_INPUT - 16)  # within max input, over capacity
    with sim_oom_worker.client() as client:
        first = client.infer_many(
            [*texts, alone_too_big], timeout_s=TIMEOUT_S, return_exceptions=True
        )
        # Small requests one by one: each a clean batch of its own, so the
        # budget climbs back (5% after every 20 clean batches).
        second = [client.infer(f"small {i}", timeout_s=TIMEOUT_S) for i in range(45)]
    for text, result in zip(texts, first[:-1], strict=True):
        assert isinstance(result, Result), result
        np.testing.assert_allclose(
            vector(result), expected_vector(text, SIM_DIM, SIM_MAX_INPUT), atol=1e-6
        )
    assert isinstance(first[-1], RemoteError) and first[-1].code == "out_of_memory"
    for i, result in enumerate(second):
        np.testing.assert_allclose(
            vector(result), expected_vector(f"small {i}", SIM_DIM, SIM_MAX_INPUT), atol=1e-6
        )

    batches = sim_oom_worker.worker.batches()
    budgets = [b["max_batch_tokens"] for b in batches]
    lowest = budgets.index(min(budgets))
    assert budgets[0] == SIM_BUDGET and any(b["oom_splits"] for b in batches), batches
    assert min(budgets) < SIM_BUDGET, budgets
    assert max(budgets[lowest:]) > min(budgets), f"budget never raised again: {budgets}"
    assert sum(b["failed"] for b in batches) == 1  # only the one that alone does not fit
    assert heartbeat(r, sim_oom_worker)["configured_batch_tokens"] == SIM_BUDGET


def test_hf_out_of_memory_splits_and_lowers_the_budget(
    hf_oom_worker: Served, embed_ref: Reference, r: redis.Redis
) -> None:
    texts = tiny_texts(random.Random(8), 60, 1, LIMIT - 2)
    with hf_oom_worker.client() as client:
        results = client.infer_many(texts, timeout_s=TIMEOUT_S)
    for text, result in zip(texts, results, strict=True):
        np.testing.assert_allclose(vector(result), embed_ref(text), atol=ATOL, err_msg=text)
    batches = hf_oom_worker.worker.batches()
    assert any(b["oom_splits"] for b in batches), batches
    assert not any(b["failed"] for b in batches)
    deadline = time.monotonic() + 10
    while heartbeat(r, hf_oom_worker)["max_batch_tokens"] >= HF_OOM_BUDGET:
        assert time.monotonic() < deadline, "the heartbeat never showed a lowered budget"
        time.sleep(0.1)
    assert "budget lowered from 4096" in hf_oom_worker.worker.output()


# ------------------------------------------------------------------------- start-up


_START_UPS_CHILD = """
import contextlib, io, json, sys
from tokenq.worker.cli import main

answers = {}
for name, argv in json.loads(sys.argv[1]).items():
    with contextlib.redirect_stderr(io.StringIO()) as err:
        answers[name] = [main(argv), err.getvalue()]
print(json.dumps(answers))
"""
"""Runs ``tokenq worker``'s main on each case's flags in turn: one process importing torch
rather than one a case (each case fails before its worker connects or starts a thread)."""


def test_bad_start_up_settings_are_clear_errors(
    models: SimpleNamespace, redis_server: RedisServer, tmp_path: Path
) -> None:
    missing = tmp_path / "no" / "such-model"
    cases = {
        "missing": ("--model", str(missing)),
        "no_tokenizer": ("--model", str(models.no_tokenizer)),
        "budget": ("--model", str(models.embed), "--max-batch-tokens", "16"),
        "chunk_classify": (
            "--model", str(models.classify), "--task", "classify", "--policy", "chunk"
        ),
    }
    argv = {name: ["--backend", "hf", "--queue", "bad", *flags] for name, flags in cases.items()}
    done = subprocess.run(
        [sys.executable, "-c", _START_UPS_CHILD, json.dumps(argv)],
        env=worker_environment(redis_server.url), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (code, err) in answers.items():
        assert code == 2, (name, err)
        assert "Traceback" not in err, (name, err)
    stderr = {name: err for name, (_, err) in answers.items()}
    assert str(missing) in stderr["missing"] and "does not exist" in stderr["missing"]
    assert str(models.no_tokenizer) in stderr["no_tokenizer"]
    assert "no tokenizer" in stderr["no_tokenizer"]
    assert "max_batch_tokens (16)" in stderr["budget"]
    assert f"maximum input length ({LIMIT} tokens)" in stderr["budget"]
    assert "policy 'chunk'" in stderr["chunk_classify"]
    assert "embedding" in stderr["chunk_classify"]


def test_auto_budget_on_cpu_says_what_and_why(
    embed_worker: Served, r: redis.Redis, embed_ref: Reference
) -> None:
    auto_worker = embed_worker  # started with --max-batch-tokens auto
    with auto_worker.client() as client:
        result = client.infer("hello world", timeout_s=TIMEOUT_S)
        config = client.config()
    np.testing.assert_allclose(vector(result), embed_ref("hello world"), atol=ATOL)
    output = auto_worker.worker.output()
    found = re.search(r"budget=(\d+) tokens \(padded; auto: (cpu: .*?)\) rows<=", output)
    assert found, output
    chosen, reason = int(found[1]), found[2]
    assert chosen == max(8 * LIMIT, 16384) == int(config["max_batch_tokens"])
    assert "no device memory to probe" in reason and f"max_input_tokens {LIMIT}" in reason
    assert heartbeat(r, auto_worker)["max_batch_tokens"] == chosen


# --------------------------------------------------------------------------- MiniLM


def sample_texts() -> list[str]:
    """~30 English and Chinese texts of scripts/data/sample.jsonl, short to over 256 tokens."""
    rows = [json.loads(line) for line in (REPO_ROOT / "scripts/data/sample.jsonl").open()]
    by_length = sorted(rows, key=lambda row: len(row["text"]))
    chosen = []
    for lang in ("en", "zh"):
        of_lang = [row["text"] for row in by_length if row["lang"] == lang]
        step = max(1, len(of_lang) // 12)
        chosen += of_lang[::step][:12] + of_lang[-3:]  # spread over lengths, plus the longest
    return chosen


@pytest.mark.slow
def test_minilm_through_the_queue_matches_sentence_transformers(minilm_worker: Served) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from tokenq.worker.backends.hf.load import resolve_model

    texts = sample_texts()
    model = sentence_transformers.SentenceTransformer(resolve_model(None).location, device="cpu")
    expected = model.encode(texts)
    lengths = [len(ids) for ids in model.tokenizer(texts)["input_ids"]]
    assert 25 <= len(texts) <= 35 and sum(n > 256 for n in lengths) >= 4, lengths
    with minilm_worker.client() as client:
        results = client.infer_many(texts, timeout_s=120)
    got = np.stack([vector(result) for result in results])
    cosine = (got * expected).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert cosine.min() >= 0.9999, cosine
    assert [result.tokens for result in results] == [min(n, 256) for n in lengths]


# ------------------------------------------------------------------------ gpu check


def test_gpu_check_skips_cleanly_without_cuda() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts/gpu_check.sh")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no CUDA device; skipped" in done.stdout


# Minutes of real workers and models: CI runs them; `-m 'not slow'` skips them.
pytestmark = pytest.mark.slow
