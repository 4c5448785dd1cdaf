"""The Hugging Face transformers backend (``--backend hf``): embed, classify, rerank, sparse;
fast tokenizer, batches right-padded under a mask, eager torch or ONNX Runtime, float32 rows."""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tokenq.shared.errors import BadRequest, DeviceLost, DeviceOutOfMemory
from tokenq.worker.backends.base import BackendInfo, TextInput
from tokenq.worker.backends.chunks import sliding_windows
from tokenq.worker.backends.hf import layout, runtime
from tokenq.worker.backends.hf import load as files
from tokenq.worker.backends.hf.encoding import HFEncoding, flat_rows, pad_rows, prompt_lengths
from tokenq.worker.backends.hf.head import EmbeddingHead, SparseHead, build_embedding_head
from tokenq.worker.backends.hf.heap_trim import HeapTrimmer, bound_library_caches
from tokenq.worker.backends.hf.prefix import PrefixTokenizer
from tokenq.worker.backends.hf.settings import HFOptions

log = logging.getLogger(__name__)


# Benchmarks only (run.py feed): 1 answers zeros instead of running the model, so a worker's
# own CPU around the forward can be measured.
SKIP_FORWARD_ENV = "TOKENQ_BENCH_SKIP_FORWARD"


def build_hf_backend(settings: Any) -> HFBackend:
    """The worker's factory for ``--backend hf``."""
    return HFBackend.load(HFOptions.from_settings(settings))


class HFBackend:
    """A transformers model behind the :class:`~tokenq.worker.backends.base.Backend` protocol."""

    def __init__(
        self, info: BackendInfo, encoder: runtime.Encoder, tokenizer: Any, *,
        head: EmbeddingHead | None = None, sparse: SparseHead | None = None,
        lowercase: bool = False, source: files.ModelSource | None = None,
    ) -> None:
        self.info = info
        self._source = source
        self.device = torch.device(info.device)
        self.head = head
        self.sparse = sparse
        self._encoder: runtime.Encoder | None = encoder
        self._tokenizer = tokenizer
        # Truncation is state on a tokenizer, set before each call (by the transformers
        # wrapper on the shared Rust one, by the PrefixTokenizer on its own): one call at a time.
        self._tokenizer_lock = threading.Lock()
        self._prefix = PrefixTokenizer(tokenizer.backend_tokenizer, tokenizer.truncation_side)
        self._lowercase = lowercase
        self._pad_id = files.pad_token_id(tokenizer)
        self._special_layout = _special_token_layout(tokenizer)
        self._min_length = {
            False: tokenizer.num_special_tokens_to_add(pair=False) + 1,
            True: tokenizer.num_special_tokens_to_add(pair=True) + 2,
        }
        self._prompt_lengths = prompt_lengths(self._prompt_ids, set(tokenizer.all_special_ids))
        # On the CPU the heap grows with every new batch shape (heap_trim explains).
        self._heap = HeapTrimmer() if self.device.type == "cpu" else None
        self._skip_forward = os.environ.get(SKIP_FORWARD_ENV) == "1"
        if self._skip_forward:
            log.warning("%s=1: the model's forward is skipped, every answer is zeros",
                        SKIP_FORWARD_ENV)

    @property
    def pooling(self) -> tuple[str, ...]:
        """The pooling modes, in concatenation order (empty for a scoring model)."""
        return self.head.modes if self.head else ()

    @classmethod
    def load(cls, options: HFOptions) -> HFBackend:
        """Load model and tokenizer as ``options`` say; every refusal is a ConfigError."""
        task = options.task
        source = files.resolve_model(options.model)
        st = layout.read_sentence_transformer_config(source, task)
        sparse = None if st.splade is None else SparseHead(*st.splade)
        tokenizer_path = files.tokenizer_json(source, st.subfolder)
        device = runtime.resolve_device(options.device)
        explicit = options.device != "auto"
        dtype = runtime.resolve_dtype(options.dtype, device, explicit_device=explicit)
        autocast = runtime.resolve_autocast(options.dtype, device)  # refused before the load
        if device.type == "cpu":
            bound_library_caches()  # before any forward creates the caches
        engine = runtime.resolve_runtime(options, device, autocast or dtype)  # before the load
        tokenizer, model = files.load_pretrained(source, st.subfolder, options, dtype)
        model.to(device).eval()
        config = model.config
        head = None
        if task == "embed":
            head = build_embedding_head(source, st, options, int(config.hidden_size), device)
        max_input = files.max_input_tokens(source, st.max_seq_length, tokenizer, config, options)
        encoder, runtime_facts = runtime.build_encoder(
            engine, model, tokenizer, source, st.subfolder, options,
            finish=None if head is None else (lambda output, mask: head(output, mask, None)),
            max_input=max_input, autocast=autocast,
        )
        extra: dict[str, Any] = {"hf_task": task, "path": source.location, "runtime": engine,
                                 **runtime_facts}
        activation, labels = "none", ()
        if head is not None:
            extra.update(head.describe())
            dim = head.dim
        elif sparse is not None:
            extra.update(sparse.describe())
            dim = int(config.vocab_size)
        else:  # a scorer: its activation, and each score's label name
            activation = extra["activation"] = (
                layout.rerank_activation(source.name, st.activation_fn, config) if task == "rerank"
                else layout.classify_activation(config)
            )
            dim = int(config.num_labels)
            names = getattr(config, "id2label", None) or {}
            labels = tuple(str(names.get(i, i)) for i in range(dim))
        if options.trust_remote_code:
            extra["trust_remote_code"] = True
        info = BackendInfo(
            name="hf", model=source.name, task=task, max_input_tokens=max_input, padded=True,
            dim=dim, device=str(device), tokenizer=tokenizer_path, pairs=task == "rerank",
            # bf16-mixed reads "bfloat16-mixed": what the products run in, and that it is mixed
            dtype=str(autocast or dtype).removeprefix("torch.") + ("-mixed" if autocast else ""),
            normalized=head is not None and head.normalize, labels=labels,
            raw_vectors=head is not None, activation=activation,  # type: ignore[arg-type]
            prompts=dict(st.prompts), default_prompt_name=st.default_prompt_name,
            # The encoder's hidden states are what an embedder's output: tokens answers.
            token_dim=int(config.hidden_size) if head is not None else None,
            pooling="+".join(head.modes) if head is not None else None, extra=extra,
        )
        log.info(
            "hf backend: %s task=%s device=%s dtype=%s max_input_tokens=%d %s",
            info.model, task, info.device, info.dtype, info.max_input_tokens,
            " ".join(f"{k}={v}" for k, v in extra.items() if k not in ("hf_task", "path")),
        )
        return cls(info, encoder, tokenizer, head=head, sparse=sparse, lowercase=st.do_lower_case,
                   source=source)

    def weights_identity(self) -> str:
        """The result cache's name for these weights (``load.weights_identity``)."""
        return "" if self._source is None else files.weights_identity(self._source)

    def tokenize(self, inputs: Sequence[TextInput], max_length: int | None) -> list[HFEncoding]:
        """One fast-tokenizer call per kind of input (single, pair); the prompt goes before the
        text, truncation keeps the specials and cuts pairs 'longest_first'."""
        out: list[HFEncoding | None] = [None] * len(inputs)
        task = self.info.task
        pairs = [i for i, item in enumerate(inputs) if item.text_pair is not None]
        for is_pair in (False, True):
            indices: Sequence[int] = pairs if is_pair else range(len(inputs)) if not pairs else [
                i for i, item in enumerate(inputs) if item.text_pair is None]
            if not indices:
                continue
            if task != "classify" and is_pair != (task == "rerank"):
                raise BadRequest(
                    f"input {indices[0]} is a (text, text_pair) pair, but {self.info.model} is "
                    "an embedding model: send one text per input" if is_pair
                    else f"input {indices[0]} has no text_pair: a rerank (cross-encoder) model "
                    "scores (query, passage) pairs"
                )
            if max_length is not None and max_length < self._min_length[is_pair]:
                raise ValueError(
                    f"max_length {max_length} is shorter than the special tokens need "
                    f"({self._min_length[is_pair]})"
                )
            texts = [inputs[i].prompt + inputs[i].text for i in indices]
            if self._lowercase:
                texts = [text.lower() for text in texts]
            pieces: list[Any] = texts
            if is_pair:
                pieces = [(text, self._prepare(inputs[i].text_pair or ""))
                          for text, i in zip(texts, indices, strict=True)]
            with self._tokenizer_lock:
                encodings, cut = self._prefix.encode(pieces, max_length)
                prompts = {p: self._prompt_lengths(p) for p in {inputs[i].prompt for i in indices}}
            ids = flat_rows([e.ids for e in encodings])
            types = flat_rows([e.type_ids for e in encodings]) if is_pair else [None] * len(ids)
            for i, row, type_row, truncated in zip(indices, ids, types, cut, strict=True):
                item = inputs[i]
                out[i] = HFEncoding(row, type_row, prompts[item.prompt], item.tokens, truncated)
        return out  # type: ignore[return-value]  # each input is a pair or not: all filled

    def windows(self, encoding: HFEncoding, max_length: int, overlap: int) -> list[HFEncoding]:
        """Sliding windows of an over-long embedding input (the 'chunk' policy), each
        ``prompt + piece`` with its special tokens put back."""
        if self.info.task != "embed":
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
        return [HFEncoding(np.array(window), None, encoding.prompt_length) for window in ids]

    def _prepare(self, text: str) -> str:
        return text.lower() if self._lowercase else text

    def _prompt_ids(self, prompt: str) -> list[int]:
        """The prompt alone, special tokens included (tokenizer lock held)."""
        ids = self._tokenizer(
            self._prepare(prompt), add_special_tokens=True, truncation=True,
            max_length=self.info.max_input_tokens, return_attention_mask=False,
            return_token_type_ids=False, verbose=False,
        )["input_ids"]
        return list(ids)

    def run(self, batch: Sequence[HFEncoding]) -> list[np.ndarray]:
        """Pad to the batch's longest row, run the model, return one float32 row each; a CUDA
        OOM becomes :class:`DeviceOutOfMemory` after the cache is emptied."""
        if not batch:
            return []
        if self._encoder is None:
            raise RuntimeError("the hf backend is closed")
        tensors = self._pad(batch)
        if self._skip_forward:
            return list(np.zeros((len(batch), self.info.dim or 1), dtype=np.float32))
        token_rows = [(row, enc.length) for row, enc in enumerate(batch) if enc.tokens]
        try:
            result = self._forward(*tensors, token_rows=token_rows)
        except torch.cuda.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0] if str(exc) else "CUDA out of memory"
        except RuntimeError as exc:
            text = str(exc)
            if "CUDA error" in text and any(part in text for part in _STICKY_CUDA_ERRORS):
                raise DeviceLost(f"the CUDA device failed: {text.splitlines()[0]}") from exc
            raise
        else:
            if self._heap is not None:
                self._heap.after_forward()
            return result
        # Outside the except block: the failed forward's activations are freed by now.
        torch.cuda.empty_cache()
        shape = tuple(tensors[0].shape)
        raise DeviceOutOfMemory(f"batch of {shape[0]} rows x {shape[1]} tokens: {message}")

    def _pad(self, batch: Sequence[HFEncoding]) -> tuple[torch.Tensor, ...]:
        """ids, attention mask, type ids (rows x longest) and each row's prompt length."""
        for i, enc in enumerate(batch):
            if not isinstance(enc, HFEncoding):
                raise TypeError(f"row {i} is a {type(enc).__name__}, not an HFEncoding")
            if not 0 < enc.length <= self.info.max_input_tokens:
                raise ValueError(
                    f"row {i} has {enc.length} tokens; the model takes 1 to "
                    f"{self.info.max_input_tokens} (truncate or chunk it first)"
                )
        prompts = np.array([enc.prompt_length for enc in batch], dtype=np.int64)
        arrays = (*pad_rows(batch, self._pad_id), prompts)
        return tuple(torch.from_numpy(a).to(self.device) for a in arrays)

    @torch.inference_mode()
    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, type_ids: torch.Tensor,
        prompt_lengths: torch.Tensor, *, token_rows: Sequence[tuple[int, int]] = (),
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


def _special_token_layout(tokenizer: Any) -> tuple[int, int] | None:
    """How many special tokens go before and after one sequence, found by a probe (any template)."""
    bare = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    full = tokenizer("hello world", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return start, len(full) - start - len(bare)
    return None


_STICKY_CUDA_ERRORS = (  # after these the CUDA context is unusable until the process restarts
    "illegal memory access", "device-side assert", "unspecified launch failure",
    "an illegal instruction", "misaligned address", "uncorrectable ECC error", "device not ready",
    "GPU is lost",
)
