"""Whether the Hugging Face Hub can be reached, answered in seconds.

huggingface_hub retries a failed request for ~25 s per file and then says "not
found"; :func:`unreachable` tries one TCP connection (DNS included) to
``HF_ENDPOINT`` first, so an offline machine is told at once. No torch.
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from urllib.parse import urlsplit

REACH_TIMEOUT_S = 3.0
"""How long the DNS lookup and the connection to the Hub may take together."""


def offline() -> bool:
    """Whether huggingface_hub is offline (``HF_HUB_OFFLINE``, or ``TRANSFORMERS_OFFLINE``)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def endpoint() -> str:
    """The Hub's URL as huggingface_hub uses it (``HF_ENDPOINT``, default https://huggingface.co)."""
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def unreachable(url: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why ``url``'s host cannot be reached, or None when it can (or a proxy reaches it)."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host or _proxied(parts.scheme, host):
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            outcome.append(f"the DNS lookup of {host} failed ({exc})")
            return
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            outcome.append(f"connecting to {host}:{port} failed ({exc or type(exc).__name__})")
            return
        outcome.append(None)

    # getaddrinfo takes no timeout: a daemon thread bounds it.
    thread = threading.Thread(target=connect, name="tokenq-hub-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    return outcome[0]


def _proxied(scheme: str, host: str) -> bool:
    proxies = urllib.request.getproxies()
    return bool(proxies.get(scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host)
