"""More tiny models on disk, beyond tests/tiny_bert.py's BERTs, for the hf backend's tests.

- ``write_tiny_decoder``: a 2-layer Qwen2 or Llama base model (what
  ``AutoModel`` gives a decoder embedder) with a byte-level BPE tokenizer
  trained here, whose template appends an EOS token. The Llama one has no
  pad token, as many decoder tokenizers have none.
- ``write_sentence_transformer``: a folder written by sentence-transformers
  itself (``SentenceTransformer(modules=[...]).save()``), so its files are
  exactly what the reference library writes: Pooling in the new
  ``pooling_mode`` form, Dense modules, prompts.
- ``write_cross_encoder``: a tiny BERT with a classification head, saved by
  ``CrossEncoder.save()``.
- ``write_custom_code_bert``: a model that ships its own Python code
  (``auto_map``), which only ``--trust-remote-code`` may run.

Everything is seeded, so a folder is reproducible.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

EOS = "<|endoftext|>"
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, query: passage: cat dog",
    "a long passage about cats and dogs and foxes that goes on for a while",
    "abcdefghijklmnopqrstuvwxyz 0123456789 . , ! ? ' -",
]


def write_tiny_decoder(
    path: Path, *, arch: Literal["qwen2", "llama"] = "qwen2", seed: int = 0
) -> Path:
    """A tiny random decoder base model and its tokenizer (EOS appended, Llama: no pad token)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        LlamaConfig,
        LlamaModel,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2Model,
    )

    path.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS * 4, trainer)
    eos_id = bpe.token_to_id(EOS)
    bpe.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, eos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, model_max_length=64)
    tokenizer.save_pretrained(str(path))
    shape: dict[str, Any] = {
        "vocab_size": bpe.get_vocab_size(),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "initializer_range": 0.2,
        "eos_token_id": eos_id,
        "bos_token_id": None,
        "pad_token_id": None,
        "tie_word_embeddings": False,
    }
    if arch == "qwen2":
        config, model_class = Qwen2Config(**shape), Qwen2Model
    else:
        config, model_class = LlamaConfig(**shape), LlamaModel
    torch.manual_seed(seed)
    model_class(config).eval().save_pretrained(str(path))
    return path


def write_sentence_transformer(
    path: Path,
    base: Path,
    *,
    pooling: str | Sequence[str] = "mean",
    include_prompt: bool = True,
    dense: Sequence[Mapping[str, Any]] = (),
    normalize: bool = True,
    prompts: Mapping[str, str] | None = None,
    default_prompt_name: str | None = None,
    safe_serialization: bool = True,
    seed: int = 0,
) -> Path:
    """Save ``base`` (a transformers model folder) as sentence-transformers would.

    ``dense`` lists each Dense module's keyword arguments (``out_features``,
    ``activation_function`` as a torch module, ``use_residual``); its
    ``in_features`` follow from the module before.
    """
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(base))
    dim = transformer.get_embedding_dimension()
    modes = pooling if isinstance(pooling, str) else tuple(pooling)
    pool = Pooling(dim, pooling_mode=modes, include_prompt=include_prompt)
    modules: list[torch.nn.Module] = [transformer, pool]
    size = pool.get_embedding_dimension()
    torch.manual_seed(seed)
    for spec in dense:
        layer = Dense(size, **spec)
        with torch.no_grad():  # larger than the default init, so the projection shows
            layer.linear.weight.normal_(0.0, 0.3)
        modules.append(layer)
        size = layer.out_features
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(
        modules=modules,
        prompts=dict(prompts or {}),
        default_prompt_name=default_prompt_name,
        device="cpu",
    )
    model.save(str(path), safe_serialization=safe_serialization)
    return path


def write_cross_encoder(path: Path, base: Path, **options: Any) -> Path:
    """Save ``base`` (a sequence-classification folder) with ``CrossEncoder.save``."""
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(base), device="cpu", **options).save(str(path))
    return path


_CONFIGURATION = '''
from transformers import BertConfig


class TinyCustomConfig(BertConfig):
    model_type = "tiny-custom"
'''

_MODELING = '''
from transformers import BertModel

from .configuration_tiny_custom import TinyCustomConfig


class TinyCustomModel(BertModel):
    """BERT whose token states are shifted by one: proof that this file ran."""

    config_class = TinyCustomConfig

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.last_hidden_state = output.last_hidden_state + 1.0
        return output
'''


def write_custom_code_bert(path: Path, base: Path, modeling: str = _MODELING) -> Path:
    """``base`` (a tiny BERT) as a model with its own code: config.json has ``auto_map``.

    ``modeling`` is the source of ``modeling_tiny_custom.py``, defining ``TinyCustomModel``.
    """
    shutil.copytree(base, path)
    (path / "configuration_tiny_custom.py").write_text(_CONFIGURATION.lstrip())
    (path / "modeling_tiny_custom.py").write_text(modeling.lstrip())
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "tiny-custom"
    config["architectures"] = ["TinyCustomModel"]
    config["auto_map"] = {
        "AutoConfig": "configuration_tiny_custom.TinyCustomConfig",
        "AutoModel": "modeling_tiny_custom.TinyCustomModel",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
