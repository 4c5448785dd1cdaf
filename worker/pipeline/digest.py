"""A request's digest: everything its answer depends on, hashed (the result cache's key and
what makes identical requests in flight one row: docs/OPERATIONS.md, "Result cache")."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

from tokenq.shared import wire
from tokenq.shared.queue_config import describe, encode_config
from tokenq.shared.request_options import RequestOptions
from tokenq.worker.backends.base import BackendInfo


def cache_scope(namespace: str, model_identity: str, policy: str) -> bytes:
    """The key every digest in one namespace (a queue's tenant) is made with: the namespace,
    the model's identity and the over-length policy."""
    return hashlib.blake2b(wire.pack([namespace, model_identity, policy]), digest_size=32).digest()


def request_digest(scope: bytes, request: wire.Request, options: RequestOptions, prompt: str,
                   truncates: bool) -> bytes:
    """What the answer depends on beyond ``scope`` (namespace, model identity, queue policy):
    the prompt, the options that shape the output, the truncation and the text, hashed."""
    hasher = _keyed(scope).copy()
    hasher.update(wire.pack([
        prompt, options.dimensions, options.normalize, options.raw_scores,
        options.output_tokens, truncates, request.text, request.text_pair,
    ]))
    return hasher.digest()


@functools.lru_cache(maxsize=1024)
def _keyed(scope: bytes) -> Any:
    """A blake2b keyed with ``scope``, to be copied: keying one costs more than hashing a short
    request's bytes, and a worker makes its digests under a handful of scopes."""
    return hashlib.blake2b(digest_size=16, key=scope)


def model_identity(info: BackendInfo, weights: str) -> str:
    """Which model answers, as exactly as the backend can say: its weights' digest or revision
    (``weights``: "" when it gives none) and every fact of it that changes an answer."""
    facts = encode_config(describe(info))
    return json.dumps([weights, facts, info.extra], sort_keys=True, default=str)
