"""Build tiny random BERT models on disk, so backend tests need no hub and no download.

``write_tiny_bert(path)`` writes a 2-layer, 32-wide BERT with a small
WordPiece vocabulary (lowercase letters and their ``##`` continuations,
digits, a few words and CJK characters) in the layout ``from_pretrained``
reads: config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
``write_sentence_transformers_files`` adds the files sentence-transformers
writes next to them. Weights are seeded, so a directory is reproducible.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Literal

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "quick", "brown", "fox", "hello", "world", "query", "passage", "cat", "dog"]
CJK = list("你好世界猫狗中文")


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
) -> Path:
    """Write a tiny random BERT (bare, or with a sequence-classification head) to ``path``."""
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
    )
    torch.manual_seed(seed)
    model = BertModel(config) if head == "none" else BertForSequenceClassification(config)
    model.eval().save_pretrained(str(path))
    return path


def write_sentence_transformers_files(
    path: Path,
    *,
    pooling: Literal["mean", "cls", "lasttoken", "max"] = "cls",
    normalize: bool = True,
    max_seq_length: int | None = 24,
    extra_modules: tuple[str, ...] = (),
) -> Path:
    """Add modules.json, 1_Pooling/config.json, 2_Normalize and sentence_bert_config.json."""
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
    modes = ["cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken"]
    chosen = {
        "mean": "mean_tokens",
        "cls": "cls_token",
        "lasttoken": "lasttoken",
        "max": "max_tokens",
    }[pooling]
    pooling_config = {"word_embedding_dimension": 32}
    pooling_config.update({f"pooling_mode_{mode}": mode == chosen for mode in modes})
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    bert_config = {"do_lower_case": False}
    if max_seq_length is not None:
        bert_config["max_seq_length"] = max_seq_length
    (path / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    return path
