"""Whether the Hugging Face Hub can be reached, answered in seconds.

huggingface_hub retries a failed request five times with backoff (about 25 s
per file), and transformers then reports a model it could not ask for as
"not found". Before a model that is not in the local cache is looked up,
:func:`unreachable` tries one TCP connection to the Hub's host (``HF_ENDPOINT``,
default huggingface.co), DNS lookup included, so a machine without network
is told so, and what to do, at once. Nothing here imports torch.
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
    """Why ``url``'s host cannot be reached (DNS, refused, no answer), or None when it can.

    None too when a proxy is configured for it: the proxy, not this machine,
    reaches the Hub, so a direct connection proves nothing.
    """
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

    # getaddrinfo takes no timeout: a thread bounds it (a daemon, so a stuck lookup
    # never holds the process).
    thread = threading.Thread(target=connect, name="tokenq-hub-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    return outcome[0]


def _proxied(scheme: str, host: str) -> bool:
    proxies = urllib.request.getproxies()
    return bool(proxies.get(scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host)
