"""What one HTTP request may cost the gateway and Redis: admission, body size and time, a linear
JSON decode (in a child process when big), the amplification and answer caps (docs/SECURITY.md)."""

from __future__ import annotations

import asyncio
import json
import operator
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, compress, islice
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from tokenq.producer.core import TextItem
from tokenq.producer.serve.errors import ApiError, invalid, too_large
from tokenq.shared.wire import MAX_TOKEN_EMBEDDING_FLOATS

if TYPE_CHECKING:
    from starlette.requests import Request

T = TypeVar("T")

MAX_AMPLIFICATION = 32
"""Most bytes of text and options one request may send to its queue, per byte of its body
(only a field copied into every input, a rerank's query, can exceed 1)."""

PARSE_MEMORY_FACTOR = 40
"""Peak memory of decoding and validating a body, per byte of it (worst: ``[{},{},...]``)."""

OFFLOAD_BYTES = 256 * 1024
"""Bodies larger than this are decoded in a child process, so the event loop keeps going."""

PARENT_POLL_S = 1.0
"""How often a parser process checks that the gateway that started it is still there."""

PARSE_PROCESSES = 2
"""Big bodies decoded at once; more wait their turn (each expands to up to 40× its size)."""


@dataclass
class Admission:
    """At most ``limit`` requests in flight; one over it is a 429, not queued (TEI's rule)."""

    limit: int
    in_flight: int = 0

    @contextmanager
    def admit(self) -> Iterator[None]:
        if self.in_flight >= self.limit:
            raise ApiError(429, f"Model is overloaded: {self.limit} requests in flight, the "
                           "most --max-concurrent-requests allows; retry later",
                           code="overloaded", headers={"Retry-After": "1"})
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body: 413 as soon as it is over ``limit`` bytes, 408 if it takes over
    ``timeout_s``, 499 if the client leaves before sending it all."""
    from starlette.requests import ClientDisconnect  # here: schemas need no web framework

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large("body", f"{declared} bytes, over the limit of {limit}")
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large("body", f"over the limit of {limit} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)  # asyncio.timeout: Python 3.11 on
    except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
        raise ApiError(408, f"body: not received within {timeout_s} s (--timeout-s)",
                       param="body", code="timeout") from None
    except ClientDisconnect:
        raise ApiError(499, "the client went away", code="client_closed") from None
    return b"".join(chunks)


class Parser:
    """Makes a body into a job: inline when small, else in a ``spawn``ed child process (the
    C JSON decoder holds the GIL; a thread would stop the loop). ``prepare`` must be
    module-level (pickled by name)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def run(self, raw: bytes, prepare: Callable[[bytes], T]) -> T:
        if len(raw) <= OFFLOAD_BYTES:
            return prepare(raw)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(PARSE_PROCESSES, get_context("spawn"),
                                             initializer=_parser_started, initargs=(os.getpid(),))
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, prepare, raw)
        except BrokenProcessPool:  # a child died (killed for memory?): start afresh
            self.close()
            raise ApiError(503, "the body's parser process died; retry later",
                           code="unavailable") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _parser_started(gateway: int) -> None:
    """In each parser process: leave Ctrl-C to the gateway, and end when the gateway does
    (a pool's process never sees its parent go, even a SIGKILLed one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == gateway:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="tokenq-parent-watch", daemon=True).start()


def decode_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (an empty body is ``{}``); 400 naming ``body`` for one that
    is not JSON (as OpenAI and TEI answer), 422 for JSON that is not an object."""
    try:
        document = json.loads(raw) if raw else {}
    except RecursionError:
        raise malformed("nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an integer of 4,300+ digits
        raise malformed(f"not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise invalid("body", f"expected a JSON object, got {kind(document)}")
    return document


def malformed(message: str) -> ApiError:
    """400: the body cannot be read as JSON at all."""
    return ApiError(400, f"body: {message}", param="body", code="invalid_json")


def kind(value: object) -> str:
    """A JSON value's kind as an error message names it."""
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
            list: "a list", dict: "an object", type(None): "null"}.get(type(value), "a value")


@dataclass(frozen=True, slots=True)
class Variant:
    """What the items of an input list may be: a type in ``flat``, or a list of types in
    ``nested``; checked by types alone in C-level passes, linear in the list."""

    flat: frozenset[type]
    nested: frozenset[type] | None
    expected: str

    def fits(self, item: object) -> bool:
        if type(item) in self.flat:
            return True
        return (self.nested is not None and type(item) is list
                and self.nested.issuperset(map(type, item)))

    def first_misfit(self, items: list[Any]) -> int | None:
        """The index of the first item that does not fit, or None; linear, no copies."""
        outer = self.flat | ({list} if self.nested is not None else set())
        types = set(map(type, items))
        end = len(items)
        if not types <= outer:  # the first item of a type that fits nothing
            end = operator.indexOf(map(outer.__contains__, map(type, items)), False)
            types = set(map(type, islice(items, end)))
        if self.nested is None or list not in types:
            return end if end < len(items) else None
        head = islice(items, end)
        lists = head if types == {list} else compress(head, map(is_list, islice(items, end)))
        if self.nested.issuperset(map(type, chain.from_iterable(lists))):
            return end if end < len(items) else None
        if types == {list}:  # each list's item types, still without a Python loop
            return operator.indexOf(
                map(self.nested.issuperset, map(types_of, islice(items, end))), False)
        return next(index for index, item in enumerate(items) if not self.fits(item))


def is_list(value: object) -> bool:
    return type(value) is list


def types_of(items: list[Any]) -> map:
    return map(type, items)


TEXT = Variant(frozenset({str}), None, "a string")
TOKEN = Variant(frozenset({int}), None, "a token id")  # bool is not: its type is bool
TEXTS = Variant(frozenset(), frozenset({str}), "a list of strings")
TOKENS = Variant(frozenset(), frozenset({int}), "a list of token ids")
TEXT_OR_TOKENS = Variant(frozenset({str}), frozenset({int}), "a string or a list of token ids")


def text_or_list(value: Any, where: str, variants: Sequence[Variant]) -> Any:
    """``value`` if it is a string, or a list whose items all fit the variant its first item
    fits (else the last); else a 422. A union of list types, without trying each in turn."""
    if type(value) is str:
        return value
    if type(value) is not list:
        raise invalid(where, f"expected a string or a list, got {kind(value)}")
    if value:
        variant = next((v for v in variants if v.fits(value[0])), variants[-1])
        check_each(value, where, variant)
    return value


def check_each(items: list[Any], where: str, variant: Variant) -> None:
    """The first item that does not fit ``variant`` is a 422 naming its index."""
    index = variant.first_misfit(items)
    if index is not None:
        raise invalid(f"{where}[{index}]", f"expected {variant.expected}, got "
                      f"{kind(items[index])} (a list holds inputs of one kind, its first's)")


def text_bytes(items: Sequence[TextItem]) -> int:
    """UTF-8 bytes of every text and pair; a text shared by many items is measured once."""
    sizes: dict[int, int] = {}

    def size(text: str) -> int:
        known = sizes.get(id(text))
        if known is None:
            known = sizes[id(text)] = (len(text) if text.isascii()
                                       else len(text.encode("utf-8", "surrogatepass")))
        return known

    total = 0
    for item in items:
        if isinstance(item, tuple):
            total += size(item[0]) + size(item[1])
        else:
            total += size(item)
    return total


def check_job(items: list[TextItem], options: dict[str, Any], where: str, body_bytes: int,
              max_items: int) -> None:
    """413 for more than ``max_items`` inputs, or for more than :data:`MAX_AMPLIFICATION`
    times ``body_bytes`` of text and options to send (the options go with every input)."""
    if len(items) > max_items:
        raise too_large(where, f"{len(items)} inputs, over the limit of {max_items} per request")
    options_bytes = len(msgpack.packb(options, use_bin_type=True)) if options else 0
    sent = text_bytes(items) + options_bytes * len(items)
    limit = MAX_AMPLIFICATION * max(body_bytes, 1)
    if sent > limit:
        raise too_large(where, f"{sent} bytes of text and options would be sent to the queue, "
                        f"over {MAX_AMPLIFICATION} times the body's {body_bytes} bytes; a "
                        "field shared by every input (a rerank's query) counts once per input")


MAX_TOKEN_ANSWER_FLOATS = 4 * 1024 * 1024
"""Most floats one ``/embed_all`` answer may hold (inputs x tokens x token_dim): 16 MiB
as float32; checked before sending, for every input at the model's input limit."""


def check_token_answer(count: int, max_input_tokens: int | None, token_dim: int | None,
                       where: str) -> None:
    """413 when ``count`` inputs' token embeddings could exceed :data:`MAX_TOKEN_ANSWER_FLOATS`
    (without the model's limits, each worker bounds its own reply)."""
    if not max_input_tokens or not token_dim:
        return
    each = min(max_input_tokens * token_dim, MAX_TOKEN_EMBEDDING_FLOATS)  # a worker's own cap
    if count * each > MAX_TOKEN_ANSWER_FLOATS:
        raise too_large(where, f"{count} inputs of up to {max_input_tokens} tokens x "
                        f"{token_dim} floats could answer {count * each} floats, over the "
                        f"limit of {MAX_TOKEN_ANSWER_FLOATS}: send at most "
                        f"{max(1, MAX_TOKEN_ANSWER_FLOATS // each)} inputs per request")


MAX_TOKENIZE_BYTES = 512 << 10
"""Most UTF-8 bytes of text (prompts included) one ``/tokenize`` may tokenize; checked before
the tokenizer runs (TEI's ``/tokenize`` has no ``truncate``: more is refused)."""

MAX_TOKENIZE_TOKENS = 1 << 17
"""Most tokens one ``/tokenize`` answers (about 65 bytes of JSON each, 8.5 MB in all):
counted in pieces, then exactly, before any record is built (``tei_api.count_tokens``)."""

MAX_DECODE_BYTES = 16 << 20
"""Most UTF-8 bytes of text one ``/decode`` may answer, counting each id at the longest token
of the vocabulary plus a space: checked before the tokenizer runs."""


def check_count(count: int, limit: int, what: str, where: str, hint: str) -> None:
    """413 naming ``limit`` when ``count`` ``what`` exceed it; ``hint`` says what to do."""
    if count > limit:
        raise too_large(where, f"{count} {what}, over the limit of {limit} per request; {hint}")
