"""``tokenq serve``: parse the settings, run the gateway under uvicorn until a signal."""

from __future__ import annotations

from collections.abc import Sequence

from tokenq.shared.cli import run_command
from tokenq.shared.settings import ServeSettings


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(ServeSettings, list(argv or []), "tokenq serve", serve)


def serve(settings: ServeSettings) -> int:
    import uvicorn  # the serve extra

    from tokenq.producer.serve.app import create_app
    from tokenq.producer.serve.edge import header_timeout_protocol

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level="info", access_log=False,
                http=header_timeout_protocol(settings.header_timeout_s),
                timeout_keep_alive=max(1, round(settings.header_timeout_s)))
    return 0
