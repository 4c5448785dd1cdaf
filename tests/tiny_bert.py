"""Build tiny random BERT models on disk, so backend tests need no hub and no download.

``write_tiny_bert(path)`` writes a 2-layer, 32-wide BERT with a small
WordPiece vocabulary (lowercase letters and their ``##`` continuations,
digits, a few words and CJK characters) in the layout ``from_pretrained``
reads: config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
``write_sentence_transformers_files`` adds the files sentence-transformers
writes next to them, in the legacy form older releases wrote (boolean
``pooling_mode_*`` keys); tests/tiny_models.py has models that
sentence-transformers itself saves. Weights are seeded, so a directory is
reproducible.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "quick", "brown", "fox", "hello", "world", "query", "passage", "cat", "dog"]
CJK = list("你好世界猫狗中文")

SAMPLE_TEXTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog again and again",
    "你好世界",
    "",
    "cat dog 42!",
    "a b c d e f g h i j k l m n o p",
]
"""Texts of mixed lengths and scripts (one empty: a backend must take it) for parity tests."""
SAMPLE_PAIRS = [
    ("query", "the quick brown fox"),
    ("hello world", "cat"),
    ("dog", "a long passage about cats and dogs and foxes that goes on for a while"),
    ("你好", "世界 hello"),
]
"""(query, passage) pairs for cross-encoder parity tests."""


def tiny_vocab() -> list[str]:
    """A WordPiece vocabulary that spells any lowercase ASCII text without [UNK]."""
    chars = list(string.ascii_lowercase + string.digits)
    return SPECIAL + WORDS + chars + ["##" + c for c in chars] + list(".,!?'-") + CJK


def write_tiny_bert(
    path: Path,
    *,
    head: Literal["none", "classify"] = "none",
    num_labels: int = 3,
    max_position_embeddings: int = 64,
    model_max_length: int | None = None,
    seed: int = 0,
    id2label: Mapping[int, str] | None = None,
    problem_type: str | None = None,
) -> Path:
    """Write a tiny random BERT (bare, or with a sequence-classification head) to ``path``.

    ``id2label`` and ``problem_type`` go into config.json as transformers reads them.
    """
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = tiny_vocab()
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    tokenizer.model_max_length = model_max_length or max_position_embeddings
    tokenizer.save_pretrained(str(path))
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=max_position_embeddings,
        # Larger than BERT's 0.02 so tokens, positions and pads differ clearly:
        # a padding leak must show up well above float noise.
        initializer_range=0.2,
        num_labels=num_labels,
        problem_type=problem_type,
    )
    if id2label is not None:
        config.id2label = {int(i): name for i, name in id2label.items()}
        config.label2id = {name: int(i) for i, name in id2label.items()}
    torch.manual_seed(seed)
    model = BertModel(config) if head == "none" else BertForSequenceClassification(config)
    model.eval().save_pretrained(str(path))
    return path


LEGACY_POOLING_KEYS = {
    "cls": "cls_token",
    "max": "max_tokens",
    "mean": "mean_tokens",
    "mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "weightedmean": "weightedmean_tokens",
    "lasttoken": "lasttoken",
}
"""sentence-transformers' pooling modes by the suffix of their legacy ``pooling_mode_*`` key."""


def write_sentence_transformers_files(
    path: Path,
    *,
    pooling: str | tuple[str, ...] = "cls",
    normalize: bool = True,
    max_seq_length: int | None = 24,
    extra_modules: tuple[str, ...] = (),
    include_prompt: bool | None = None,
    prompts: Mapping[str, str] | None = None,
    default_prompt_name: str | None = None,
    dimension: int = 32,
) -> Path:
    """Add modules.json, 1_Pooling/config.json, 2_Normalize and sentence_bert_config.json.

    ``pooling`` is one mode or several (each gets its legacy boolean key);
    ``prompts`` and ``default_prompt_name`` go into
    config_sentence_transformers.json.
    """
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    for kind in extra_modules:
        idx = len(modules)
        modules.append(
            {
                "idx": idx,
                "name": str(idx),
                "path": f"{idx}_{kind}",
                "type": f"sentence_transformers.models.{kind}",
            }
        )
    if normalize:
        idx = len(modules)
        modules.append(
            {
                "idx": idx,
                "name": str(idx),
                "path": f"{idx}_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (path / f"{idx}_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    chosen = {pooling} if isinstance(pooling, str) else set(pooling)
    pooling_config: dict[str, object] = {"word_embedding_dimension": dimension}
    for mode, key in LEGACY_POOLING_KEYS.items():
        pooling_config[f"pooling_mode_{key}"] = mode in chosen
    if include_prompt is not None:
        pooling_config["include_prompt"] = include_prompt
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    if prompts is not None or default_prompt_name is not None:
        st_config = {"prompts": dict(prompts or {}), "default_prompt_name": default_prompt_name}
        (path / "config_sentence_transformers.json").write_text(json.dumps(st_config, indent=2))
    bert_config = {"do_lower_case": False}
    if max_seq_length is not None:
        bert_config["max_seq_length"] = max_seq_length
    (path / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    return path
