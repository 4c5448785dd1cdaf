"""What a tokenq Redis URL names (:data:`CLUSTER_FORM`, :data:`SENTINEL_FORM`; ``rediss+``: TLS to
the master, not the sentinels); a bad one is a ValueError that never repeats a password."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

Kind = Literal["single", "cluster", "sentinel"]
_SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
"""Any scheme without a ``+`` is a single-server URL (redis://, rediss://, unix://), redis-py's."""
CLUSTER_FORM = "redis+cluster://[user[:password]@]host:port[,host:port...][/][?query]"
SENTINEL_FORM = (
    "redis+sentinel://[user[:password]@]host:port[,host:port...]/service_name[/db]"
    "[?sentinel_username=...&sentinel_password=...]")
TLS_OPTIONS = frozenset({
    "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile",
    "ssl_password", "ssl_check_hostname",
})
"""Query keys passed through to redis-py's connections (TLS URLs only)."""
SENTINEL_OPTIONS = frozenset({"sentinel_username", "sentinel_password"})
_CERT_REQS = ("none", "optional", "required")
_TRUE = ("true", "yes", "1")
_FALSE = ("false", "no", "0")
_UNSAFE = re.compile(r"[\x00-\x20\x7f]")
_HOSTNAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_IPV6 = re.compile(r"^\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.\-~]+)?\]$")
_PORT = re.compile(r"^[0-9]{1,5}$")
_DB = re.compile(r"^[0-9]{1,9}$")


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """One parsed Redis URL. For a single-server URL only ``kind`` and ``url`` are set."""

    kind: Kind
    url: str = field(repr=False)
    nodes: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    service: str | None = None
    db: int = 0
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    options: dict[str, str] = field(default_factory=dict, hash=False)

    def tls_kwargs(self) -> dict[str, str | bool]:
        """The TLS query options as redis-py connection keyword arguments (typed)."""
        return {
            name: value.lower() in _TRUE if name == "ssl_check_hostname" else value
            for name, value in self.options.items()
        }


def parse_redis_url(url: str) -> RedisTarget:
    """What ``url`` names (user, password, service and query values percent-encoded); a
    :class:`ValueError` naming the problem if it cannot be used."""
    if not isinstance(url, str):
        raise ValueError(f"a Redis URL is a string, not {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        # Single-server URLs (and their errors) are redis-py's; a bare host is one too.
        return RedisTarget("single", url)
    entry = _SCHEMES.get(scheme.lower())
    if entry is None:
        if "+" in scheme:
            raise ValueError(f"unknown Redis URL scheme {scheme}:// (use redis+cluster://, "
                             "rediss+cluster://, redis+sentinel:// or rediss+sentinel://)")
        return RedisTarget("single", url)
    kind, tls = entry
    form = CLUSTER_FORM if kind == "cluster" else SENTINEL_FORM
    if _UNSAFE.search(url):
        raise ValueError(f"the {scheme}:// URL contains a space or a control character")
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in tail:
        raise ValueError(
            f"the {scheme}:// URL has an '@' after its host list: percent-encode '/', '?', "
            "'#' and '@' in the user name, the password and query values"
        )
    if "#" in tail:
        raise ValueError(f"the {scheme}:// URL has a '#' fragment; a Redis URL has none")
    userinfo, _, hosts = authority.rpartition("@")
    user, _, secret = userinfo.partition(":")  # empty ones count as absent, as in redis-py
    username, password = unquote(user) or None, unquote(secret) or None
    nodes = _nodes(hosts, scheme, form)
    path, _, query = tail.partition("?")
    options = _query(query, scheme, tls, kind)
    sentinel_username = options.pop("sentinel_username", None) or None
    sentinel_password = options.pop("sentinel_password", None) or None
    if kind == "cluster":
        _cluster_path(path, scheme)
        return RedisTarget("cluster", url, nodes, username, password, tls, options=options)
    service, db = _sentinel_path(path, scheme)
    return RedisTarget("sentinel", url, nodes, username, password, tls, service, db,
                       sentinel_username, sentinel_password, options)


def _nodes(hosts: str, scheme: str, form: str) -> tuple[tuple[str, int], ...]:
    if not hosts:
        raise ValueError(f"the {scheme}:// URL names no host; the form is {form}")
    nodes = []
    for entry in hosts.split(","):
        if not entry:
            raise ValueError(f"the {scheme}:// URL's host list has an empty entry ({hosts!r})")
        host, colon, port = entry.rpartition(":")
        if not colon or (host.startswith("[") and not host.endswith("]")):
            raise ValueError(f"host {entry!r} of the {scheme}:// URL has no port (host:port)")
        if not (_IPV6.match(host) or (_HOSTNAME.match(host) and ":" not in host)):
            raise ValueError(f"host {host!r} of the {scheme}:// URL is not a host name or "
                             "address (an IPv6 address goes in brackets)")
        if not _PORT.match(port) or not 0 < int(port) < 65536:
            raise ValueError(f"host {entry!r} of the {scheme}:// URL has port {port!r}, "
                             "not a number from 1 to 65535")
        nodes.append((host[1:-1] if host.startswith("[") else host, int(port)))
    return tuple(nodes)


def _query(query: str, scheme: str, tls: bool, kind: Kind) -> dict[str, str]:
    known = TLS_OPTIONS | (SENTINEL_OPTIONS if kind == "sentinel" else frozenset())
    options: dict[str, str] = {}
    for pair in query.split("&") if query else ():
        if not pair:
            continue
        name, equals, value = pair.partition("=")
        name = unquote(name)
        if not equals:
            shown = f" {name!r}" if "password" not in name.lower() else ""
            raise ValueError(f"query field{shown} of the {scheme}:// URL has no '=value'")
        if name not in known:
            raise ValueError(f"unknown query option {name!r} in the {scheme}:// URL (known: "
                             f"{', '.join(sorted(known))})")
        if name in options:
            raise ValueError(f"query option {name!r} is given twice in the {scheme}:// URL")
        if name in TLS_OPTIONS and not tls:
            raise ValueError(f"query option {name!r} needs TLS: use "
                             f"{scheme.replace('redis+', 'rediss+', 1)}://")
        value = unquote(value.replace("+", " "))
        if not value and name in TLS_OPTIONS:
            raise ValueError(f"query option {name!r} of the {scheme}:// URL has no value")
        if name == "ssl_cert_reqs" and value not in _CERT_REQS:
            raise ValueError(f"ssl_cert_reqs in the {scheme}:// URL is {value!r}, not one of "
                             f"{', '.join(_CERT_REQS)}")
        if name == "ssl_check_hostname" and value.lower() not in _TRUE + _FALSE:
            raise ValueError(f"ssl_check_hostname in the {scheme}:// URL is {value!r}, not "
                             "true or false")
        options[name] = value
    return options


def _cluster_path(path: str, scheme: str) -> None:
    if path in ("", "/", "/0"):
        return
    db = path[1:]
    if _DB.match(db):
        raise ValueError(f"the {scheme}:// URL selects database {db}, but a Redis Cluster "
                         "has only database 0 (leave the path empty)")
    raise ValueError(f"the {scheme}:// URL has path {path!r}; a cluster URL has no path "
                     "(at most /0)")


def _sentinel_path(path: str, scheme: str) -> tuple[str, int]:
    segments = path[1:].split("/") if path else []
    if segments and segments[-1] == "" and len(segments) > 1:
        segments.pop()  # one trailing slash
    service = unquote(segments[0]) if segments else ""
    if not service:
        raise ValueError(f"the {scheme}:// URL names no service; the form is {SENTINEL_FORM}")
    if _UNSAFE.search(service):
        raise ValueError(f"the service name {service!r} of the {scheme}:// URL has a space or "
                         "a control character")
    if len(segments) == 1:
        return service, 0
    if len(segments) == 2 and _DB.match(segments[1]):
        return service, int(segments[1])
    raise ValueError(f"the {scheme}:// URL has path {path!r}; after the service name comes "
                     f"at most a database number ({SENTINEL_FORM})")


def _is_secret(name: str) -> bool:
    """``password``, ``sentinel_password``, ``ssl_password``: any query key naming one."""
    return name.lower().endswith("password")


def redact(url: str) -> str:
    """``url`` with every password masked (user part, ``…password=`` query values); a URL too
    broken to tell where its password is shows only its scheme."""
    scheme = url.split("://", 1)[0]
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            host = netloc.rsplit("@", 1)[1]
            netloc = f"{parts.username or ''}:***@{host}"
        elif "@" in url.split("://", 1)[-1][len(parts.netloc):]:
            return f"{scheme}://***"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(_is_secret(name) for name, _ in pairs):
                query = urlencode([(name, "***" if _is_secret(name) else value)
                                   for name, value in pairs], safe="*")
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:  # not even parseable: show nothing that might be a secret
        return f"{scheme}://***"
