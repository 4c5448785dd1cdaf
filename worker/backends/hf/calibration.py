"""The calibration set and the measurement behind ``--quantize int8``'s gate.

:class:`Calibration` runs the fp32 graph once and measures each candidate as the
worker returns rows (docs/MODELS.md, "Runtimes"); :mod:`~tokenq.worker.backends.hf.quantize`
decides what to serve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "CALIBRATION_MAX_TOKENS",
    "CALIBRATION_PAIRS",
    "CALIBRATION_TEXTS",
    "Calibration",
    "Encoder",
    "Finish",
    "GateReport",
    "Int8Request",
    "calibration_batches",
]

CALIBRATION_MAX_TOKENS = 128
CALIBRATION_BATCH = 8

CALIBRATION_TEXTS: tuple[str, ...] = (
    "x",
    "42",
    "how do I reset my password",
    "weather tomorrow in lisbon",
    "cheap flights to tokyo",
    "python list comprehension example",
    "What is the capital of Australia?",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé — déjà vu",
    "def add(a, b):\n    return a + b  # the sum",
    "The mitochondrion is the powerhouse of the cell: it produces most of the chemical "
    "energy needed to power the cell's biochemical reactions, stored as ATP.",
    "In 1969 Apollo 11 landed on the Moon. Neil Armstrong and Buzz Aldrin walked on the "
    "surface while Michael Collins orbited above in the command module, and the crew "
    "returned safely to Earth eight days after launch.",
    "A work queue packs requests into batches by token budget, so that a GPU is kept busy "
    "without any single batch running out of memory; producers push requests onto a "
    "stream, workers pull, pack within their own budget, run the model and push each "
    "reply to the request's key. " * 3,
    "东京是日本的首都，也是世界上人口最多的城市之一。",
    "猫在桌子上睡觉",
    "Москва — столица России и крупнейший город страны.",
    "Где находится ближайшая аптека?",
    "مرحبا بالعالم",
    "¿Dónde está la biblioteca?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
)
"""Short queries and long passages, English and other scripts: where int8 errors show."""

CALIBRATION_PAIRS: tuple[tuple[str, str], ...] = tuple(
    (query, passage)
    for query in ("how do I reset my password", "what is the capital of australia", "猫")
    for passage in (
        CALIBRATION_TEXTS[10],
        CALIBRATION_TEXTS[11],
        "Canberra is the capital city of Australia.",
        "To reset your password, open settings and choose 'forgot password'.",
        CALIBRATION_TEXTS[12],
        CALIBRATION_TEXTS[13],
    )
)
"""(query, passage) pairs, relevant and not, for a cross-encoder."""

Encoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Finish = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(transformer output, attention mask) -> the rows the worker returns."""


@dataclass(frozen=True, slots=True)
class Int8Request:
    """What the gate needs from the backend: the refusal's wording, the tokenizer, the head."""

    model: str
    """Named in the refusal."""
    min_cosine: float
    tokenizer: Any
    pad_id: int
    pairs: bool
    """A cross-encoder: calibrate on (query, passage) pairs."""
    max_tokens: int
    finish: Finish | None
    """The embedding head; None: the output is the rows (logits), compared per label."""


@dataclass(frozen=True, slots=True)
class GateReport:
    """What the calibration measured; :meth:`describe` goes into the backend's info."""

    min_cosine: float
    gate: float
    rows: int
    max_abs_diff: float
    compared: str
    fp32_nodes: int = 0
    """Quantisable nodes left in fp32 in the graph measured."""
    nodes: int = 0
    """Quantisable nodes in the graph (0: not counted)."""

    def describe(self) -> dict[str, Any]:
        return {
            "quantize": "int8",
            "quantize_cosine": round(self.min_cosine, 6),
            "quantize_fp32_nodes": self.fp32_nodes,
        }


class Calibration:
    """The fp32 graph's answers to the calibration set, run once; candidates compared to them."""

    def __init__(self, reference: Encoder, request: Int8Request) -> None:
        self.request = request
        self.batches = calibration_batches(request)
        self.want = self._answers(reference)

    def _answers(self, encoder: Encoder) -> np.ndarray:
        rows = []
        with torch.inference_mode():
            for ids, mask, type_ids in self.batches:
                output = encoder(ids, mask, type_ids)
                finish = self.request.finish
                answer = output if finish is None else finish(output, mask)
                rows.append(answer.float().numpy().astype(np.float64))
        return np.concatenate(rows)

    def measure(self, candidate: Encoder, *, fp32_nodes: int) -> GateReport:
        """``candidate`` on the calibration set, compared as the worker would return its rows."""
        a, b = self.want, self._answers(candidate)
        if self.request.finish is None:  # scores: each label's column over the set, centred
            lowest = _lowest_cosine((a - a.mean(0)).T, (b - b.mean(0)).T)
            compared = "scores (per label, centred)"
        else:
            lowest = _lowest_cosine(a, b)
            compared = "vectors"
            a, b = _unit(a), _unit(b)  # the difference as the default (normalised) answer shows
        return GateReport(
            min_cosine=lowest,
            gate=self.request.min_cosine,
            rows=len(a),
            max_abs_diff=float(np.abs(a - b).max()),
            compared=compared,
            fp32_nodes=fp32_nodes,
        )


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)


def _lowest_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The lowest cosine between matching rows; two rows that are both zero count as equal."""
    dots = (a * b).sum(-1)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    both_zero = (np.linalg.norm(a, axis=-1) < 1e-12) & (np.linalg.norm(b, axis=-1) < 1e-12)
    cosines = np.where(both_zero, 1.0, dots / np.maximum(norms, 1e-300))
    return float(cosines.min())


def calibration_batches(
    request: Int8Request,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The calibration set tokenized as the backend tokenizes, right-padded in small batches."""
    if request.pairs:
        firsts: Sequence[str] = [q for q, _ in CALIBRATION_PAIRS]
        seconds: Sequence[str] | None = [p for _, p in CALIBRATION_PAIRS]
    else:
        firsts, seconds = CALIBRATION_TEXTS, None
    encoded = request.tokenizer(
        list(firsts),
        list(seconds) if seconds is not None else None,
        add_special_tokens=True,
        truncation="longest_first",
        max_length=request.max_tokens,
        return_attention_mask=False,
        return_token_type_ids=request.pairs,
        verbose=False,
    )
    ids_rows = encoded["input_ids"]
    type_rows = encoded["token_type_ids"] if request.pairs else [None] * len(ids_rows)
    batches = []
    for start in range(0, len(ids_rows), CALIBRATION_BATCH):
        chunk = range(start, min(start + CALIBRATION_BATCH, len(ids_rows)))
        longest = max(len(ids_rows[i]) for i in chunk)
        ids = np.full((len(chunk), longest), request.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        type_ids = np.zeros_like(ids)
        for row, i in enumerate(chunk):
            length = len(ids_rows[i])
            ids[row, :length] = ids_rows[i]
            mask[row, :length] = 1
            if type_rows[i] is not None:
                type_ids[row, :length] = type_rows[i]
        batches.append((torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(type_ids)))
    return batches
