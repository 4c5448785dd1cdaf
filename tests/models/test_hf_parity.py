"""The hf backend against the reference libraries, each running the very same files.

Every model here is tiny, random and built on disk (tests/tiny_bert.py,
tests/tiny_models.py); the sentence-transformers folders are written by
sentence-transformers itself. The backend returns raw rows (embeddings
before the final L2 normalisation, logits); :func:`finish` applies what
``info`` says a default reply gets, the rule the worker's pipeline applies,
and the result must equal the reference's: ``SentenceTransformer.encode``,
``CrossEncoder.predict``, the transformers ``text-classification`` pipeline,
or a direct ``AutoModel`` forward of each input alone.

Every test runs on both runtimes (``--runtime torch`` and ``onnx``, the
latter skipped without the ``onnx`` extra): the ONNX export must give the
same answers, family by family. Exports go to one folder per module run,
so each model is exported once and reused by the tests after it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.tiny_bert import (  # noqa: E402
    SAMPLE_PAIRS,
    SAMPLE_TEXTS,
    write_sentence_transformers_files,
    write_tiny_bert,
)
from tests.tiny_models import (  # noqa: E402
    write_cross_encoder,
    write_custom_code_bert,
    write_sentence_transformer,
    write_tiny_decoder,
)
from tokenq.shared.errors import ConfigError  # noqa: E402
from tokenq.worker.backends.base import BackendInfo, TextInput  # noqa: E402
from tokenq.worker.backends.hf.backend import HFBackend, HFOptions  # noqa: E402
from tokenq.worker.backends.hf.layout import POOLING_MODES  # noqa: E402
from tokenq.worker.backends.hf.load import bundled_model_dir  # noqa: E402
from tokenq.worker.pipeline.finisher import NO_OPTIONS, Finisher  # noqa: E402

TEXTS, PAIRS = SAMPLE_TEXTS, SAMPLE_PAIRS
PROMPTS = {"query": "query: ", "document": "passage: "}
MIN_COSINE = 0.9999
RUNTIME = "torch"
"""The runtime :func:`load` asks for; the autouse ``runtime`` fixture sets it per test."""
ONNX_CACHE: Path | None = None


@pytest.fixture(scope="module")
def onnx_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(autouse=True, params=["torch", "onnx"])
def runtime(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, onnx_cache: Path
) -> str:
    """Each test once per runtime."""
    if request.param == "onnx":
        pytest.importorskip("onnxruntime")
    monkeypatch.setattr(sys.modules[__name__], "RUNTIME", request.param)
    monkeypatch.setattr(sys.modules[__name__], "ONNX_CACHE", onnx_cache)
    return str(request.param)


def finish(info: BackendInfo, rows: Sequence[np.ndarray]) -> np.ndarray:
    """What a default reply carries, from a backend's raw rows: the worker's own rule
    (``Finisher``: normalisation when the model's default is unit length, the activation)."""
    return np.stack(Finisher(info).finish(list(rows), [NO_OPTIONS] * len(rows)))


def reference_library() -> Any:
    """sentence-transformers, imported by the tests that need it (``finish`` does not)."""
    return pytest.importorskip("sentence_transformers")


def load(path: Path | None, **options: Any) -> HFBackend:
    """The backend on the CPU, on this test's runtime (``path`` None: the bundled model)."""
    model = None if path is None else str(path)
    cache = str(ONNX_CACHE) if ONNX_CACHE else None
    backend = HFBackend.load(
        HFOptions(model=model, device="cpu", runtime=RUNTIME, onnx_cache_dir=cache, **options)
    )
    assert backend.info.extra["runtime"] == RUNTIME
    return backend


def answers(
    backend: HFBackend, inputs: Sequence[str | tuple[str, str]], prompt: str = ""
) -> np.ndarray:
    """Default replies for ``inputs``, tokenized and run as one mixed-length batch."""
    items = [
        TextInput(item, prompt=prompt) if isinstance(item, str) else TextInput(*item, prompt=prompt)
        for item in inputs
    ]
    encodings = backend.tokenize(items, backend.info.max_input_tokens)
    return finish(backend.info, backend.run(encodings))


def assert_same(got: np.ndarray, expected: np.ndarray, atol: float = 1e-5) -> None:
    """Row by row: cosine at least MIN_COSINE, and equal values (not merely parallel)."""
    expected = np.asarray(expected, dtype=np.float32)
    assert got.shape == expected.shape
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    cosine = (got * expected).sum(axis=1) / np.maximum(norms, 1e-12)
    assert cosine.min() >= MIN_COSINE, cosine
    np.testing.assert_allclose(got, expected, atol=atol)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def bert(root: Path) -> Path:
    return write_tiny_bert(root / "bert", seed=21)


@pytest.fixture(scope="module")
def st_folder(root: Path, bert: Path) -> Callable[..., Path]:
    """A sentence-transformers folder per set of options, each written once for the module."""
    reference_library()
    made: dict[str, Path] = {}

    def make(**options: Any) -> Path:
        key = repr(sorted(options.items()))
        if key not in made:
            made[key] = write_sentence_transformer(root / f"st{len(made)}", bert, **options)
        return made[key]

    return make


def st_encode(path: Path, texts: Sequence[str], **kwargs: Any) -> np.ndarray:
    model = reference_library().SentenceTransformer(str(path), device="cpu")
    kwargs.setdefault("batch_size", len(texts))
    return model.encode(list(texts), **kwargs)


# -- prompts --------------------------------------------------------------------


@pytest.mark.parametrize("include_prompt", [True, False])
def test_named_and_default_prompts_match_sentence_transformers(
    st_folder: Callable[..., Path], include_prompt: bool
) -> None:
    path = st_folder(
        pooling="mean", include_prompt=include_prompt, prompts=PROMPTS, default_prompt_name="query"
    )
    backend = load(path)
    info = backend.info
    assert dict(info.prompts) == PROMPTS and info.default_prompt_name == "query"
    assert info.normalized and info.raw_vectors
    for name in ("query", "document"):
        expected = st_encode(path, TEXTS, prompt_name=name)
        assert_same(answers(backend, TEXTS, info.prompts[name]), expected)
    default = info.prompts[info.default_prompt_name]
    assert_same(answers(backend, TEXTS, default), st_encode(path, TEXTS))
    assert_same(answers(backend, TEXTS, ""), st_encode(path, TEXTS, prompt=""))


def test_prompts_without_a_default(st_folder: Callable[..., Path]) -> None:
    path = st_folder(pooling="mean", include_prompt=False, prompts={"query": "query: "})
    backend = load(path)
    assert dict(backend.info.prompts) == {"query": "query: ", "document": ""}
    assert backend.info.default_prompt_name is None
    assert_same(answers(backend, TEXTS), st_encode(path, TEXTS))
    assert_same(answers(backend, TEXTS, "query: "), st_encode(path, TEXTS, prompt_name="query"))
    # an explicit prompt text, not one of the model's names
    assert_same(answers(backend, TEXTS, "cat dog "), st_encode(path, TEXTS, prompt="cat dog "))


def test_legacy_files_with_prompts_and_include_prompt(tmp_path: Path, bert: Path) -> None:
    import shutil

    path = tmp_path / "legacy-prompts"
    shutil.copytree(bert, path)
    write_sentence_transformers_files(
        path,
        pooling="cls",
        normalize=False,
        max_seq_length=None,
        include_prompt=False,
        prompts=PROMPTS,
        default_prompt_name="document",
    )
    backend = load(path)
    assert backend.info.default_prompt_name == "document" and not backend.info.normalized
    assert_same(answers(backend, TEXTS, "passage: "), st_encode(path, TEXTS))


# -- pooling --------------------------------------------------------------------

def mode_names(pooling: str | tuple[str, ...]) -> str:
    return pooling if isinstance(pooling, str) else "+".join(pooling)


POOLINGS = [*POOLING_MODES, ("lasttoken", "cls", "mean", "max")]


@pytest.mark.parametrize("include_prompt", [True, False], ids=["prompt-in", "prompt-out"])
@pytest.mark.parametrize("pooling", POOLINGS, ids=mode_names)
def test_each_pooling_mode_matches_sentence_transformers(
    st_folder: Callable[..., Path], pooling: str | tuple[str, ...], include_prompt: bool
) -> None:
    path = st_folder(pooling=pooling, include_prompt=include_prompt, normalize=False)
    backend = load(path)
    modes = (pooling,) if isinstance(pooling, str) else pooling
    assert backend.pooling == modes and backend.info.dim == 32 * len(modes)
    assert not backend.info.normalized
    assert_same(answers(backend, TEXTS, "query: "), st_encode(path, TEXTS, prompt="query: "))


def test_legacy_boolean_pooling_keys_concatenate_in_their_order(
    tmp_path: Path, bert: Path
) -> None:
    import shutil

    path = tmp_path / "legacy-modes"
    shutil.copytree(bert, path)
    write_sentence_transformers_files(
        path, pooling=("mean", "cls", "weightedmean"), normalize=True, max_seq_length=None
    )
    backend = load(path)
    assert backend.pooling == ("cls", "mean", "weightedmean")  # the legacy keys' fixed order
    assert_same(answers(backend, TEXTS), st_encode(path, TEXTS))


# -- Dense ----------------------------------------------------------------------


def test_dense_and_normalize_match_sentence_transformers(st_folder: Callable[..., Path]) -> None:
    path = st_folder(
        pooling="cls", dense=[{"out_features": 16, "activation_function": torch.nn.Tanh()}]
    )
    backend = load(path)
    assert (backend.info.dim, backend.info.normalized) == (16, True)
    assert backend.info.extra["dense"] == ["32->16"]
    assert_same(answers(backend, TEXTS), st_encode(path, TEXTS))


def test_dense_chain_with_residuals_from_pytorch_bin(root: Path, bert: Path) -> None:
    reference_library()
    path = write_sentence_transformer(
        root / "dense-chain",
        bert,
        pooling=("mean", "max"),
        dense=[
            {"out_features": 24, "activation_function": torch.nn.GELU(), "use_residual": True},
            {"out_features": 24, "activation_function": torch.nn.Identity(), "use_residual": True},
            {"out_features": 8, "activation_function": torch.nn.SiLU(), "bias": False},
        ],
        normalize=False,
        safe_serialization=False,
    )
    assert (path / "2_Dense" / "pytorch_model.bin").is_file()
    backend = load(path)
    assert backend.info.dim == 8 and backend.info.extra["dense"] == ["64->24", "24->24", "24->8"]
    assert_same(answers(backend, TEXTS), st_encode(path, TEXTS))


# -- decoders -------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def decoder(request: pytest.FixtureRequest, root: Path) -> SimpleNamespace:
    from transformers import AutoModel, AutoTokenizer

    path = write_tiny_decoder(root / request.param, arch=request.param, seed=5)
    write_sentence_transformers_files(
        path, pooling="lasttoken", normalize=True, max_seq_length=None
    )
    return SimpleNamespace(
        path=path,
        model=AutoModel.from_pretrained(str(path)).eval(),
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
    )


def last_states_alone(decoder: SimpleNamespace, texts: Sequence[str]) -> np.ndarray:
    """Each text through ``AutoModel`` alone (no padding at all): its last state, unit length."""
    rows = []
    for text in texts:
        with torch.inference_mode():
            batch = decoder.tokenizer(text, return_tensors="pt")
            last = decoder.model(**batch).last_hidden_state[0, -1]
        rows.append((last / last.norm()).numpy())
    return np.stack(rows)


def test_decoder_embedder_matches_each_text_run_alone(decoder: SimpleNamespace) -> None:
    backend = load(decoder.path)
    assert backend.pooling == ("lasttoken",) and backend.info.normalized
    eos = decoder.tokenizer.eos_token_id
    encodings = backend.tokenize([TextInput(t) for t in TEXTS], backend.info.max_input_tokens)
    assert len({e.length for e in encodings}) > 3  # a really mixed-length batch
    assert all(e.ids[-1] == eos for e in encodings)  # the tokenizer's own template adds EOS
    got = finish(backend.info, backend.run(encodings))
    assert_same(got, last_states_alone(decoder, TEXTS))
    prompted = answers(backend, TEXTS, "query: ")
    assert_same(prompted, last_states_alone(decoder, ["query: " + t for t in TEXTS]))
    if decoder.tokenizer.pad_token_id is not None:  # sentence-transformers cannot pad without
        assert_same(got, st_encode(decoder.path, TEXTS))
        assert_same(prompted, st_encode(decoder.path, TEXTS, prompt="query: "))


def test_decoder_pads_with_its_pad_token_else_eos(decoder: SimpleNamespace) -> None:
    backend = load(decoder.path)
    tok = decoder.tokenizer
    expected = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    assert backend._pad_id == expected is not None


# -- scoring models -------------------------------------------------------------

CLASSIFIERS = {
    "softmax": ({"num_labels": 3, "id2label": {0: "neg", 1: "neutral", 2: "pos"}}, "softmax"),
    "multi-label": (
        {"num_labels": 3, "problem_type": "multi_label_classification"},
        "sigmoid",
    ),
    "one-logit": ({"num_labels": 1}, "sigmoid"),
    "regression": ({"num_labels": 1, "problem_type": "regression"}, "none"),
}


@pytest.mark.parametrize("kind", list(CLASSIFIERS))
def test_classifier_matches_the_text_classification_pipeline(root: Path, kind: str) -> None:
    from transformers import pipeline

    config, activation = CLASSIFIERS[kind]
    path = write_tiny_bert(root / f"classify-{kind}", head="classify", seed=31, **config)
    backend = load(path, task="classify")
    assert backend.info.activation == activation == backend.info.extra["activation"]
    reference = pipeline("text-classification", model=str(path), top_k=None, device="cpu")
    got = answers(backend, TEXTS)
    for text, row, scores in zip(TEXTS, got, reference(TEXTS), strict=True):
        by_label = {entry["label"]: entry["score"] for entry in scores}
        assert set(by_label) == set(backend.info.labels), text
        np.testing.assert_allclose(row, [by_label[name] for name in backend.info.labels], atol=1e-5)
    if kind == "softmax":
        assert backend.info.labels == ("neg", "neutral", "pos")


CROSS_ENCODERS = {
    "one-logit": ({}, {}, "sigmoid"),
    "identity": ({}, {"activation_fn": torch.nn.Identity()}, "none"),
    "three-logits": ({"num_labels": 3}, {}, "none"),
    "softmax": ({"num_labels": 3}, {"activation_fn": torch.nn.Softmax(dim=-1)}, "softmax"),
}


@pytest.mark.filterwarnings("ignore:Implicit dimension choice for softmax")  # CrossEncoder's
@pytest.mark.parametrize("kind", list(CROSS_ENCODERS))
def test_reranker_matches_cross_encoder_predict(root: Path, kind: str) -> None:
    reference_library()
    head, saved, activation = CROSS_ENCODERS[kind]
    head = {"num_labels": 1, **head}
    base = write_tiny_bert(root / f"ce-base-{kind}", head="classify", seed=41, **head)
    path = write_cross_encoder(root / f"ce-{kind}", base, **saved)
    backend = load(path, task="rerank")
    assert backend.info.activation == activation and backend.info.pairs
    expected = reference_library().CrossEncoder(str(path), device="cpu").predict(PAIRS)
    got = answers(backend, PAIRS)
    assert_same(got, np.asarray(expected).reshape(got.shape))


@pytest.mark.parametrize(
    ("saved", "activation"),
    [
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, "none"),
        ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, "none"),
        ({"sbert_ce_default_activation_function": "torch.nn.Sigmoid"}, "sigmoid"),
    ],
    ids=["releases-4-5", "legacy-identity", "legacy-sigmoid"],
)
def test_reranker_activation_in_config_json(
    tmp_path: Path, saved: dict[str, Any], activation: str
) -> None:
    import json

    path = write_tiny_bert(tmp_path / "ce", head="classify", num_labels=1, seed=43)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **saved}))
    backend = load(path, task="rerank")
    assert backend.info.activation == activation
    expected = reference_library().CrossEncoder(str(path), device="cpu").predict(PAIRS)
    assert_same(answers(backend, PAIRS), np.asarray(expected).reshape(-1, 1))


def test_reranker_with_an_activation_tokenq_cannot_apply_is_refused(tmp_path: Path) -> None:
    import json

    path = write_tiny_bert(tmp_path / "ce-tanh", head="classify", num_labels=1, seed=44)
    config = json.loads((path / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Tanh"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"activation_fn 'torch\.nn\.modules\.activation\.Tanh'"):
        load(path, task="rerank")


# -- code the model ships --------------------------------------------------------


def test_remote_code_runs_only_with_trust_remote_code(tmp_path: Path, bert: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    path = write_custom_code_bert(tmp_path / "custom", bert)
    with pytest.raises(ConfigError, match=r"auto_map.*--trust-remote-code"):
        load(path)
    backend = load(path, trust_remote_code=True)
    assert backend.info.extra["trust_remote_code"] is True
    model = AutoModel.from_pretrained(str(path), trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    expected = []
    for text in TEXTS:
        with torch.inference_mode():
            states = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        expected.append(states.mean(dim=0))
    plain = answers(load(bert), TEXTS)
    got = answers(backend, TEXTS)
    assert_same(got, torch.stack(expected).numpy())
    assert not np.allclose(got, plain, atol=1e-2)  # the model's own code really ran


# -- the real model -------------------------------------------------------------


def test_minilm_with_a_prompt_matches_sentence_transformers() -> None:
    path = bundled_model_dir()
    backend = load(None)
    assert backend.info.normalized and backend.info.raw_vectors
    texts = [*TEXTS, "What is the capital of France?", "Paris is the capital of France."]
    expected = st_encode(path, texts, prompt="query: ")
    assert_same(answers(backend, texts, "query: "), expected)


# -- through the worker's pipeline -------------------------------------------------


def test_the_in_process_batcher_answers_what_sentence_transformers_encodes(
    st_folder: Callable[..., Path],
) -> None:
    """Request options end to end through the pipeline (prompt resolution, the Finisher):
    named and default prompts, ``dimensions`` (the first values, re-normalised) and
    ``normalize: false`` (sentence-transformers without its Normalize module)."""
    import asyncio

    from tokenq.worker.local import Batcher

    path = st_folder(pooling="mean", prompts=PROMPTS, default_prompt_name="query")
    texts = [text for text in TEXTS if text.strip()]  # a queue refuses an empty text

    async def main() -> dict[str, np.ndarray]:
        backend = load(path)
        async with Batcher(backend, max_batch_tokens=512, max_batch_size=64, linger_ms=1) as b:
            return {
                "default": np.stack(await b.submit_many(texts)),
                "document": np.stack(await b.submit_many(texts, prompt_name="document")),
                "short": np.stack(await b.submit_many(texts, dimensions=8)),
                "raw": np.stack(await b.submit_many(texts, normalize=False, prompt="")),
            }

    got = asyncio.run(main())
    query = st_encode(path, texts, prompt_name="query")
    assert_same(got["default"], query)
    assert_same(got["document"], st_encode(path, texts, prompt_name="document"))
    truncated = query[:, :8] / np.linalg.norm(query[:, :8], axis=1, keepdims=True)
    assert_same(got["short"], truncated)
    unnormalized = reference_library().SentenceTransformer(str(path), device="cpu")
    del unnormalized[len(unnormalized) - 1]  # its Normalize module
    raw = unnormalized.encode(list(texts), prompt="", batch_size=len(texts))
    assert_same(got["raw"], raw)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
