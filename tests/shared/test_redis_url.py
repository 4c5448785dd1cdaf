"""Redis URLs: single servers pass through, cluster and Sentinel URLs parse exactly, errors say why.

Property-tested like the packer: URLs built from generated host lists,
credentials and service names parse back to what built them; every broken
form is a ValueError, and no error message or redaction shows a password.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenq.shared.redis_url import RedisTarget, parse_redis_url, redact

pytestmark = pytest.mark.unit

# ----------------------------------------------------------------- strategies

hostnames = st.from_regex(r"\A[a-z0-9]([a-z0-9\-]{0,10}[a-z0-9])?(\.[a-z0-9]{1,8}){0,3}\Z")
ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(str)
hosts = st.one_of(hostnames, ipv4, ipv6)
ports = st.integers(1, 65535)
nodes = st.lists(st.tuples(hosts, ports), min_size=1, max_size=5).map(tuple)
any_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)
secrets = any_text.map(lambda text: "pw-" + text)
"""A password: any characters (encoded in the URL), with a prefix no host or key contains."""
users = st.none() | any_text
services = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp"),
                                 blacklist_characters="\x7f"), min_size=1, max_size=20)
tls_options = st.dictionaries(
    st.sampled_from(["ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_check_hostname"]),
    st.just(""), max_size=4,
).map(lambda chosen: {name: {"ssl_cert_reqs": "none", "ssl_check_hostname": "false"}.get(
    name, "/etc/ssl/some file+x.pem") for name in chosen})


def netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def userinfo(user: str | None, password: str | None) -> str:
    if user is None and password is None:
        return ""
    shown = quote(user or "", safe="")
    return f"{shown}:{quote(password, safe='')}@" if password is not None else f"{shown}@"


def query(options: dict[str, str]) -> str:
    return "&".join(f"{name}={quote(value, safe='')}" for name, value in options.items())


def cluster_url(scheme: str, hosts_: tuple, user: str | None, password: str | None,
                options: dict[str, str], path: str = "") -> str:
    q = query(options)
    return (f"{scheme}://{userinfo(user, password)}{','.join(netloc(*n) for n in hosts_)}"
            f"{path}{'?' + q if q else ''}")


def sentinel_url(scheme: str, hosts_: tuple, user: str | None, password: str | None,
                 service: str, db: int | None, options: dict[str, str]) -> str:
    path = f"/{quote(service, safe='')}" + ("" if db is None else f"/{db}")
    return cluster_url(scheme, hosts_, user, password, options, path)


# ----------------------------------------------------------------- round trips


@given(nodes, users, st.none() | secrets, st.booleans(), tls_options,
       st.sampled_from(["", "/", "/0"]))
def test_cluster_urls_round_trip(hosts_, user, password, tls, options, path) -> None:
    scheme = "rediss+cluster" if tls else "redis+cluster"
    url = cluster_url(scheme, hosts_, user, password, options if tls else {}, path)
    target = parse_redis_url(url)
    assert target == RedisTarget(
        "cluster", url, tuple(hosts_), user or None, password,
        tls, options=options if tls else {},
    )


@given(nodes, users, st.none() | secrets, st.booleans(), services,
       st.none() | st.integers(0, 10**9 - 1), st.none() | any_text, st.none() | secrets,
       tls_options)
def test_sentinel_urls_round_trip(hosts_, user, password, tls, service, db,
                                  sentinel_user, sentinel_password, options) -> None:
    scheme = "rediss+sentinel" if tls else "redis+sentinel"
    given_options = dict(options) if tls else {}
    query_options = dict(given_options)
    if sentinel_user is not None:
        query_options["sentinel_username"] = sentinel_user
    if sentinel_password is not None:
        query_options["sentinel_password"] = sentinel_password
    url = sentinel_url(scheme, hosts_, user, password, service, db, query_options)
    target = parse_redis_url(url)
    assert target == RedisTarget(
        "sentinel", url, tuple(hosts_), user or None, password, tls, service, db or 0,
        sentinel_user, sentinel_password, given_options,
    )


@pytest.mark.parametrize("url", [
    "redis://localhost:6379/0", "rediss://u:p@h:1/2?ssl_cert_reqs=none",
    "unix:///tmp/redis.sock?db=1", "localhost:6379", "http://nope", "",
])
def test_single_server_urls_are_left_to_redis_py(url: str) -> None:
    assert parse_redis_url(url) == RedisTarget("single", url)


def test_the_tls_options_come_typed() -> None:
    target = parse_redis_url("rediss+cluster://h:1?ssl_check_hostname=false&ssl_cert_reqs=none")
    assert target.tls_kwargs() == {"ssl_check_hostname": False, "ssl_cert_reqs": "none"}
    assert parse_redis_url("rediss+cluster://h:1?ssl_check_hostname=YES").tls_kwargs() == {
        "ssl_check_hostname": True}


def test_ipv6_and_a_trailing_slash() -> None:
    target = parse_redis_url("redis+sentinel://[::1]:26379,[fe80::1%25eth0]:1/master/")
    assert target.nodes == (("::1", 26379), ("fe80::1%25eth0", 1))
    assert (target.service, target.db) == ("master", 0)


# ----------------------------------------------------------------- errors

BROKEN = [
    ("redis+cluster://", "names no host"),
    ("redis+cluster://?ssl_cert_reqs=none", "names no host"),
    ("redis+cluster://h", "no port"),
    ("redis+cluster://h:1,", "empty entry"),
    ("redis+cluster://h:1,,h:2", "empty entry"),
    ("redis+cluster://h:x", "not a number"),
    ("redis+cluster://h:0", "not a number from 1"),
    ("redis+cluster://h:65536", "not a number from 1"),
    ("redis+cluster://::1:7000", "IPv6 address goes in brackets"),
    ("redis+cluster://[::1]", "no port"),
    ("redis+cluster://h:1/3", "database 3"),
    ("redis+cluster://h:1/x", "no path"),
    ("redis+cluster://h:1/0/1", "no path"),
    ("redis+cluster://h:1?db=0", "unknown query option 'db'"),
    ("redis+cluster://h:1?sentinel_password=x", "unknown query option 'sentinel_password'"),
    ("redis+cluster://h:1?ssl_ca_certs=/x", "needs TLS: use rediss+cluster://"),
    ("rediss+cluster://h:1?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
    ("rediss+cluster://h:1?ssl_check_hostname=perhaps", "ssl_check_hostname"),
    ("rediss+cluster://h:1?ssl_ca_certs=", "has no value"),
    ("rediss+cluster://h:1?ssl_ca_certs=a&ssl_ca_certs=b", "given twice"),
    ("rediss+cluster://h:1?ssl_ca_certs", "no '=value'"),
    ("redis+cluster://h:1#frag", "fragment"),
    ("redis+cluster://h :1", "space"),
    ("redis+cluster://h:1\n", "control character"),
    ("redis+sentinel://h:1", "names no service"),
    ("redis+sentinel://h:1/", "names no service"),
    ("redis+sentinel://h:1//2", "names no service"),
    ("redis+sentinel://h:1/m/x", "at most a database number"),
    ("redis+sentinel://h:1/m/1/2", "at most a database number"),
    ("redis+sentinel://h:1/m%20x", "space"),
    ("redis+sentinel://h:1/m?password=x", "unknown query option 'password'"),
    ("redis+bogus://h:1", "unknown Redis URL scheme redis+bogus://"),
    ("redis+cluster://u:se/cret@h:1", "percent-encode"),
    ("redis+cluster://u:se?cret@h:1", "percent-encode"),
    ("redis+cluster://u:se#cret@h:1", "percent-encode"),
]


@pytest.mark.parametrize(("url", "says"), BROKEN)
def test_every_broken_form_is_a_value_error_that_says_why(url: str, says: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_redis_url(url)
    assert says in str(raised.value)


def test_a_missing_service_names_the_form() -> None:
    with pytest.raises(ValueError, match=r"/service_name\[/db\]"):
        parse_redis_url("redis+sentinel://h:1,h:2")


_BREAKAGES = [  # (hosts, path, query) -> the same, broken
    lambda h, p, q: (h + ",", p, q),  # an empty host entry
    lambda h, p, q: (h + ",h", p, q),  # no port
    lambda h, p, q: (h + ",h:x", p, q),  # a port that is no number
    lambda h, p, q: (h, p, [*q, "nonsense=1"]),  # an unknown option
    lambda h, p, q: (h, p, [*q, "sentinel_password"]),  # no value
    lambda h, p, q: (h, "/7/8/9", q),  # too long a path
    lambda h, p, q: (h, "", q) if p.startswith("/svc") else (h, "/5", q),  # no service / a db
    lambda h, p, q: (h, p + "#fragment", q),
]


@given(nodes, users, secrets, st.sampled_from(["cluster", "sentinel"]),
       st.sampled_from(range(len(_BREAKAGES))), st.none() | secrets)
def test_no_error_message_shows_a_password(hosts_, user, password, kind, breakage,
                                           sentinel_password) -> None:
    given_query = [] if sentinel_password is None or kind == "cluster" else [
        f"sentinel_password={quote(sentinel_password, safe='')}"]
    host_list = ",".join(netloc(*n) for n in hosts_)
    path = "" if kind == "cluster" else "/svc"
    host_list, path, broken_query = _BREAKAGES[breakage](host_list, path, given_query)
    tail = f"?{'&'.join(broken_query)}" if broken_query else ""
    url = f"redis+{kind}://{userinfo(user, password)}{host_list}{path}{tail}"
    with pytest.raises(ValueError) as raised:
        parse_redis_url(url)
    for secret in filter(None, (password, sentinel_password)):
        assert secret not in str(raised.value)
        assert quote(secret, safe="") not in str(raised.value)


@given(nodes, secrets, st.text(st.sampled_from("/?#@"), min_size=1, max_size=3))
def test_an_unencoded_delimiter_in_a_password_is_refused_without_showing_it(
        hosts_, password, delimiters) -> None:
    url = f"redis+cluster://u:{password}{delimiters}x@{','.join(netloc(*n) for n in hosts_)}"
    try:
        parse_redis_url(url)
    except ValueError as exc:
        assert password not in str(exc)
    assert password not in redact(url)


@given(st.sampled_from(["redis+cluster://", "rediss+sentinel://"]), st.text(max_size=60))
def test_anything_after_the_scheme_parses_or_is_a_value_error(scheme: str, rest: str) -> None:
    try:
        target = parse_redis_url(scheme + rest)
    except ValueError:
        return
    assert target.kind in ("cluster", "sentinel") and target.nodes


# ----------------------------------------------------------------- redaction


@given(nodes, users, secrets, st.none() | secrets, st.sampled_from(["cluster", "sentinel"]))
def test_redact_masks_every_password(hosts_, user, password, sentinel_password, kind) -> None:
    options = {} if sentinel_password is None else {"sentinel_password": sentinel_password}
    url = (cluster_url("redis+cluster", hosts_, user, password, {}) if kind == "cluster"
           else sentinel_url("redis+sentinel", hosts_, user, password, "svc", 2, options))
    shown = redact(url)
    for secret in filter(None, (password, sentinel_password)):
        assert quote(secret, safe="") not in shown
    assert "***" in shown


def test_a_targets_repr_shows_no_password() -> None:
    target = parse_redis_url(
        "redis+sentinel://u:pw-one@h:1/m?sentinel_password=pw-two")
    assert "pw-one" not in repr(target) and "pw-two" not in repr(target)
    assert (target.password, target.sentinel_password) == ("pw-one", "pw-two")


def test_a_url_that_is_not_a_string_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="string"):
        parse_redis_url(b"redis://h")  # type: ignore[arg-type]


def test_ipv6_hosts_are_addresses() -> None:  # the strategies' own sanity check
    assert ipaddress.ip_address(parse_redis_url("redis+cluster://[::1]:1").nodes[0][0])
