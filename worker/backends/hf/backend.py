"""The Hugging Face transformers backend: embeddings, classification and reranking.

``build_hf_backend(settings)`` is the ``--backend hf`` factory. It tokenizes
with the fast tokenizer, right-pads each batch to its own longest row (with a
mask, so padding never changes a result), runs eager torch or ONNX Runtime
(:mod:`~tokenq.worker.backends.hf.runtime`) and returns float32 rows. Tasks
(docs/MODELS.md): ``embed`` (rows before L2 normalisation, pooled by
:class:`~tokenq.worker.backends.hf.head.EmbeddingHead`; decoders too),
``classify`` and ``rerank`` (logits; ``info.activation`` as transformers /
sentence-transformers default), ``sparse`` (SPLADE via
:class:`~tokenq.worker.backends.hf.sparse.SparseHead`, torch only). A prompt is
tokenized as ``prompt + text``. Only this package imports torch.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tokenq.shared.errors import BadRequest, ConfigError, DeviceLost, DeviceOutOfMemory
from tokenq.worker.backends.base import Activation, BackendInfo, TextInput
from tokenq.worker.backends.chunks import sliding_windows
from tokenq.worker.backends.hf.activation import classify_activation, rerank_activation
from tokenq.worker.backends.hf.encoding import HFEncoding, PromptLengths
from tokenq.worker.backends.hf.head import EmbeddingHead, build_embedding_head
from tokenq.worker.backends.hf.host_memory import HeapTrimmer, bound_library_caches
from tokenq.worker.backends.hf.layout import (
    SentenceTransformerConfig,
    read_sentence_transformer_config,
    read_sparse_config,
)
from tokenq.worker.backends.hf.load import ModelSource, resolve_model, tokenizer_json
from tokenq.worker.backends.hf.options import (
    HFOptions,
    HFTask,
    resolve_autocast,
    resolve_device,
    resolve_dtype,
)
from tokenq.worker.backends.hf.prefix import PrefixTokenizer
from tokenq.worker.backends.hf.pretrained import load_pretrained, max_input_tokens, pad_token_id
from tokenq.worker.backends.hf.runtime import (
    Encoder,
    Runtime,
    build_encoder,
    check_quantize,
    resolve_runtime,
)
from tokenq.worker.backends.hf.sparse import SparseHead

__all__ = ["HFBackend", "HFOptions", "build_hf_backend"]

log = logging.getLogger(__name__)


SKIP_FORWARD_ENV = "TOKENQ_BENCH_SKIP_FORWARD"
"""Benchmarks only (``run.py feed``): ``1`` answers zeros instead of running the model, so
a worker's own CPU around the forward can be measured."""


def build_hf_backend(settings: Any) -> HFBackend:
    """The worker's factory for ``--backend hf``."""
    return HFBackend.load(HFOptions.from_settings(settings))


class HFBackend:
    """A transformers model behind the :class:`~tokenq.worker.backends.base.Backend` protocol."""

    def __init__(
        self,
        *,
        info: BackendInfo,
        encoder: Encoder,
        tokenizer: Any,
        device: torch.device,
        head: EmbeddingHead | None = None,
        lowercase: bool = False,
        sparse: SparseHead | None = None,
    ) -> None:
        self.info = info
        self.device = device
        self.head = head
        self.sparse = sparse
        self._encoder: Encoder | None = encoder
        self._tokenizer = tokenizer
        # The transformers wrapper sets truncation on the shared Rust tokenizer before
        # each call, so concurrent calls could truncate with each other's max_length.
        self._tokenizer_lock = threading.Lock()
        self._prefix = PrefixTokenizer(tokenizer.backend_tokenizer, tokenizer.truncation_side)
        self._lowercase = lowercase
        self._hf_task: HFTask = info.extra["hf_task"]
        self._pad_id = pad_token_id(tokenizer)
        self._special_layout = _special_token_layout(tokenizer)
        self._min_length = {
            False: tokenizer.num_special_tokens_to_add(pair=False) + 1,
            True: tokenizer.num_special_tokens_to_add(pair=True) + 2,
        }
        self._prompt_lengths = PromptLengths(self._prompt_ids, set(tokenizer.all_special_ids))
        # On the CPU the heap grows with every new batch shape (host_memory explains).
        self._heap = HeapTrimmer() if device.type == "cpu" else None
        self._skip_forward = os.environ.get(SKIP_FORWARD_ENV) == "1"
        if self._skip_forward:
            log.warning("%s=1: the model's forward is skipped, every answer is zeros",
                        SKIP_FORWARD_ENV)

    @property
    def pooling(self) -> tuple[str, ...]:
        """The pooling modes, in concatenation order (empty for a scoring model)."""
        return self.head.modes if self.head else ()

    @property
    def normalize(self) -> bool:
        """Whether the model's default embedding is unit length (``info.normalized``)."""
        return self.info.normalized

    @classmethod
    def load(cls, options: HFOptions) -> HFBackend:
        """Load model and tokenizer as ``options`` say; every refusal is a ConfigError."""
        source = resolve_model(options.model)
        st, sparse = SentenceTransformerConfig(), None
        if options.task in ("embed", "rerank"):
            st = read_sentence_transformer_config(source, options.task)
        elif options.task == "sparse":
            st, sparse = _sparse_layout(source, options)
        tokenizer_path = tokenizer_json(source, st.subfolder)
        device = resolve_device(options.device)
        dtype = resolve_dtype(options.dtype, device, explicit_device=options.device != "auto")
        autocast = resolve_autocast(options.dtype, device)  # refused here, before the load
        if device.type == "cpu":
            bound_library_caches()  # before any forward creates the caches
        # A sparse model stays on torch whatever --runtime auto would pick (see _sparse_layout).
        runtime: Runtime = (
            "torch"
            if sparse is not None
            else resolve_runtime(options.runtime, device, autocast or dtype)
        )
        check_quantize(options, runtime)  # before the slow load
        tokenizer, model = load_pretrained(source, st.subfolder, options, dtype)
        model.to(device).eval()
        head = None
        if options.task == "embed":
            head = build_embedding_head(source, st, options, int(model.config.hidden_size), device)
        max_input = max_input_tokens(source, st.max_seq_length, tokenizer, model.config, options)
        encoder, runtime_facts = build_encoder(
            runtime,
            model,
            tokenizer,
            source,
            st.subfolder,
            options,
            finish=None if head is None else (lambda output, mask: head(output, mask, None)),
            max_input=max_input,
            autocast=autocast,
        )
        info = _describe(
            source,
            st,
            options,
            head,
            model.config,
            max_input=max_input,
            device=device,
            # bf16-mixed reads "bfloat16-mixed": what the products run in, and that it is mixed
            dtype=str(autocast or dtype).removeprefix("torch.") + ("-mixed" if autocast else ""),
            tokenizer_path=tokenizer_path,
            runtime=runtime,
            sparse=sparse,
            runtime_facts=runtime_facts,
        )
        log.info(
            "hf backend: %s task=%s device=%s dtype=%s max_input_tokens=%d %s",
            info.model,
            options.task,
            info.device,
            info.dtype,
            info.max_input_tokens,
            " ".join(f"{k}={v}" for k, v in info.extra.items() if k not in ("hf_task", "path")),
        )
        return cls(
            info=info,
            encoder=encoder,
            tokenizer=tokenizer,
            device=device,
            head=head,
            lowercase=st.do_lower_case,
            sparse=sparse,
        )

    # -- tokenization -------------------------------------------------------

    def tokenize(self, inputs: Sequence[TextInput], max_length: int | None) -> list[HFEncoding]:
        """Tokenize with the fast tokenizer in one batch call per kind of input.

        A prompt goes before the text (the first of a pair); truncation keeps the special
        tokens, pairs are cut 'longest_first'; ``max_length=None`` means none.
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
            texts = [self._prepare(inputs[i].prompt + inputs[i].text) for i in indices]
            pieces: list[Any] = texts
            if is_pair:
                pieces = [(text, self._prepare(inputs[i].text_pair or ""))
                          for text, i in zip(texts, indices, strict=True)]
            with self._tokenizer_lock:
                encodings, cut = self._prefix.encode(pieces, max_length)
                prompts = {p: self._prompt_lengths(p) for p in {inputs[i].prompt for i in indices}}
            for row, i in enumerate(indices):
                encoding = encodings[row]
                out[i] = HFEncoding(tuple(encoding.ids),
                                    tuple(encoding.type_ids) if is_pair else None,
                                    prompts[inputs[i].prompt], tokens=inputs[i].tokens,
                                    truncated=cut[row])
        return [enc for enc in out if enc is not None]

    def windows(self, encoding: HFEncoding, max_length: int, overlap: int) -> list[HFEncoding]:
        """Sliding windows of an over-long embedding input (the 'chunk' policy); each is
        embedded as ``prompt + piece`` with its special tokens put back.
        """
        if self._hf_task != "embed":
            raise ValueError("chunking applies to embeddings only; this model scores inputs")
        if encoding.is_pair:
            raise ValueError("a (text, text_pair) input cannot be chunked")
        if max_length > self.info.max_input_tokens:
            raise ValueError(
                f"window length {max_length} exceeds the model's {self.info.max_input_tokens}"
            )
        if encoding.length <= max_length:
            return [encoding]
        if self._special_layout is None:
            raise ValueError("cannot tell where this tokenizer puts its special tokens")
        n_prefix, n_suffix = self._special_layout
        n_prefix = min(max(n_prefix, encoding.prompt_length), encoding.length - n_suffix)
        ids = sliding_windows(encoding.ids, n_prefix, n_suffix, max_length, overlap)
        return [HFEncoding(window, None, encoding.prompt_length) for window in ids]

    def _check_inputs(self, inputs: Sequence[TextInput]) -> None:
        for i, item in enumerate(inputs):
            if self._hf_task in ("embed", "sparse") and item.text_pair is not None:
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

    def _prompt_ids(self, prompt: str) -> list[int]:
        """The prompt alone, special tokens included (tokenizer lock held; uncached prompts only).
        """
        ids = self._tokenizer(
            self._prepare(prompt),
            add_special_tokens=True,
            truncation=True,
            max_length=self.info.max_input_tokens,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,
        )["input_ids"]
        return list(ids)

    # -- inference ----------------------------------------------------------

    def run(self, batch: Sequence[HFEncoding]) -> list[np.ndarray]:
        """Pad to the batch's longest row, run the model, return one float32 row each.

        A CUDA OOM becomes :class:`DeviceOutOfMemory` after the cache is emptied.
        """
        if not batch:
            return []
        if self._encoder is None:
            raise RuntimeError("the hf backend is closed")
        tensors = self._pad(batch)
        if self._skip_forward:
            return [np.zeros(self.info.dim or 1, dtype=np.float32) for _ in batch]
        token_rows = [(row, enc.length) for row, enc in enumerate(batch) if enc.tokens]
        try:
            result = self._forward(*tensors, token_rows=token_rows)
        except torch.cuda.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0] if str(exc) else "CUDA out of memory"
        except RuntimeError as exc:
            if is_device_lost(exc):
                raise DeviceLost(f"the CUDA device failed: {str(exc).splitlines()[0]}") from exc
            raise
        else:
            if self._heap is not None:
                self._heap.after_forward()
            return result
        # Outside the except block, so the traceback (and the failed forward's
        # activations) is gone and the cache can really be emptied.
        torch.cuda.empty_cache()
        shape = tuple(tensors[0].shape)
        raise DeviceOutOfMemory(f"batch of {shape[0]} rows x {shape[1]} tokens: {message}")

    def _pad(self, batch: Sequence[HFEncoding]) -> tuple[torch.Tensor, ...]:
        """ids, attention mask, type ids (rows x longest) and each row's prompt length."""
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
        prompts = np.zeros(len(batch), dtype=np.int64)
        for row, enc in enumerate(batch):
            ids[row, : enc.length] = enc.ids
            mask[row, : enc.length] = 1
            if enc.type_ids is not None:
                type_ids[row, : enc.length] = enc.type_ids
            prompts[row] = enc.prompt_length
        return tuple(torch.from_numpy(a).to(self.device) for a in (ids, mask, type_ids, prompts))

    @torch.inference_mode()
    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        type_ids: torch.Tensor,
        prompt_lengths: torch.Tensor,
        *,
        token_rows: Sequence[tuple[int, int]] = (),
    ) -> list[np.ndarray]:
        """One row per input: pooled (or scores, or sparse weights); for each of
        ``token_rows`` (row, length), that row's token vectors flattened instead."""
        assert self._encoder is not None
        output = self._encoder(ids, mask, type_ids)
        if self.head is not None:
            vectors = self.head(output, mask, prompt_lengths)
        elif self.sparse is not None:
            vectors = self.sparse(output, mask)
        else:
            vectors = output.float()
        rows = list(vectors.cpu().numpy().astype(np.float32, copy=False))
        for row, length in token_rows:
            rows[row] = output[row, :length].float().cpu().numpy().reshape(-1)
        return rows

    def close(self) -> None:
        """Drop the model and give its device memory back."""
        self._encoder = None
        self.head = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


# -- what the model is --------------------------------------------------------


def _describe(
    source: ModelSource,
    st: SentenceTransformerConfig,
    options: HFOptions,
    head: EmbeddingHead | None,
    config: Any,
    *,
    max_input: int,
    device: torch.device,
    dtype: str,
    tokenizer_path: str | None,
    runtime: Runtime,
    sparse: SparseHead | None = None,
    runtime_facts: dict[str, Any] | None = None,
) -> BackendInfo:
    """The model's :class:`BackendInfo`; ``runtime_facts`` is what the runtime measured at start."""
    task = options.task
    extra: dict[str, Any] = {
        "hf_task": task,
        "path": source.location,
        "runtime": runtime,
        **(runtime_facts or {}),
    }
    activation: Activation = "none"
    if head is not None:
        extra.update(head.describe())
    elif sparse is not None:
        extra.update(sparse.describe())
    else:
        activation = (
            rerank_activation(source.name, st.activation_fn, config)
            if task == "rerank"
            else classify_activation(config)
        )
        extra["activation"] = activation
    if options.trust_remote_code:
        extra["trust_remote_code"] = True
    return BackendInfo(
        name="hf",
        model=source.name,
        task=task,
        max_input_tokens=max_input,
        padded=True,
        dim=_dim(head, sparse, config),
        device=str(device),
        dtype=dtype,
        tokenizer=tokenizer_path,
        pairs=task == "rerank",
        normalized=head is not None and head.normalize,
        labels=_labels(config, task),
        raw_vectors=head is not None,
        activation=activation,
        prompts=dict(st.prompts),
        default_prompt_name=st.default_prompt_name,
        # The encoder's hidden states are what an embedder's output: tokens answers.
        token_dim=int(config.hidden_size) if head is not None else None,
        pooling="+".join(head.modes) if head is not None else None,
        extra=extra,
    )


def _dim(head: EmbeddingHead | None, sparse: SparseHead | None, config: Any) -> int:
    """The row's length: the embedding's, the vocabulary's (sparse), or the labels' count."""
    if head is not None:
        return head.dim
    return int(config.vocab_size) if sparse is not None else int(config.num_labels)


def _sparse_layout(
    source: ModelSource, options: HFOptions
) -> tuple[SentenceTransformerConfig, SparseHead]:
    """A SPLADE model's layout; ``--runtime onnx`` is refused (the export takes no MLM head)."""
    if options.runtime == "onnx":
        raise ConfigError(
            f"model {source.name!r}: --task sparse runs on --runtime torch only "
            "(the ONNX export does not take a masked-LM head)"
        )
    sparse = read_sparse_config(source)
    st = SentenceTransformerConfig(
        present=True,
        subfolder=sparse.subfolder,
        max_seq_length=sparse.max_seq_length,
        do_lower_case=sparse.do_lower_case,
        prompts=sparse.prompts,
        default_prompt_name=sparse.default_prompt_name,
    )
    return st, SparseHead(sparse)


def _labels(config: Any, task: HFTask) -> tuple[str, ...]:
    """A classifier's label names by score index (``id2label``), else none."""
    if task in ("embed", "sparse"):
        return ()
    names = getattr(config, "id2label", None) or {}
    return tuple(str(names.get(i, i)) for i in range(int(config.num_labels)))


def _special_token_layout(tokenizer: Any) -> tuple[int, int] | None:
    """How many special tokens go before and after one sequence, found by a probe (any template)."""
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
