"""Loading a model and its tokenizer through transformers, the limits they state, and every
load-time refusal that needs transformers (slow tokenizer, no vocabulary, untrained head).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.hf.load import ModelSource, check_remote_code
from tokenq.worker.backends.hf.options import HFOptions

# Models whose position table keeps two slots for the padding offset (514 for 512 tokens).
_POSITION_OFFSET = dict.fromkeys(
    ("roberta", "xlm-roberta", "camembert", "mpnet", "longformer", "data2vec-text", "ibert"), 2
)
_NO_LIMIT = 1_000_000  # tokenizers without a model_max_length report ~1e30


def load_pretrained(
    source: ModelSource, subfolder: str, options: HFOptions, dtype: torch.dtype
) -> tuple[Any, torch.nn.Module]:
    """Tokenizer and model, every failure a ConfigError that names the model."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one worker process, logs not terminals
    check_remote_code(source, subfolder, options.trust_remote_code)
    where: dict[str, Any] = {"trust_remote_code": options.trust_remote_code}
    location = source.location
    if subfolder:
        if source.local:
            location = f"{location}/{subfolder}"
        else:
            where["subfolder"] = subfolder
    model_class = {
        "embed": transformers.AutoModel,
        "sparse": transformers.AutoModelForMaskedLM,  # SPLADE reads the MLM head's logits
    }.get(options.task, transformers.AutoModelForSequenceClassification)
    try:
        config = transformers.AutoConfig.from_pretrained(location, **where)
        tokenizer = transformers.AutoTokenizer.from_pretrained(location, use_fast=True, **where)
        model, loading = model_class.from_pretrained(
            location, config=config, dtype=dtype, output_loading_info=True, **where
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load model {source.name!r}: {exc}") from exc
    if not tokenizer.is_fast:
        raise ConfigError(f"model {source.name!r} has no fast (Rust) tokenizer")
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise ConfigError(f"model {source.name!r} has a tokenizer with no vocabulary")
    # transformers initialises missing weights randomly: a head's scores would look
    # fine and mean nothing.
    missing = sorted(k for k in loading.get("missing_keys", ()) if not k.endswith("position_ids"))
    if options.task != "embed" and missing:
        raise ConfigError(
            f"model {source.name!r} lacks trained weights {missing[:4]}; "
            f"task {options.task!r} needs "
            + ("a masked-LM (SPLADE) checkpoint" if options.task == "sparse"
               else "a sequence-classification or cross-encoder checkpoint")
        )
    return tokenizer, model


def pad_token_id(tokenizer: Any) -> int:
    """What pads a batch: the pad token, else EOS, else 0 (the mask hides it)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


def max_input_tokens(
    source: ModelSource, max_seq_length: int | None, tokenizer: Any, config: Any,
    options: HFOptions,
) -> int:
    """The smallest of max_seq_length, the tokenizer's limit and the position table."""
    limits = []
    if max_seq_length:
        limits.append(max_seq_length)
    if 0 < tokenizer.model_max_length < _NO_LIMIT:
        limits.append(int(tokenizer.model_max_length))
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        limits.append(int(positions) - _POSITION_OFFSET.get(config.model_type, 0))
    cap = options.max_input_tokens
    if cap is None:
        if not limits:
            raise ConfigError(
                f"model {source.name!r} states no max input length: set max_input_tokens"
            )
        return min(limits)
    if limits and cap > min(limits):
        raise ConfigError(
            f"max_input_tokens {cap} exceeds model {source.name!r}'s limit of {min(limits)}"
        )
    if cap < tokenizer.num_special_tokens_to_add(pair=False) + 1:
        raise ConfigError(f"max_input_tokens {cap} leaves no room for text")
    return cap
