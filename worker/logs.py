"""Logging set-up for the worker process: plain text, or JSON lines for log shippers."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

FIELDS = "fields"  # the ``extra`` key whose dict JsonFormatter spreads into the object


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message (and exception, fields)."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            for name, value in fields.items():
                body.setdefault(str(name), value)
        return json.dumps(body, ensure_ascii=False, default=str)


def configure(level: str, *, json_lines: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    plain = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    handler.setFormatter(JsonFormatter() if json_lines else plain)
    root = logging.getLogger("tokenq")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
