"""The Hugging Face transformers backend: embeddings, classification and reranking.

``build_hf_backend(settings)`` is the factory the worker calls for
``--backend hf``. The backend tokenizes with the model's fast tokenizer (one
batch call per list), pads each batch only to its own longest row (right
padding plus an attention mask, so padding never changes a result), runs the
model under ``torch.inference_mode()`` and returns float32 numpy rows.

Tasks:

- ``embed``: ``AutoModel`` + pooling (mean, CLS or last token) and optional
  L2 normalisation; sentence-transformers files (modules.json, the Pooling
  config, a Normalize module, ``max_seq_length``) are honoured when present.
- ``classify``: ``AutoModelForSequenceClassification``; a row's scores are
  the **raw logits** (no softmax or sigmoid), one per label, so callers can
  apply whichever the model was trained with.
- ``rerank``: a cross-encoder; each (query, passage) pair is one sequence
  and its score is the raw logit(s), again without a sigmoid.

Only this module and its ``hf_*`` siblings import torch; the producer never does.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tokenq.shared.errors import BadRequest, ConfigError, DeviceLost, DeviceOutOfMemory
from tokenq.worker.backends.base import BackendInfo, TextInput
from tokenq.worker.backends.hf.encoding import HFEncoding
from tokenq.worker.backends.hf.load import (
    ModelSource,
    SentenceTransformerConfig,
    read_sentence_transformer_config,
    resolve_model,
    tokenizer_json,
)
from tokenq.worker.backends.hf.options import HFOptions, HFTask, resolve_device, resolve_dtype
from tokenq.worker.backends.hf.pooling import l2_normalize, pool
from tokenq.worker.pipeline.chunks import sliding_windows

__all__ = ["HFBackend", "HFOptions", "build_hf_backend"]

log = logging.getLogger(__name__)

# Models whose position table keeps two slots for the padding offset, so
# max_position_embeddings (514) is two more than the longest input (512).
_POSITION_OFFSET = {
    "roberta": 2,
    "xlm-roberta": 2,
    "camembert": 2,
    "mpnet": 2,
    "longformer": 2,
    "data2vec-text": 2,
    "ibert": 2,
}
_NO_LIMIT = 1_000_000  # tokenizers without a model_max_length report ~1e30


def build_hf_backend(settings: Any) -> HFBackend:
    """The worker's factory for ``--backend hf``."""
    return HFBackend.load(HFOptions.from_settings(settings))


class HFBackend:
    """A transformers model behind the :class:`~tokenq.worker.backends.base.Backend` protocol."""

    def __init__(
        self,
        *,
        info: BackendInfo,
        model: torch.nn.Module,
        tokenizer: Any,
        device: torch.device,
        pooling: str,
        normalize: bool,
        lowercase: bool = False,
    ) -> None:
        self.info = info
        self.device = device
        self.pooling = pooling
        self.normalize = normalize
        self._model: torch.nn.Module | None = model
        self._tokenizer = tokenizer
        # The transformers wrapper sets truncation on the shared Rust tokenizer
        # before each call, so two threads tokenizing at once could truncate
        # each other's inputs with the wrong max_length.
        self._tokenizer_lock = threading.Lock()
        self._lowercase = lowercase
        self._hf_task: HFTask = info.extra["hf_task"]
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._uses_type_ids = "token_type_ids" in tokenizer.model_input_names
        self._special_layout = _special_token_layout(tokenizer)
        self._min_length = {
            False: tokenizer.num_special_tokens_to_add(pair=False) + 1,
            True: tokenizer.num_special_tokens_to_add(pair=True) + 2,
        }

    @classmethod
    def load(cls, options: HFOptions) -> HFBackend:
        """Load model and tokenizer as ``options`` say; every refusal is a ConfigError."""
        source = resolve_model(options.model)
        st = SentenceTransformerConfig()
        if options.task == "embed":
            st = read_sentence_transformer_config(source)
            if st.unsupported:
                raise ConfigError(
                    f"model {source.name!r}: sentence-transformers modules {list(st.unsupported)} "
                    "are not supported (tokenq runs Transformer, Pooling and Normalize only)"
                )
        tokenizer_path = tokenizer_json(source, st.subfolder)
        device = resolve_device(options.device)
        dtype = resolve_dtype(options.dtype, device, explicit_device=options.device != "auto")
        tokenizer, model = _load_pretrained(source, st.subfolder, options.task, dtype)
        model.to(device).eval()
        max_input = _max_input_tokens(source, st, tokenizer, model.config, options)
        pooling, normalize = _embed_mode(source, st, options)
        info = BackendInfo(
            name="hf",
            model=source.name,
            task=options.task,
            max_input_tokens=max_input,
            padded=True,
            dim=_output_dim(model.config, options.task),
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            tokenizer=tokenizer_path,
            pairs=options.task == "rerank",
            normalized=options.task == "embed" and normalize,
            labels=_labels(model.config, options.task),
            extra=_extra(source, options.task, pooling, normalize, model.config),
        )
        log.info(
            "hf backend: %s task=%s device=%s dtype=%s max_input_tokens=%d",
            info.model,
            options.task,
            info.device,
            info.dtype,
            max_input,
        )
        return cls(
            info=info,
            model=model,
            tokenizer=tokenizer,
            device=device,
            pooling=pooling,
            normalize=normalize,
            lowercase=st.do_lower_case,
        )

    # -- tokenization -------------------------------------------------------

    def tokenize(self, inputs: Sequence[TextInput], max_length: int | None) -> list[HFEncoding]:
        """Tokenize with the fast tokenizer in one batch call per kind of input.

        Truncation keeps the special tokens (the tokenizer's own truncation);
        pairs are cut 'longest_first'. ``max_length=None`` means no
        truncation, for the 'chunk' and 'reject' policies.
        """
        self._check_inputs(inputs)
        singles = [i for i, item in enumerate(inputs) if item.text_pair is None]
        pairs = [i for i, item in enumerate(inputs) if item.text_pair is not None]
        out: list[HFEncoding | None] = [None] * len(inputs)
        for indices, is_pair in ((singles, False), (pairs, True)):
            if not indices:
                continue
            if max_length is not None and max_length < self._min_length[is_pair]:
                raise ValueError(
                    f"max_length {max_length} is shorter than the special tokens need "
                    f"({self._min_length[is_pair]})"
                )
            texts = [self._prepare(inputs[i].text) for i in indices]
            text_pairs = [self._prepare(inputs[i].text_pair or "") for i in indices]
            with self._tokenizer_lock:
                batch = self._tokenizer(
                    texts,
                    text_pairs if is_pair else None,
                    add_special_tokens=True,
                    truncation="longest_first" if max_length is not None else False,
                    max_length=max_length,
                    return_attention_mask=False,
                    return_token_type_ids=is_pair,
                    verbose=False,
                )
            for row, i in enumerate(indices):
                type_ids = tuple(batch["token_type_ids"][row]) if is_pair else None
                out[i] = HFEncoding(tuple(batch["input_ids"][row]), type_ids)
        return [enc for enc in out if enc is not None]

    def windows(self, encoding: HFEncoding, max_length: int, overlap: int) -> list[HFEncoding]:
        """Sliding windows of an over-long embedding input (the 'chunk' policy).

        Special tokens are put back around each window; combine the window
        embeddings with :func:`tokenq.worker.backends.hf.encoding.combine_chunks`,
        passing ``normalize=backend.info.normalized``.
        """
        if self._hf_task != "embed":
            raise ValueError("chunking applies to embeddings only; this model scores inputs")
        if encoding.is_pair:
            raise ValueError("a (text, text_pair) input cannot be chunked")
        if max_length > self.info.max_input_tokens:
            raise ValueError(
                f"window length {max_length} exceeds the model's {self.info.max_input_tokens}"
            )
        if self._special_layout is None:
            raise ValueError("cannot tell where this tokenizer puts its special tokens")
        n_prefix, n_suffix = self._special_layout
        ids = sliding_windows(encoding.ids, n_prefix, n_suffix, max_length, overlap)
        return [HFEncoding(window) for window in ids]

    def _check_inputs(self, inputs: Sequence[TextInput]) -> None:
        for i, item in enumerate(inputs):
            if self._hf_task == "embed" and item.text_pair is not None:
                raise BadRequest(
                    f"input {i} is a (text, text_pair) pair, but {self.info.model} is an "
                    "embedding model: send one text per input"
                )
            if self._hf_task == "rerank" and item.text_pair is None:
                raise BadRequest(
                    f"input {i} has no text_pair: a rerank (cross-encoder) model scores "
                    "(query, passage) pairs"
                )

    def _prepare(self, text: str) -> str:
        return text.lower() if self._lowercase else text

    # -- inference ----------------------------------------------------------

    def run(self, batch: Sequence[HFEncoding]) -> list[np.ndarray]:
        """Pad to the batch's longest row, run the model, return one float32 row each.

        A CUDA out-of-memory error becomes :class:`DeviceOutOfMemory` after
        the cache is emptied, so the worker can split the batch and retry.
        """
        if not batch:
            return []
        if self._model is None:
            raise RuntimeError("the hf backend is closed")
        tensors = self._pad(batch)
        try:
            result = self._forward(*tensors)
        except torch.cuda.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0] if str(exc) else "CUDA out of memory"
        except RuntimeError as exc:
            if is_device_lost(exc):
                raise DeviceLost(f"the CUDA device failed: {str(exc).splitlines()[0]}") from exc
            raise
        else:
            return list(result)
        # Outside the except block: the exception's traceback (and with it the
        # activations in the failed forward's frames) is gone, so the cache
        # can really be emptied before the worker retries smaller halves.
        torch.cuda.empty_cache()
        shape = tuple(tensors[0].shape)
        raise DeviceOutOfMemory(f"batch of {shape[0]} rows x {shape[1]} tokens: {message}")

    def _pad(self, batch: Sequence[HFEncoding]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        longest = 0
        for i, enc in enumerate(batch):
            if not isinstance(enc, HFEncoding):
                raise TypeError(f"row {i} is a {type(enc).__name__}, not an HFEncoding")
            if not 0 < enc.length <= self.info.max_input_tokens:
                raise ValueError(
                    f"row {i} has {enc.length} tokens; the model takes 1 to "
                    f"{self.info.max_input_tokens} (truncate or chunk it first)"
                )
            longest = max(longest, enc.length)
        ids = np.full((len(batch), longest), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), longest), dtype=np.int64)
        type_ids = np.zeros((len(batch), longest), dtype=np.int64)
        for row, enc in enumerate(batch):
            ids[row, : enc.length] = enc.ids
            mask[row, : enc.length] = 1
            if enc.type_ids is not None:
                type_ids[row, : enc.length] = enc.type_ids
        return tuple(torch.from_numpy(a).to(self.device) for a in (ids, mask, type_ids))

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, type_ids: torch.Tensor) -> np.ndarray:
        assert self._model is not None
        kwargs = {"input_ids": ids, "attention_mask": mask}
        if self._uses_type_ids:
            kwargs["token_type_ids"] = type_ids
        output = self._model(**kwargs)
        if self._hf_task == "embed":
            vectors = pool(output[0], mask, self.pooling)
            if self.normalize:
                vectors = l2_normalize(vectors)
        else:
            vectors = output.logits.float()
        return vectors.cpu().numpy().astype(np.float32, copy=False)

    def close(self) -> None:
        """Drop the model and give its device memory back."""
        self._model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


# -- loading helpers ----------------------------------------------------------


def _load_pretrained(
    source: ModelSource, subfolder: str, task: HFTask, dtype: torch.dtype
) -> tuple[Any, torch.nn.Module]:
    """Tokenizer and model; a missing classification head is refused, not randomly initialised."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one worker process, logs not terminals
    where: dict[str, Any] = {"trust_remote_code": False}
    location = source.location
    if subfolder:
        if source.local:
            location = f"{location}/{subfolder}"
        else:
            where["subfolder"] = subfolder
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(location, use_fast=True, **where)
        model_class = (
            transformers.AutoModel
            if task == "embed"
            else transformers.AutoModelForSequenceClassification
        )
        model, loading = model_class.from_pretrained(
            location, dtype=dtype, output_loading_info=True, **where
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load model {source.name!r}: {exc}") from exc
    if not tokenizer.is_fast:
        raise ConfigError(f"model {source.name!r} has no fast (Rust) tokenizer")
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise ConfigError(f"model {source.name!r} has a tokenizer with no vocabulary")
    # Weights the checkpoint lacks are randomly initialised by transformers,
    # which for a classification head means scores that look fine and mean nothing.
    missing = sorted(k for k in loading.get("missing_keys", ()) if not k.endswith("position_ids"))
    if task != "embed" and missing:
        raise ConfigError(
            f"model {source.name!r} lacks trained weights {missing[:4]}; "
            f"task {task!r} needs a sequence-classification or cross-encoder checkpoint"
        )
    return tokenizer, model


def _max_input_tokens(
    source: ModelSource,
    st: SentenceTransformerConfig,
    tokenizer: Any,
    config: Any,
    options: HFOptions,
) -> int:
    """The smallest of max_seq_length, the tokenizer's limit and the position table."""
    limits = []
    if st.max_seq_length:
        limits.append(st.max_seq_length)
    if 0 < tokenizer.model_max_length < _NO_LIMIT:
        limits.append(int(tokenizer.model_max_length))
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        limits.append(int(positions) - _POSITION_OFFSET.get(config.model_type, 0))
    if not limits and options.max_input_tokens is None:
        raise ConfigError(f"model {source.name!r} states no max input length: set max_input_tokens")
    model_limit = min(limits) if limits else options.max_input_tokens
    assert model_limit is not None
    if options.max_input_tokens is None:
        return model_limit
    if options.max_input_tokens > model_limit:
        raise ConfigError(
            f"max_input_tokens {options.max_input_tokens} exceeds model {source.name!r}'s "
            f"limit of {model_limit}"
        )
    if options.max_input_tokens < tokenizer.num_special_tokens_to_add(pair=False) + 1:
        raise ConfigError(f"max_input_tokens {options.max_input_tokens} leaves no room for text")
    return options.max_input_tokens


def _embed_mode(
    source: ModelSource, st: SentenceTransformerConfig, options: HFOptions
) -> tuple[str, bool]:
    """Pooling and normalisation: explicit settings win, then the model's files, then mean/off."""
    if options.task != "embed":
        return "none", False
    pooling = (st.pooling or "mean") if options.pooling == "auto" else options.pooling
    if st.pooling and options.pooling not in ("auto", st.pooling):
        log.warning(
            "model %r was trained with %s pooling; using %s as configured",
            source.name,
            st.pooling,
            options.pooling,
        )
    if options.pooling == "auto" and not st.pooling:
        log.info("model %r has no pooling config; using mean pooling", source.name)
    normalize = st.normalize if options.normalize == "auto" else options.normalize == "true"
    return pooling, normalize


def _output_dim(config: Any, task: HFTask) -> int:
    return int(config.hidden_size) if task == "embed" else int(config.num_labels)


def _extra(
    source: ModelSource, task: HFTask, pooling: str, normalize: bool, config: Any
) -> dict[str, Any]:
    extra: dict[str, Any] = {"hf_task": task, "path": source.location}
    if task == "embed":
        extra.update(pooling=pooling, normalize=normalize)
    else:
        extra["activation"] = "none (raw logits)"
    return extra


def _labels(config: Any, task: HFTask) -> tuple[str, ...]:
    """A classifier's label names by score index (``id2label``), else none."""
    if task == "embed":
        return ()
    names = getattr(config, "id2label", None) or {}
    return tuple(str(names.get(i, i)) for i in range(int(config.num_labels)))


def _special_token_layout(tokenizer: Any) -> tuple[int, int] | None:
    """How many special tokens the tokenizer puts before and after one sequence.

    Found by tokenizing a probe with and without them rather than by
    assuming BERT's [CLS] ... [SEP], so windows work for any template.
    """
    bare = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    full = tokenizer("hello world", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return start, len(full) - start - len(bare)
    return None


_STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "an illegal instruction",
    "misaligned address",
    "uncorrectable ECC error",
    "device not ready",
    "GPU is lost",
)
"""CUDA errors after which the context is unusable until the process restarts."""


def is_device_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA error no later call on this process can recover from."""
    message = str(exc)
    return "CUDA error" in message and any(part in message for part in _STICKY_CUDA_ERRORS)
