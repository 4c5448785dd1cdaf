"""Request bodies and answers of each API, as their clients send and expect them.

Parsing is ours rather than FastAPI's, so a field that does not validate is
a 422 in the API's own error shape naming the field (``input``,
``encoding_format``), not FastAPI's generic body. What the gateway cannot do
yet is refused by name rather than ignored: OpenAI's ``dimensions`` and
TEI's ``normalize: false`` and ``prompt_name`` need per-request options on
the wire (issue 12's second part), and token-id input needs a worker that
takes token ids.
"""

from __future__ import annotations

import array
import base64
import sys
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from tokenq.producer import Result
from tokenq.producer.serve.errors import ApiError, invalid


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as both APIs do


class OpenAIEmbeddings(_Body):
    """``POST /v1/embeddings``."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class TEIEmbed(_Body):
    """``POST /embed`` (text-embeddings-inference)."""

    inputs: str | list[str]
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Literal["Right", "right", "Left", "left"] = "Right"
    prompt_name: str | None = None


def parse(model: type[_Body], raw: bytes) -> Any:
    """The body as ``model``, or a 422 naming the first field that does not validate."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "body"
        raise invalid(where, first.get("msg", "invalid")) from None


def openai_texts(body: OpenAIEmbeddings) -> list[str]:
    """The texts of an OpenAI request (a string or a list of strings)."""
    if body.dimensions is not None:
        raise invalid("dimensions", "not supported by this tokenq version; leave it out")
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise invalid("input", "must not be empty")
    if not all(isinstance(text, str) for text in texts):
        raise invalid("input", "token-id input is not supported: send text")
    return list(texts)  # type: ignore[arg-type]


def tei_texts(body: TEIEmbed, policy: str | None, normalized: bool | None) -> list[str]:
    """The texts of a TEI request, refusing what this version cannot honour by name."""
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not texts:
        raise invalid("inputs", "must not be empty")
    if body.prompt_name is not None:
        raise invalid("prompt_name", "not supported by this tokenq version; leave it out")
    if not body.normalize and normalized:
        raise invalid("normalize", "false is not supported: this queue's model normalises")
    if body.truncation_direction.lower() != "right":
        raise invalid("truncation_direction", "only Right is supported")
    if body.truncate is not None and policy is not None:
        if body.truncate and policy != "truncate":
            raise invalid("truncate", f"true, but this queue's policy is {policy!r}")
        if not body.truncate and policy == "truncate":
            raise invalid("truncate", "false, but this queue truncates over-long input")
    return list(texts)


def embeddings_of(results: Sequence[Result], model: str) -> list[Any]:
    """Each result's vector; 422 for a queue whose model answers scores."""
    vectors = []
    for result in results:
        if result.embedding is None:
            raise ApiError(
                422, f"model {model!r} answers scores (a classifier or reranker), "
                "not embeddings", param="model", code="not_an_embedding_model",
            )
        vectors.append(result.embedding)
    return vectors


def openai_answer(
    results: Sequence[Result], model: str, encoding_format: str
) -> dict[str, Any]:
    """OpenAI's list of embeddings, with usage from the workers' exact token counts."""
    vectors = embeddings_of(results, model)
    tokens = sum(result.tokens or 0 for result in results)
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": (
                _base64_le(vector) if encoding_format == "base64" else vector.tolist()
            ),
        }
        for index, vector in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _base64_le(vector: array.array) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian."""
    if sys.byteorder == "big":
        vector = array.array("f", vector)
        vector.byteswap()
    return base64.b64encode(vector.tobytes()).decode("ascii")


def tei_answer(results: Sequence[Result], model: str) -> list[list[float]]:
    """TEI's list of vectors, one per input, in input order."""
    return [vector.tolist() for vector in embeddings_of(results, model)]
