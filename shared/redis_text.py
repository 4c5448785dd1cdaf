"""What Redis hands back as bytes (names, ids, config values), read as text.

Redis strings are bytes, and a client may be set to decode them or not; an
operator's view, a log line or a comparison with a name wants ``str``
either way. Bytes that are not UTF-8 are shown with replacement characters
rather than refused: these are names and ids to show or compare, never
request payloads (those are decoded strictly, by ``shared/wire.py``).
"""

from __future__ import annotations


def as_text(value: object) -> str:
    """``value`` as ``str``: bytes decoded as UTF-8 (replacing what is not), None as ""."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)
