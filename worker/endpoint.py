"""The worker's HTTP endpoint on ``--metrics-port``: ``/metrics``, ``/livez``, ``/readyz``."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from tokenq.shared.errors import ConfigError
from tokenq.worker.health import Health

log = logging.getLogger("tokenq.worker")

# Each probe by the worker's name and the gateway's (tokenq serve): one configuration fits both.
LIVE_PATHS = ("/livez", "/health")
READY_PATHS = ("/readyz", "/ready")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a probe left hanging never holds the process open


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes come every few seconds: no access log line each time."""


def app(health: Health, metrics_app: WsgiApp | None) -> WsgiApp:
    """The WSGI application: three routes (and the gateway's names), everything else 404."""
    probes = {**dict.fromkeys(LIVE_PATHS, health.live), **dict.fromkeys(READY_PATHS, health.ready)}

    def route(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics" and metrics_app is not None:
            return metrics_app(environ, start_response)
        probe = probes.get(path)
        verdict = None if probe is None else probe(time.monotonic())
        if verdict is None:
            status, text = "404 Not Found", "not found: try /metrics, /livez or /readyz"
        else:
            status = "200 OK" if verdict.ok else "503 Service Unavailable"
            text = verdict.text
        body = (text + "\n").encode()
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                                ("Content-Length", str(len(body))),
                                ("Cache-Control", "no-store")])
        return [body]

    return route


def serve(
    host: str, port: int, health: Health, metrics_app: WsgiApp | None
) -> Callable[[], None] | None:
    """Start the endpoint in a thread and return what closes it (None for port 0); a
    :class:`ConfigError` when it cannot bind."""
    if not port:
        return None
    server_class = _Server6 if ":" in host else _Server
    try:
        server = make_server(host, port, app(health, metrics_app), server_class, _QuietHandler)
    except OSError as exc:  # port taken, address not local: say which, exit 2
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
    thread = threading.Thread(target=server.serve_forever, name="tokenq-endpoint", daemon=True)
    thread.start()
    log.info("metrics and probes on http://%s:%d (/metrics /livez /readyz)", host, port)

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return close
