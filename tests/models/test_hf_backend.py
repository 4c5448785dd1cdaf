"""The Hugging Face backend on tiny random BERTs built on disk (CPU, no hub).

Each property is checked against the model run directly on one unpadded
input, so "padding never changes a result" is tested, not assumed. The one
slow test compares the bundled all-MiniLM-L6-v2 with sentence-transformers;
tests/models/test_hf_parity.py checks every supported layout against the reference
libraries. Rows are raw (embeddings before the final L2 normalisation,
logits): ``info.normalized`` and ``info.activation`` say what a default
reply gets, and :func:`tests.models.test_hf_parity.finish` applies it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.models.test_hf_parity import finish  # noqa: E402
from tests.tiny_bert import (  # noqa: E402
    SAMPLE_PAIRS,
    SAMPLE_TEXTS,
    write_sentence_transformers_files,
    write_tiny_bert,
)
from tokenq.shared.errors import BadRequest, ConfigError, DeviceOutOfMemory  # noqa: E402
from tokenq.worker.backends.base import Backend, TextInput  # noqa: E402
from tokenq.worker.backends.calibrate import (  # noqa: E402
    CPU_DEFAULT_TOKENS,
    calibrate_budget,
    plan_budget,
    probe_budget,
)
from tokenq.worker.backends.chunks import combine_chunks, sliding_windows  # noqa: E402
from tokenq.worker.backends.hf.backend import HFBackend, HFOptions, build_hf_backend  # noqa: E402
from tokenq.worker.backends.hf.encoding import HFEncoding, prompt_lengths  # noqa: E402
from tokenq.worker.backends.hf.load import resolve_model  # noqa: E402

TEXTS, PAIRS = SAMPLE_TEXTS, SAMPLE_PAIRS


def texts(values: list[str]) -> list[TextInput]:
    return [TextInput(v) for v in values]


def load(path: Path, **options: object) -> HFBackend:
    return HFBackend.load(HFOptions(model=str(path), device="cpu", **options))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One tiny model per task, written once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    plain = write_tiny_bert(root / "plain")
    st = write_sentence_transformers_files(
        write_tiny_bert(root / "st", seed=1), pooling="cls", normalize=True, max_seq_length=24
    )
    return SimpleNamespace(
        root=root,
        plain=plain,
        st=st,
        classify=write_tiny_bert(root / "classify", head="classify", num_labels=3, seed=2),
        rerank=write_tiny_bert(root / "rerank", head="classify", num_labels=1, seed=3),
    )


@pytest.fixture(scope="module")
def embed(dirs: SimpleNamespace) -> HFBackend:
    return load(dirs.plain)


@pytest.fixture(scope="module")
def reference(dirs: SimpleNamespace) -> object:
    """The plain model as transformers loads it, for one-input-at-a-time forwards."""
    from transformers import AutoModel, AutoTokenizer

    return SimpleNamespace(
        model=AutoModel.from_pretrained(str(dirs.plain)).eval(),
        tokenizer=AutoTokenizer.from_pretrained(str(dirs.plain)),
    )


def hidden_states(ref: SimpleNamespace, text: str) -> torch.Tensor:
    """Token states of one unpadded input: no padding can reach them."""
    batch = ref.tokenizer(text, return_tensors="pt")
    with torch.inference_mode():
        return ref.model(**batch).last_hidden_state[0]


# -- embeddings ---------------------------------------------------------------


def test_info_describes_the_model(embed: HFBackend, dirs: SimpleNamespace) -> None:
    info = embed.info
    assert isinstance(embed, Backend)
    assert (info.name, info.task, info.dim, info.max_input_tokens) == ("hf", "embed", 32, 64)
    assert (info.device, info.dtype, info.pairs, info.padded) == ("cpu", "float32", False, True)
    assert info.tokenizer == str(dirs.plain / "tokenizer.json")
    assert info.pooling == "mean" and info.extra["normalize"] is False
    assert (info.raw_vectors, info.normalized, info.activation) == (True, False, "none")
    # a SentenceTransformer's own defaults: empty query and document prompts, none chosen
    assert (dict(info.prompts), info.default_prompt_name) == ({"query": "", "document": ""}, None)


def test_the_weights_are_hashed_when_asked_not_at_load(embed: HFBackend, dirs) -> None:
    """The result cache asks (``--cache-bytes``); a worker without one never reads them."""
    from tokenq.worker.backends.base import weights_identity_of
    from tokenq.worker.backends.hf.load import ModelSource, weights_identity

    assert not hasattr(embed.info, "weights")
    expected = weights_identity(ModelSource(str(dirs.plain), str(dirs.plain), local=True))
    assert weights_identity_of(embed) == expected and expected.startswith("sha256 ")


def test_padding_never_changes_an_embedding(embed: HFBackend) -> None:
    encodings = embed.tokenize(texts(TEXTS), 64)
    assert len({e.length for e in encodings}) > 3  # really mixed lengths
    batched = embed.run(encodings)
    reversed_batch = embed.run(encodings[::-1])[::-1]
    for i, encoding in enumerate(encodings):
        alone = embed.run([encoding])[0]
        assert batched[i].dtype == np.float32 and batched[i].shape == (32,)
        np.testing.assert_allclose(batched[i], alone, atol=1e-5)
        np.testing.assert_allclose(reversed_batch[i], alone, atol=1e-5)


def test_mean_and_cls_pooling_match_a_direct_forward(
    dirs: SimpleNamespace, reference: SimpleNamespace
) -> None:
    mean, cls = load(dirs.plain, pooling="mean"), load(dirs.plain, pooling="cls")
    out_mean = mean.run(mean.tokenize(texts(TEXTS), 64))
    out_cls = cls.run(cls.tokenize(texts(TEXTS), 64))
    for i, text in enumerate(TEXTS):
        states = hidden_states(reference, text)
        np.testing.assert_allclose(out_mean[i], states.mean(dim=0).numpy(), atol=1e-5)
        np.testing.assert_allclose(out_cls[i], states[0].numpy(), atol=1e-5)
        assert not np.allclose(out_mean[i], out_cls[i], atol=1e-3)


def test_last_token_pooling_ignores_right_padding(dirs: SimpleNamespace) -> None:
    last = load(dirs.plain, pooling="last")
    assert last.pooling == ("lasttoken",)  # --pooling last is sentence-transformers' lasttoken
    encodings = last.tokenize(texts(TEXTS), 64)
    batched = last.run(encodings)
    for i, encoding in enumerate(encodings):
        np.testing.assert_allclose(batched[i], last.run([encoding])[0], atol=1e-5)


def test_sentence_transformers_files_are_honoured(dirs: SimpleNamespace) -> None:
    backend = load(dirs.st)
    info = backend.info
    assert info.max_input_tokens == 24  # max_seq_length, below the tokenizer's 64
    assert (backend.pooling, info.normalized, info.raw_vectors) == (("cls",), True, True)
    rows = backend.run(backend.tokenize(texts(TEXTS), 24))
    # raw rows: the Normalize module is the pipeline's to apply, per request
    assert not np.allclose([np.linalg.norm(v) for v in rows], 1.0, atol=1e-3)
    np.testing.assert_allclose(np.linalg.norm(finish(info, rows), axis=1), 1.0, atol=1e-6)
    raw = load(dirs.st, normalize="false")
    assert not raw.info.normalized
    same = raw.run(raw.tokenize(texts(TEXTS), 24))  # only the default answer differs
    np.testing.assert_allclose(np.stack(same), np.stack(rows), atol=1e-6)


def test_tiny_sentence_transformers_dir_matches_sentence_transformers(
    dirs: SimpleNamespace,
) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    expected = sentence_transformers.SentenceTransformer(str(dirs.st), device="cpu").encode(TEXTS)
    backend = load(dirs.st)
    rows = backend.run(backend.tokenize(texts(TEXTS), backend.info.max_input_tokens))
    np.testing.assert_allclose(finish(backend.info, rows), expected, atol=1e-5)


def test_truncation_keeps_the_special_tokens(embed: HFBackend, reference: SimpleNamespace) -> None:
    tok = reference.tokenizer
    long_text = " ".join(["fox"] * 100)
    full, cut = (
        embed.tokenize(texts([long_text]), None)[0],
        embed.tokenize(texts([long_text]), 10)[0],
    )
    assert full.length == 102 and cut.length == 10
    assert cut.ids[0] == tok.cls_token_id and cut.ids[-1] == tok.sep_token_id
    assert cut.ids[1:-1].tolist() == full.ids[1:9].tolist()
    with pytest.raises(ValueError, match="special tokens"):
        embed.tokenize(texts([long_text]), 2)


def test_an_encoding_says_whether_truncation_cut_it(
    embed: HFBackend, dirs: SimpleNamespace,
) -> None:
    """Under, exactly at and over the limit: only the input that lost tokens is ``truncated``,
    from the tokenizer's own call (the worker never tokenizes it again to tell)."""
    under, at, over = (" ".join(["fox"] * n) for n in (5, 8, 9))  # 2 special tokens each
    encodings = embed.tokenize(texts([under, at, over]), 10)
    assert [e.length for e in encodings] == [7, 10, 10]
    assert [e.truncated for e in encodings] == [False, False, True]
    assert not any(e.truncated for e in embed.tokenize(texts([over]), None))
    pair = load(dirs.rerank, task="rerank").tokenize(
        [TextInput("hello", " ".join(["fox"] * 80)), TextInput("hello", "fox")], 16)
    assert [e.truncated for e in pair] == [True, False]


def test_run_refuses_rows_longer_than_the_model(embed: HFBackend) -> None:
    too_long = embed.tokenize(texts([" ".join(["fox"] * 100)]), None)[0]
    with pytest.raises(ValueError, match="row 1 has 102 tokens"):
        embed.run([embed.tokenize(texts(["hello"]), 64)[0], too_long])
    assert embed.run([]) == []


# -- prompts ------------------------------------------------------------------


def test_a_prompt_is_tokenized_in_front_of_the_text(
    embed: HFBackend, reference: SimpleNamespace
) -> None:
    tok = reference.tokenizer
    encoding = embed.tokenize([TextInput("hello world", prompt="query: ")], 64)[0]
    assert encoding.ids.tolist() == tok("query: hello world")["input_ids"]  # the prompt costs
    # sentence-transformers' count: [CLS] query [UNK] of "[CLS] query : [SEP]", less the [SEP]
    assert encoding.prompt_length == len(tok("query: ")["input_ids"]) - 1 == 3
    assert embed.tokenize(texts(["hello world"]), 64)[0].prompt_length == 0
    cut = embed.tokenize([TextInput(" ".join(["fox"] * 80), prompt="query: ")], 10)[0]
    assert cut.length == 10  # truncation keeps the prompt
    assert cut.ids[:3].tolist() == encoding.ids[:3].tolist()


def test_a_pair_gets_the_prompt_in_front_of_its_first_text(dirs: SimpleNamespace) -> None:
    backend = load(dirs.rerank, task="rerank")
    tok = backend._tokenizer
    encoding = backend.tokenize([TextInput("cat", "dog", prompt="query: ")], 64)[0]
    assert encoding.ids.tolist() == tok("query: cat", "dog")["input_ids"]


def test_prompt_lengths_are_measured_once_and_the_cache_is_bounded() -> None:
    calls: list[str] = []

    def measure(prompt: str) -> list[int]:
        calls.append(prompt)
        return [101, *range(len(prompt.split())), 102]  # [CLS] words [SEP]

    lengths = prompt_lengths(measure, {101, 102}, size=2)
    assert lengths("") == 0 and calls == []
    assert lengths("a b") == lengths("a b") == 3 and calls == ["a b"]
    lengths("c")
    lengths("d")  # "a b" is the least recently used of three: dropped
    assert lengths("a b") == 3 and calls == ["a b", "c", "d", "a b"]
    no_closing = prompt_lengths(lambda p: [7, 8], {101})
    assert no_closing("x") == 2  # no trailing special token: nothing to take off


def test_windows_repeat_the_prompt(embed: HFBackend) -> None:
    prompt = "query: "
    encoding = embed.tokenize([TextInput(" ".join(["fox", "cat"] * 30), prompt=prompt)], None)[0]
    head = encoding.ids[: encoding.prompt_length].tolist()
    windows = embed.windows(encoding, 12, 2)
    assert len(windows) > 1
    for window in windows:
        assert window.ids[: len(head)].tolist() == head and window.ids[-1] == encoding.ids[-1]
        assert window.prompt_length == encoding.prompt_length and window.length <= 12
    content = encoding.ids[len(head) : -1].tolist()
    assert windows[0].ids[len(head) : -1].tolist() == content[: 12 - len(head) - 1]


def test_pooling_without_the_prompt_skips_each_rows_own_prompt() -> None:
    from tokenq.worker.backends.hf.head import pool
    from tokenq.worker.backends.hf.layout import POOLING_MODES

    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    skip = torch.tensor([2, 0])
    mean = pool(hidden, mask, ["mean"], skip)
    torch.testing.assert_close(mean[0], hidden[0, 2:4].mean(dim=0))
    torch.testing.assert_close(mean[1], hidden[1].mean(dim=0))
    cls = pool(hidden, mask, ["cls"], skip)
    torch.testing.assert_close(cls[0], hidden[0, 2])  # the first token after the prompt
    both = pool(hidden, mask, ["cls", "mean"], skip)
    torch.testing.assert_close(both, torch.cat([cls, mean], dim=-1))
    # a prompt that fills its whole (truncated) row leaves nothing: zeros, never -inf
    nothing = pool(hidden, mask, [m for m in POOLING_MODES if m != "cls"], torch.tensor([4, 5]))
    assert torch.equal(nothing, torch.zeros_like(nothing))


# -- classification and reranking --------------------------------------------


def test_classification_rows_are_the_logits_of_a_single_forward(dirs: SimpleNamespace) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    backend = load(dirs.classify, task="classify")
    assert (backend.info.task, backend.info.dim, backend.info.pairs) == ("classify", 3, False)
    assert len(backend.info.labels) == 3
    # three labels, no problem_type: the text-classification pipeline's softmax
    assert backend.info.activation == backend.info.extra["activation"] == "softmax"
    assert not backend.info.raw_vectors
    model = AutoModelForSequenceClassification.from_pretrained(str(dirs.classify)).eval()
    tok = AutoTokenizer.from_pretrained(str(dirs.classify))
    scores = backend.run(backend.tokenize(texts(TEXTS), 64))
    for text, row in zip(TEXTS, scores, strict=True):
        with torch.inference_mode():
            logits = model(**tok(text, return_tensors="pt")).logits[0].numpy()
        assert row.dtype == np.float32 and row.shape == (3,)
        np.testing.assert_allclose(row, logits, atol=1e-5)


def test_rerank_scores_each_pair_as_one_sequence(dirs: SimpleNamespace) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    backend = load(dirs.rerank, task="rerank")
    assert (backend.info.task, backend.info.dim, backend.info.pairs) == ("rerank", 1, True)
    assert backend.info.activation == "sigmoid"  # a one-logit cross-encoder's default
    model = AutoModelForSequenceClassification.from_pretrained(str(dirs.rerank)).eval()
    tok = AutoTokenizer.from_pretrained(str(dirs.rerank))
    encodings = backend.tokenize([TextInput(q, p) for q, p in PAIRS], 64)
    assert all(e.is_pair and 1 in e.type_ids for e in encodings)
    scores = backend.run(encodings)
    for (query, passage), row in zip(PAIRS, scores, strict=True):
        with torch.inference_mode():
            logits = model(**tok(query, passage, return_tensors="pt")).logits[0].numpy()
        np.testing.assert_allclose(row, logits, atol=1e-5)
    with pytest.raises(BadRequest, match="input 1 has no text_pair"):
        backend.tokenize([TextInput("q", "p"), TextInput("q")], 64)


def test_pairs_are_truncated_longest_first(dirs: SimpleNamespace) -> None:
    backend = load(dirs.rerank, task="rerank")
    tok = backend._tokenizer
    query, passage = "hello world", " ".join(["fox"] * 80)
    encoding = backend.tokenize([TextInput(query, passage)], 16)[0]
    assert encoding.length == 16
    ids = encoding.ids.tolist()
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert ids[1:4] == [*tok(query, add_special_tokens=False)["input_ids"], tok.sep_token_id]


def test_classify_accepts_single_texts_and_pairs_mixed(dirs: SimpleNamespace) -> None:
    backend = load(dirs.classify, task="classify")
    mixed = [TextInput("hello"), TextInput("query", "passage"), TextInput("cat dog")]
    encodings = backend.tokenize(mixed, 64)
    assert [e.is_pair for e in encodings] == [False, True, False]
    batched = backend.run(encodings)
    for encoding, row in zip(encodings, batched, strict=True):
        np.testing.assert_allclose(row, backend.run([encoding])[0], atol=1e-5)


# -- chunking -----------------------------------------------------------------


def test_windows_cover_the_content_with_overlap(embed: HFBackend) -> None:
    encoding = embed.tokenize(texts([" ".join(["fox", "cat", "dog"] * 30)]), None)[0]
    content = encoding.ids[1:-1].tolist()
    windows = embed.windows(encoding, 12, 3)
    assert len(windows) > 1 and all(w.length <= 12 for w in windows)
    for window in windows:
        assert (window.ids[0], window.ids[-1]) == (encoding.ids[0], encoding.ids[-1])
    rebuilt = list(windows[0].ids[1:-1])
    for window in windows[1:]:
        assert rebuilt[-3:] == window.ids[1:4].tolist()  # each window repeats 3 tokens
        rebuilt.extend(window.ids[4:-1])
    assert rebuilt == content
    short = embed.tokenize(texts(["hello"]), None)[0]
    assert embed.windows(short, 12, 3) == [short]
    vectors = embed.run(windows)
    combined = combine_chunks(vectors, [w.length for w in windows], embed.info.normalized)
    assert combined.shape == (32,) and combined.dtype == np.float32


def test_sliding_windows_arithmetic() -> None:
    ids = (100, *range(10), 101)  # prefix 100, content 0..9, suffix 101
    windows = sliding_windows(ids, 1, 1, max_length=6, overlap=1)  # 4 content tokens, stride 3
    assert windows == [(100, 0, 1, 2, 3, 101), (100, 3, 4, 5, 6, 101), (100, 6, 7, 8, 9, 101)]
    assert sliding_windows(ids, 1, 1, max_length=12, overlap=5) == [ids]
    with pytest.raises(ValueError, match="overlap"):
        sliding_windows(ids, 1, 1, max_length=6, overlap=4)
    with pytest.raises(ValueError, match="no room"):
        sliding_windows(ids, 1, 1, max_length=2, overlap=0)


def test_combine_chunks_is_a_length_weighted_mean() -> None:
    a, b = np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)
    np.testing.assert_allclose(combine_chunks([a, b], [3, 1], normalize=False), [0.75, 0.25])
    unit = combine_chunks([a, b], [3, 1], normalize=True)
    np.testing.assert_allclose(unit, np.array([3.0, 1.0]) / np.sqrt(10), rtol=1e-6)
    assert unit.dtype == np.float32
    with pytest.raises(ValueError):
        combine_chunks([], [], normalize=True)


def test_windows_refuse_what_cannot_be_chunked(embed: HFBackend, dirs: SimpleNamespace) -> None:
    with pytest.raises(ValueError, match="exceeds"):
        embed.windows(embed.tokenize(texts(["hello"]), None)[0], 65, 0)
    classify = load(dirs.classify, task="classify")
    with pytest.raises(ValueError, match="embeddings only"):
        classify.windows(classify.tokenize(texts(["hello"]), None)[0], 12, 0)


# -- refusals -----------------------------------------------------------------


def test_pairs_on_an_embedding_model_are_refused(embed: HFBackend) -> None:
    with pytest.raises(BadRequest, match=r"input 1 is a .* pair.*embedding model"):
        embed.tokenize([TextInput("a"), TextInput("query", "passage")], 64)


def test_unknown_model_path_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; without it a hub
    # look-up retries for ~25 s on a machine without network.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ConfigError, match=r"such-model.*does not exist"):
        load(missing)
    with pytest.raises(ConfigError, match=r"not-a-model.*no such directory"):
        resolve_model("not-a-model/anywhere")
    (tmp_path / "file.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="is a file"):
        load(tmp_path / "file.bin")


def test_model_without_tokenizer_is_refused(dirs: SimpleNamespace, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(dirs.plain / name, bare / name)
    with pytest.raises(ConfigError, match="has no tokenizer"):
        load(bare)


@pytest.mark.parametrize("dtype", ["int8", "fp64"])
def test_unsupported_dtype_is_a_config_error(dtype: str) -> None:
    with pytest.raises(ConfigError, match="dtype"):
        HFOptions.from_settings(SimpleNamespace(dtype=dtype))


def test_bad_device_and_fp16_on_cpu(dirs: SimpleNamespace) -> None:
    with pytest.raises(ConfigError, match="device"):
        HFOptions.from_settings(SimpleNamespace(device="tpu"))
    with pytest.raises(ConfigError, match="fp16 is not supported on device cpu"):
        load(dirs.plain, dtype="fp16")
    if torch.cuda.is_available():
        return
    with pytest.raises(ConfigError, match="CUDA is not available"):
        HFBackend.load(HFOptions(model=str(dirs.plain), device="cuda"))
    with pytest.warns(RuntimeWarning, match="fp32 instead of fp16"):
        fallback = HFBackend.load(HFOptions(model=str(dirs.plain), dtype="fp16"))
    assert fallback.info.dtype == "float32"


def test_bf16_on_cpu_runs(dirs: SimpleNamespace) -> None:
    backend = load(dirs.plain, dtype="bf16")
    assert backend.info.dtype == "bfloat16"
    vectors = backend.run(backend.tokenize(texts(TEXTS), 64))
    assert all(v.dtype == np.float32 for v in vectors)


def test_max_input_tokens_override(dirs: SimpleNamespace) -> None:
    assert load(dirs.plain, max_input_tokens=32).info.max_input_tokens == 32
    with pytest.raises(ConfigError, match="exceeds"):
        load(dirs.plain, max_input_tokens=65)


def test_classify_needs_a_trained_head(dirs: SimpleNamespace) -> None:
    with pytest.raises(ConfigError, match="lacks trained weights"):
        load(dirs.plain, task="classify")


def _edit_json(path: Path, **changes: object) -> None:
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**config, **changes}))


DENSE = {"in_features": 32, "out_features": 16}
LAYOUT_REFUSALS = {
    "module type": (("LayerNorm",), {}, r"modules \['LayerNorm'\] are not supported"),
    "Dense without config": (("Dense",), {}, r"Dense module has no 2_Dense/config.json"),
    "Dense activation": (
        ("Dense",),
        {"2_Dense/config.json": {**DENSE, "activation_function": "my_pkg.Swish"}},
        r"activation_function 'my_pkg.Swish'",
    ),
    "Dense input": (
        ("Dense",),
        {"2_Dense/config.json": {**DENSE, "module_input_name": "token_embeddings"}},
        r"module_input_name 'token_embeddings'",
    ),
    "Dense size": (
        ("Dense",),
        {"2_Dense/config.json": {**DENSE, "in_features": 64}},
        r"takes 64 values but is given 32",
    ),
    "Dense weights": (("Dense",), {"2_Dense/config.json": DENSE}, r"no model.safetensors"),
    "pooling mode": ((), {"1_Pooling/config.json": {"pooling_mode": "median"}}, r"median"),
    "chat template": (
        (),
        {"sentence_bert_config.json": {"modality_config": {"message": {}}}},
        r"chat messages",
    ),
    "cross-encoder files": (
        (),
        {"sentence_bert_config.json": {"transformer_task": "sequence-classification"}},
        r"computes 'sequence-classification'.*needs 'feature-extraction'",
    ),
    "default prompt": (
        (),
        {"config_sentence_transformers.json": {"prompts": {}, "default_prompt_name": "q"}},
        r"default_prompt_name 'q' is not one of its prompts",
    ),
}


@pytest.mark.parametrize("case", list(LAYOUT_REFUSALS))
def test_unsupported_sentence_transformers_layouts_are_refused_by_name(
    dirs: SimpleNamespace, tmp_path: Path, case: str
) -> None:
    extra, files, match = LAYOUT_REFUSALS[case]
    model = tmp_path / "model"
    shutil.copytree(dirs.plain, model)
    write_sentence_transformers_files(model, pooling="mean", normalize=False, extra_modules=extra)
    for name, changes in files.items():
        _edit_json(model / name, **changes)
    with pytest.raises(ConfigError, match=match):
        load(model)


def test_normalize_before_a_dense_module_is_refused(dirs: SimpleNamespace, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(dirs.plain, model)
    write_sentence_transformers_files(model, normalize=False, extra_modules=("Normalize", "Dense"))
    with pytest.raises(ConfigError, match=r"in the order \['Transformer', 'Pooling', 'Normalize'"):
        load(model)


def test_a_rerank_model_is_one_transformer_module(dirs: SimpleNamespace, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(dirs.rerank, model)
    write_sentence_transformers_files(model, pooling="mean", normalize=False)
    with pytest.raises(ConfigError, match=r"\['Transformer', 'Pooling'\].*--task rerank"):
        load(model, task="rerank")


def test_old_sentence_transformers_layout_with_a_transformer_folder(
    dirs: SimpleNamespace, tmp_path: Path
) -> None:
    model = tmp_path / "old"
    shutil.copytree(dirs.plain, model / "0_Transformer")
    write_sentence_transformers_files(model, pooling="mean", normalize=True, max_seq_length=None)
    modules = json.loads((model / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (model / "modules.json").write_text(json.dumps(modules))
    shutil.move(model / "sentence_bert_config.json", model / "0_Transformer")
    backend = load(model)
    assert backend.info.tokenizer == str(model / "0_Transformer" / "tokenizer.json")
    info = backend.info
    assert (backend.pooling, info.normalized, info.max_input_tokens) == (("mean",), True, 64)


def test_trust_remote_code_is_an_opt_in_hf_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from tokenq.worker.settings import WorkerSettings

    assert WorkerSettings().trust_remote_code is False
    assert HFOptions.from_settings(WorkerSettings(trust_remote_code=True)).trust_remote_code
    monkeypatch.setenv("TOKENQ_TRUST_REMOTE_CODE", "true")
    assert WorkerSettings().trust_remote_code is True
    with pytest.raises(ValidationError, match="--backend sim ignores --trust-remote-code"):
        WorkerSettings(backend="sim", trust_remote_code=True)


def test_settings_object_and_bundled_default(dirs: SimpleNamespace) -> None:
    from tokenq.worker.settings import WorkerSettings

    assert HFOptions.from_settings(WorkerSettings()) == HFOptions()
    backend = build_hf_backend(SimpleNamespace(model=str(dirs.plain), task="embed", device="cpu"))
    assert backend.info.model == str(dirs.plain)
    source = resolve_model(None)
    assert source.name == "sentence-transformers/all-MiniLM-L6-v2"
    assert Path(source.location, "model.safetensors").is_file()


def test_cuda_out_of_memory_becomes_device_out_of_memory(
    embed: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*_args: object, **_kwargs: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    monkeypatch.setattr(embed, "_forward", fail)
    with pytest.raises(DeviceOutOfMemory, match=r"2 rows x 3 tokens.*out of memory"):
        embed.run(embed.tokenize(texts(["hello", "cat"]), 64))


def test_close_releases_the_model(dirs: SimpleNamespace) -> None:
    backend = load(dirs.plain)
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        backend.run(backend.tokenize(texts(["hello"]), 64))


# -- budget calibration -------------------------------------------------------


def test_cpu_budget_is_the_documented_default(embed: HFBackend) -> None:
    tokens, reason = calibrate_budget(embed)
    assert tokens == max(8 * 64, CPU_DEFAULT_TOKENS) == 16384
    assert reason.startswith("cpu:")
    big = SimpleNamespace(info=SimpleNamespace(device="cpu", max_input_tokens=8192))
    assert calibrate_budget(big)[0] == 8 * 8192


def test_probe_extrapolates_the_last_two_probes() -> None:
    def measure(rows: int) -> int:  # 1 MB fixed + 1 KB per token at 128-token rows
        return 1_000_000 + 1000 * rows * 128

    tokens, reason = probe_budget(measure, usable_bytes=100_000_000, row_tokens=128, max_rows=4096)
    assert tokens == pytest.approx(99_000, abs=1)
    assert "1000 bytes/token" in reason


def test_probe_stops_at_out_of_memory_and_at_max_rows() -> None:
    def measure(rows: int) -> int:
        if rows >= 8:
            raise DeviceOutOfMemory("no room")
        return 10 * rows * 100

    tokens, reason = probe_budget(measure, usable_bytes=10**9, row_tokens=100, max_rows=64)
    assert tokens == 799 and "out of memory at 800 tokens" in reason
    tokens, reason = probe_budget(
        lambda rows: rows, usable_bytes=10**9, row_tokens=100, max_rows=16
    )
    assert tokens == 1600 and "capped" in reason
    assert plan_budget([], usable_bytes=10, row_tokens=100, max_rows=4)[0] == 0
    # Two probes of one size give no slope: the last one's bytes per token, no ZeroDivisionError.
    repeated = [(200, 2000), (200, 2000)]
    assert plan_budget(repeated, usable_bytes=10_000, row_tokens=100, max_rows=64)[0] == 1000


# -- the real model -------------------------------------------------------------

REAL_TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Redis streams make a good work queue.",
    "GPU memory follows the padded size of a batch.",
    "hello",
    "",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "我喜欢在周末去公园散步。",
    "今天天气很好，我们去爬山吧。",
    "机器学习是人工智能的一个分支。",
    "北京是中国的首都。",
    "Mixed 中文 and English in one sentence.",
    "Token budgets beat request counts when lengths vary.",
    "short",
    "An embedding maps text to a vector; similar texts get nearby vectors.",
    "批处理按照令牌预算而不是请求数量。",
    " ".join(["This sentence is repeated to make a long passage."] * 40),
    " ".join(["长文本测试"] * 80),
    "Sentence transformers normalise their embeddings to unit length.",
]


@pytest.mark.slow
def test_minilm_matches_sentence_transformers() -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    path = resolve_model(None).location
    backend = HFBackend.load(HFOptions(device="cpu"))
    assert backend.info.max_input_tokens == 256 and backend.info.dim == 384
    encodings = backend.tokenize(texts(REAL_TEXTS), backend.info.max_input_tokens)
    assert max(e.length for e in encodings) == 256  # the long ones really were truncated
    assert len(backend.tokenize(texts(REAL_TEXTS[-3:-1]), None)[0].ids) > 256
    got = finish(backend.info, backend.run(encodings))
    expected = sentence_transformers.SentenceTransformer(path, device="cpu").encode(REAL_TEXTS)
    cosine = (got * expected).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert cosine.min() >= 0.9999, cosine
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_cuda_calibration_glue_with_a_fake_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's bookkeeping, on fakes: 2 KB per token above a 1 GB free device."""
    state = {"peak": 0}

    class FakeBackend:
        info = SimpleNamespace(device="cuda:0", max_input_tokens=128, pairs=True)

        def tokenize(self, inputs: list[TextInput], max_length: int) -> list[HFEncoding]:
            assert inputs[0].text_pair is not None  # a cross-encoder gets a pair
            return [HFEncoding(np.arange(max_length), np.zeros(max_length, np.int64))]

        def run(self, batch: list[HFEncoding]) -> list[np.ndarray]:
            tokens = sum(e.length for e in batch)
            if tokens * 2048 > 10**9:
                raise DeviceOutOfMemory("fake")
            state["peak"] = tokens * 2048
            return [np.zeros(1, np.float32)] * len(batch)

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (10**9, 2 * 10**9))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: state["peak"])
    tokens, reason = calibrate_budget(FakeBackend(), safety=0.5, max_rows=10_000)
    assert tokens == 5 * 10**8 // 2048  # half of the free bytes at 2 KB per token
    assert reason.startswith("cuda: 2048 bytes/token at 128-token rows")
    # --processes-per-device 4: this worker plans on a quarter of what it would alone.
    shared, why = calibrate_budget(FakeBackend(), safety=0.5, max_rows=10_000, share=0.25)
    assert shared == (5 * 10**8 // 4) // 2048
    assert "0.25 of the device's free memory: --device-share" in why
    with pytest.raises(ValueError, match="share must be in"):
        calibrate_budget(FakeBackend(), share=0)
