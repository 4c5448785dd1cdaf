"""A call's arguments into the requests the enqueue script writes: every early refusal, as a
:class:`BadRequest` naming the argument. No I/O, no clock (``now_ms`` comes in)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from tokenq.producer.call_options import SubmitOptions, worker_options
from tokenq.producer.config import ConfigCache, Estimating
from tokenq.producer.deadline import check_seconds
from tokenq.producer.lanes import Lane, check_ids
from tokenq.shared import keys, wire
from tokenq.shared.errors import BadRequest, ConfigError, DecodeError
from tokenq.shared.request_options import (
    NO_OPTIONS,
    OptionError,
    RequestOptions,
    parse_options,
    prompt_of,
)
from tokenq.shared.settings import ClientSettings

if TYPE_CHECKING:
    from typing_extensions import Unpack

TextItem = str | tuple[str, str]
"""One input of a batch: a text, or a ``(text, text_pair)`` pair for rerankers."""


@dataclass(slots=True)
class Prepared:
    """One validated request, ready for the enqueue script (not frozen: made per request)."""

    id: str
    reply_to: str
    fields: dict[str, str | bytes]
    named: bool = False
    """Whether the caller chose the id (``unique``): its retry may come in another call, so
    it gets a seen key of its own."""


class CallOptions(NamedTuple):
    """What one call's options decide for all its requests."""

    reply_to: str | None
    fields: dict[str, str | bytes]
    """Every request's fields, encoded once: ``""`` for what each request has of its own."""
    estimating: Estimating
    prompt: str = ""
    """The prompt the worker will put before each text, as far as the config says."""
    truncate: bool | None = None


def utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (checked valid before): an ASCII text is not encoded."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def timeout_ms(deadline_s: float | None, deadline_ms: int | None, now_ms: int) -> int | None:
    """The relative ``timeout_ms`` field (counted on Redis's clock from the entry's id) from a
    relative or an absolute deadline; only ``deadline_ms`` uses the caller's clock."""
    if deadline_s is not None and deadline_ms is not None:
        raise BadRequest("give deadline_s (relative) or deadline_ms (absolute), not both",
                         param="deadline_ms")
    limit = wire.MAX_TIMEOUT_MS
    if deadline_s is not None:
        seconds = check_seconds(deadline_s, "deadline_s")
        if seconds * 1000 > limit:
            raise BadRequest(f"deadline_s {deadline_s!r} is out of range: at most {limit // 1000} "
                             "s (30 days)", param="deadline_s")
        return max(1, math.ceil(seconds * 1000))
    if deadline_ms is None:
        return None
    if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int):
        problem = f"must be an integer (epoch milliseconds), got {type(deadline_ms).__name__}"
    elif deadline_ms <= now_ms:
        problem = f"{deadline_ms} has already passed (now is {now_ms} epoch ms)"
    elif deadline_ms - now_ms > limit:
        problem = (f"{deadline_ms} is out of range: at most {limit} ms (30 days) after now "
                   f"({now_ms} epoch ms)")
    else:
        return deadline_ms - now_ms
    raise BadRequest(f"deadline_ms {problem}", param="deadline_ms")


def _opts(options: SubmitOptions) -> Mapping[str, Any]:
    """The request's ``opts`` map: the caller's ``opts``, plus the worker options it named."""
    opts = options.get("opts")
    if opts is None:
        opts = {}
    elif not isinstance(opts, Mapping) or not all(isinstance(k, str) for k in opts):
        raise BadRequest("opts must be a mapping with string keys", param="opts")
    named = worker_options(options)
    if not named:
        return opts
    twice = sorted(named.keys() & opts.keys())
    if twice:
        raise BadRequest(f"{twice[0]} is given both as a keyword and in opts", param=twice[0])
    return {**opts, **named}


def _tokens(
    estimate: Callable[[str, str | None], int], text: str, pair: str | None, where: str
) -> int:
    tokens = estimate(text, pair)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        problem = "; it must return a non-negative int"
    elif tokens > wire.MAX_TOKENS:
        problem = f", over the protocol's limit of {wire.MAX_TOKENS} tokens; nothing was written"
    else:
        return tokens
    raise BadRequest(f"the token estimator returned {tokens!r} for {where}{problem}",
                     param="estimator")


class Preparer:
    """Checks a call's arguments and builds its requests; ``refuse_early=False`` leaves what
    the config says the worker would refuse to the worker."""

    def __init__(self, settings: ClientSettings, config: ConfigCache, refuse_early: bool) -> None:
        self.settings = settings
        self.config = config
        self.refuse_early = refuse_early

    def prepare(
        self, lane: Lane, text: object, *, now_ms: int, text_pair: object = None,
        **options: Unpack[SubmitOptions],
    ) -> Prepared:
        """One checked request for ``lane``; ``reply_to`` defaults to its own reply key."""
        return self._prepare(lane, text, text_pair, None, self._call(options, now_ms))

    def prepare_many(
        self, lane: Lane, texts: Sequence[TextItem], *, now_ms: int,
        unique: Sequence[str] | None = None, **options: Unpack[SubmitOptions],
    ) -> list[Prepared]:
        """A whole batch checked before anything is written (texts or ``(text, text_pair)``).
        ``unique``: each request's id (before its shard prefix) instead of a fresh one, so a retry
        names the same requests and the dedupe writes them once (``Idempotency-Key``)."""
        if not texts:
            return []
        call = self._call(options, now_ms)
        if unique is None:
            return [self._prepare(lane, item, None, i, call) for i, item in enumerate(texts)]
        if len(unique) != len(texts):
            raise BadRequest(f"{len(unique)} ids for {len(texts)} texts", param="texts")
        check_ids(unique)
        return [self._prepare(lane, item, None, i, call, unique[i])
                for i, item in enumerate(texts)]

    def _call(self, options: SubmitOptions, now_ms: int) -> CallOptions:
        """What the options make of every request of one call (checked once per call)."""
        reply_to = options.get("reply_to")
        opts = _opts(options)
        checked = self._worker_options(opts)
        if reply_to is not None and (
                not isinstance(reply_to, str) or not 0 < len(reply_to) <= wire.MAX_REPLY_TO_CHARS):
            raise BadRequest(f"reply_to must be a key name of 1-{wire.MAX_REPLY_TO_CHARS} chars",
                             param="reply_to")
        deadline = timeout_ms(options.get("deadline_s"), options.get("deadline_ms"), now_ms)
        try:
            priority = wire.validate_priority(options.get("priority"))
        except DecodeError as exc:
            exc.param = "priority"
            raise
        try:
            fields = wire.call_fields(opts, deadline, priority)
        except DecodeError as exc:
            raise BadRequest(str(exc), param="opts") from None
        except (TypeError, ValueError, OverflowError) as exc:
            # msgpack cannot encode something in opts (an int past 64 bits overflows)
            raise BadRequest(f"opts cannot be encoded as msgpack: {exc}", param="opts") from None
        estimating = self.config.current()
        if estimating.exact_problem is not None:
            raise ConfigError(f"estimator='exact' but queue {self.settings.queue!r} gives no "
                              f"tokenizer the producer can load: {estimating.exact_problem}; "
                              "nothing was written")
        return CallOptions(reply_to, fields, estimating, prompt_of(checked, self.config.facts()),
                           checked.truncate)

    def _worker_options(self, opts: Mapping[str, Any]) -> RequestOptions:
        """The request options as the worker will read them; BadRequest for a value it would
        refuse, when ``refuse_early``."""
        try:
            return parse_options(opts, self.config.facts())
        except ValueError as exc:
            if self.refuse_early:
                param = exc.param if isinstance(exc, OptionError) else "opts"
                raise BadRequest(f"opts: {exc}; nothing was written", param=param) from None
            return NO_OPTIONS

    def _text(self, value: object, where: str, param: str) -> str:
        """``value`` if the worker would take it as a text."""
        try:
            return wire.validate_text(value, where, self.settings.max_request_bytes)
        except DecodeError as exc:
            raise BadRequest(str(exc), param=param) from None

    def _prepare(
        self, lane: Lane, item: object, text_pair: object, index: int | None, call: CallOptions,
        unique: str | None = None,
    ) -> Prepared:
        where, param = ("text", "text") if index is None else (f"texts[{index}]", "texts")
        if isinstance(item, tuple) and index is not None:
            if len(item) != 2:
                raise BadRequest(f"{where} must be a string or a (text, text_pair) tuple",
                                 param=param)
            item, text_pair = item
        text = self._text(item, where, param)
        pair = None if text_pair is None else self._text(
            text_pair, f"{where} text_pair", "text_pair")
        chars = len(text)
        if pair is not None:  # each text alone is within the limit: _text checked
            chars += len(pair)
            size, limit = utf8_size(text) + utf8_size(pair), self.settings.max_request_bytes
            if size > limit:
                raise BadRequest(f"{where} is {size} bytes of UTF-8, over the limit of {limit} "
                                 "bytes", param=param)
        estimating = call.estimating.for_length(chars)  # no exact problem: ensured per call
        tokens = _tokens(estimating.estimate, call.prompt + text, pair, where)
        if self.refuse_early:
            estimating.check(self.settings.queue, tokens=tokens, has_pair=pair is not None,
                             where=where, truncate=call.truncate, param=param)

        request_id = lane.new_id() if unique is None else keys.id_on_shard(lane.shard, unique)
        target = lane.reply_key(request_id) if call.reply_to is None else call.reply_to
        fields = wire.own_fields(call.fields, request_id, text, tokens, target, pair)
        return Prepared(request_id, target, fields, unique is not None)
