"""``tokenq serve``: parse the settings, run the gateway under uvicorn until a signal."""

from __future__ import annotations

from collections.abc import Sequence

from tokenq.shared.cli import run_command
from tokenq.shared.settings import ServeSettings


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(ServeSettings, list(argv or []), "tokenq serve", serve)


def serve(settings: ServeSettings) -> int:
    # The serve extra; without it the dispatcher says so in one line (shared/cli.py).
    import uvicorn

    from tokenq.producer.serve.app import create_app
    from tokenq.producer.serve.edge import header_timeout_protocol

    # Slow clients: a request head within --header-timeout-s (h11 refuses one
    # over 16 KiB), an idle kept-alive connection closed after as long, the
    # body within --timeout-s (bounds.read_body).
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level="info", access_log=False,
                http=header_timeout_protocol(settings.header_timeout_s),
                timeout_keep_alive=max(1, round(settings.header_timeout_s)))
    return 0
