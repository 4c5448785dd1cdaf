"""Dead letters (``keys.dead(q)``, docs/PROTOCOL.md): the request's own fields, capped, then the
``dead_*`` fields saying why, who and when. Sans-I/O; ``shared/lua/dead_letter.lua`` is its twin."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tokenq.shared import keys
from tokenq.shared.redis_text import as_text

PREFIX = "dead_"
"""Every field a letter adds to the request's starts with this, and no other does."""
TENANT = "dead_tenant"
"""Only a named tenant's letter has it."""
DEATH_FIELDS = ("dead_error_code", "dead_error", "dead_worker", "dead_deliveries", "dead_at_ms",
                "dead_source_id")
"""The fields every letter carries, in the order they are written (:class:`Death`'s)."""
TRUNCATED = "dead_truncated"
"""The fields a letter cut to stay within its caps, comma-separated."""
MAX_LETTER_FIELDS = 256
"""Most of an entry's own fields a dead letter keeps (publish.lua's XADD is on Lua's stack)."""
MAX_TRUNCATED_NAMES = 16
"""Most field names ``dead_truncated`` lists; any further cut is counted as ``+N more``."""
_MAX_NAME_BYTES = 64
_PREFIX_BYTES = PREFIX.encode()
Field = tuple[bytes | str, bytes | str]


def is_dead_field(name: bytes | str) -> bool:
    """Whether a field is the letter's own (``dead_*``) rather than the request's."""
    return name.startswith(_PREFIX_BYTES) if isinstance(name, bytes) else name.startswith(PREFIX)


@dataclass(frozen=True, slots=True)
class Death:
    """Why, who and when: the ``dead_*`` fields of one letter."""

    code: str
    """An ErrorCode value."""
    message: str
    worker: str
    """The consumer name of the worker that wrote the letter."""
    deliveries: int
    at_ms: int
    """Unix ms on Redis's clock."""
    source_id: str
    """The request's stream entry id."""
    tenant: str = keys.DEFAULT_TENANT
    """Whose stream it was read from (``dlq retry`` puts it back there)."""


def capped_fields(
    fields: Mapping[bytes | str, bytes | str], max_bytes: int
) -> tuple[list[tuple[bytes, bytes]], str]:
    """An entry's own fields within the caps, and the ``dead_truncated`` value ("" if none)."""
    kept: list[tuple[bytes, bytes]] = []
    cut: list[str] = []
    room = max_bytes
    for key, value in fields.items():
        name = key if isinstance(key, bytes) else key.encode("utf-8", "surrogatepass")
        if is_dead_field(name):
            continue
        data = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
        label = name[:_MAX_NAME_BYTES].decode("utf-8", "replace")
        if len(name) > room or len(kept) >= MAX_LETTER_FIELDS:
            cut.append(label)
            continue
        room -= len(name)
        if len(data) > room:
            cut.append(label)
            data = data[:room]
        room -= len(data)
        kept.append((name, data))
    more = len(cut) - MAX_TRUNCATED_NAMES
    shown = ",".join(cut[:MAX_TRUNCATED_NAMES])
    return kept, f"{shown},+{more} more" if more > 0 else shown


def encode_letter(
    fields: Mapping[bytes | str, bytes | str], death: Death, *, max_bytes: int
) -> tuple[Field, ...]:
    """The letter's fields, in order, ready for XADD: the capped request, then ``dead_*``."""
    original, cut = capped_fields(fields, max_bytes)
    truncated: tuple[Field, ...] = ((TRUNCATED, cut),) if cut else ()
    said = (death.code, death.message, death.worker, str(death.deliveries), str(death.at_ms),
            death.source_id)
    whose: tuple[Field, ...] = () if death.tenant == keys.DEFAULT_TENANT else (
        (TENANT, death.tenant),)
    return (*original, *truncated, *zip(DEATH_FIELDS, said, strict=True), *whose)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One letter read back: the request as kept, and why it died."""

    entry_id: str
    request: dict[str, str | bytes]
    """The request's fields; a value that is not UTF-8 (``opts``) stays bytes."""
    dead: dict[str, str]
    """Every ``dead_*`` field as text, known to this version or not."""

    @property
    def request_id(self) -> str:
        value = self.request.get("id", "")
        return value if isinstance(value, str) else value.decode(errors="replace")

    error_code = property(lambda self: self.dead.get("dead_error_code"))
    error = property(lambda self: self.dead.get("dead_error"))
    worker = property(lambda self: self.dead.get("dead_worker"))
    deliveries = property(lambda self: _int(self.dead.get("dead_deliveries")))
    at_ms = property(lambda self: _int(self.dead.get("dead_at_ms")))
    source_id = property(lambda self: self.dead.get("dead_source_id"))

    @property
    def tenant(self) -> str:
        """The tenant whose stream the request came from (the default one when the letter names
        none, or no tenant's name)."""
        named = self.dead.get(TENANT, keys.DEFAULT_TENANT)
        try:
            return keys.check_tenant(named)
        except ValueError:
            return keys.DEFAULT_TENANT

    @property
    def truncated(self) -> list[str] | None:
        """The fields the worker cut to fit its byte cap, or None for a whole letter."""
        value = self.dead.get(TRUNCATED)
        if value is None:
            return None
        return [name for name in value.split(",") if name] or ["?"]


def parse_letter(
    entry_id: bytes | str, fields: Mapping[bytes | str, bytes | str]
) -> DeadLetter:
    """Split a letter's fields into the request's and its own (never raises)."""
    request: dict[str, str | bytes] = {}
    dead: dict[str, str] = {}
    for raw_name, raw_value in fields.items():
        name = as_text(raw_name)
        if is_dead_field(name):
            dead[name] = as_text(raw_value)
            continue
        try:
            request[name] = raw_value.decode() if isinstance(raw_value, bytes) else raw_value
        except UnicodeDecodeError:
            request[name] = raw_value
    return DeadLetter(as_text(entry_id), request, dead)


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None
