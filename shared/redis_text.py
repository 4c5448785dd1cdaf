"""What Redis hands back as bytes (names, ids, config values), read as text to show or compare
(never payloads: ``shared/wire.py`` decodes those strictly)."""

from __future__ import annotations


def as_text(value: object) -> str:
    """``value`` as ``str``: bytes decoded as UTF-8 (replacing what is not), None as ""."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)
