"""The one loader of tokenq's Lua scripts: each ``-- tokenq:include <name>.lua`` line spliced with
that fragment (``shared/lua/``), every script as one Redis Functions library, their refusals."""

from __future__ import annotations

import functools
import hashlib
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

QUEUE_FULL = "QUEUEFULL"
"""First word of the error a script answers when entries would not fit in the queue."""
_INCLUDE = re.compile(r"^-- tokenq:include (?P<name>[\w.-]+\.lua)\b.*$", re.M)


class StaleFragment(RuntimeError):
    """A script's copy of a fragment is not the fragment (refresh it with this module)."""


HOSTED = {"queue_full.lua": ("tokenq.producer", "enqueue.lua"),
          "pending_tokens.lua": ("tokenq.producer", "enqueue.lua")}
"""Fragments written in the script that must run as it is (enqueue.lua), between the include line
and ``-- tokenq:end <name>.lua``: :func:`load` refuses a stale copy, ``python -m
tokenq.shared.lua_scripts FILE`` refreshes it."""


def fragment(name: str) -> str:
    """The text of ``shared/lua/<name>`` (or its block in :data:`HOSTED`'s script), one newline
    at its end."""
    package, file = HOSTED.get(name, ("tokenq.shared", name))
    text = resources.files(package).joinpath("lua").joinpath(file).read_text("utf-8")
    if name != file:
        text = text.split(f"-- tokenq:include {name}", 1)[1].split("\n", 1)[1]
        text = text.split(f"-- tokenq:end {name}", 1)[0]
    return text.rstrip("\n") + "\n"


def assemble(source: str) -> str:
    """``source`` with every fragment in place, at each include line and in each hosted copy."""
    return _expand(source, splice=True)[0]


def _expand(source: str, *, splice: bool) -> tuple[str, list[str]]:
    """(``source`` with its copies refreshed and, with ``splice``, its include lines filled;
    the names of the stale copies)."""
    out: list[str] = []
    stale: list[str] = []
    at = 0
    for match in _INCLUDE.finditer(source):
        if match.start() < at:
            continue  # an include line inside a copy just refreshed
        name = match["name"]
        end = re.compile(rf"^-- tokenq:end {re.escape(name)}$", re.M).search(source, match.end())
        if end is None and not splice:
            continue
        text = fragment(name)
        out += [source[at:match.end()], "\n", text]
        if end is not None:  # a copy: keep its markers, refresh what is between them
            if source[match.end() + 1:end.start()] != text:
                stale.append(name)
            at = end.start()
        else:
            at = min(match.end() + 1, len(source))
    return "".join([*out, source[at:]]), stale


def load(package: str, name: str) -> str:
    """``<package>/lua/<name>`` (the caller's package: this module imports neither side) with
    its fragments in place; :class:`StaleFragment` when it holds an out-of-date copy of one."""
    source = resources.files(package).joinpath("lua").joinpath(name).read_text("utf-8")
    stale = _expand(source, splice=False)[1]
    if stale:
        raise StaleFragment(
            f"{package} lua/{name} holds an old copy of shared/lua/{', '.join(stale)}; "
            f"run python -m tokenq.shared.lua_scripts on that file to refresh it")
    return assemble(source)


@dataclass(frozen=True, slots=True)
class Script:
    """One of tokenq's scripts: its file and its function flags (``no-writes``: reads only;
    ``allow-oom``: never grows memory; none: refused before it runs at ``maxmemory``)."""

    package: str
    file: str
    flags: tuple[str, ...] = ()
    command: Literal["fcall", "fcall_ro"] = "fcall"
    """How clients call it. A ``no-writes`` function called by ``FCALL`` is a read to Redis
    (it runs on a replica, and while Redis refuses writes); ``fcall_ro`` where the documented
    ACL grants only that (the reply keys)."""


SCRIPTS: Mapping[str, Script] = {
    "enqueue": Script("tokenq.producer", "enqueue.lua"),
    "enqueue_seen": Script("tokenq.producer", "enqueue.lua", ("no-writes",)),
    "peek_replies": Script("tokenq.producer", "peek_replies.lua", ("no-writes",), "fcall_ro"),
    "queue_depth": Script("tokenq.producer", "queue_depth.lua", ("no-writes",)),
    "dlq_retry": Script("tokenq.producer", "dlq_retry.lua"),
    "publish": Script("tokenq.worker", "publish.lua"),
    "drop_consumer": Script("tokenq.worker", "drop_consumer.lua", ("allow-oom",)),
    "remove_retired": Script("tokenq.worker", "remove_retired.lua", ("allow-oom",)),
    "remove_idle_tenants": Script("tokenq.worker", "remove_idle_tenants.lua", ("allow-oom",)),
    "claim_excess": Script("tokenq.worker", "claim_excess.lua", ("allow-oom",)),
    "cache_put": Script("tokenq.worker", "cache_put.lua"),
    "cache_trim": Script("tokenq.worker", "cache_put.lua", ("allow-oom",)),
    "cache_claim": Script("tokenq.worker", "cache_claim.lua"),
}
"""Every script tokenq runs, by its short name; ``enqueue_seen`` is enqueue.lua read-only,
which still answers a retry at ``maxmemory``; ``cache_trim`` is cache_put.lua given no entries,
which frees the cache's memory at ``maxmemory``."""
FUNCTION_FLAGS = frozenset({"no-writes", "allow-oom", "allow-stale", "no-cluster",
                            "allow-cross-slot-keys"})
"""The flags Redis 7 accepts on a function."""


@dataclass(frozen=True, slots=True)
class Library:
    """tokenq's scripts as one Redis Functions library (``FUNCTION LOAD`` text and names)."""

    name: str  # tokenq_<hash>: the hash is of the library's code, so each version has its own
    code: str  # what FUNCTION LOAD takes: the #!lua line, then one function per script
    functions: Mapping[str, str]  # short name (enqueue) -> function name, for FCALL
    scripts: Mapping[str, str]  # short name -> source, for EVALSHA where Redis < 7


LIBRARY_PREFIX = "tokenq_"
"""Every tokenq library's name starts so (``FUNCTION LIST LIBRARYNAME tokenq_``)."""
_HASH_CHARS = 12


def function_body(name: str, source: str, flags: Sequence[str]) -> str:
    """``source`` (a complete script) as the registration of the function ``name``: the body
    of a callback whose parameters are ``KEYS`` and ``ARGV``, as under ``EVAL``."""
    unknown = set(flags) - FUNCTION_FLAGS
    if unknown:
        raise ValueError(f"unknown function flags for {name}: {sorted(unknown)}")
    flag_list = ", ".join(f"'{flag}'" for flag in flags)
    return (f"redis.register_function{{function_name = '{name}', flags = {{{flag_list}}},\n"
            f"callback = function(KEYS, ARGV)\n{source.rstrip()}\nend}}\n")


@functools.cache
def library() -> Library:
    """tokenq's library, built once from the script files (docs/decisions/0058)."""
    return build_library({short: load(s.package, s.file) for short, s in SCRIPTS.items()})


def build_library(scripts: Mapping[str, str]) -> Library:
    """The library of ``scripts`` (short name -> source; flags from :data:`SCRIPTS`)."""

    def text(prefix: str) -> str:
        return "".join(function_body(f"{prefix}_{short}", scripts[short], SCRIPTS[short].flags)
                       for short in scripts)

    # The hash is of the code with a fixed name, so the name cannot change what it hashes.
    digest = hashlib.sha1(text("tokenq").encode("utf-8")).hexdigest()[:_HASH_CHARS]
    name = f"{LIBRARY_PREFIX}{digest}"
    code = (f"#!lua name={name}\n"
            "-- tokenq's Lua scripts as Redis functions, built by tokenq.shared.lua_scripts from\n"
            "-- producer/lua and worker/lua; the hash in the names is of this code.\n"
            + text(name))
    return Library(name, code, {short: f"{name}_{short}" for short in scripts}, scripts)


@dataclass(frozen=True, slots=True)
class QueueFullReply:
    """What a ``QUEUEFULL`` refusal says, as Redis sent it ("?" where a word is missing)."""

    length: str
    limit: str
    adding: str | None  # how many entries did not fit; None from scripts before dedupe keys


def parse_queue_full(message: str) -> QueueFullReply | None:
    """The refusal in a script error's ``message``, or None when it is another error."""
    words = message.split()
    if not words or words[0] != QUEUE_FULL:
        return None
    length, limit = [*words[1:3], "?", "?"][:2]
    return QueueFullReply(length, limit, words[3] if len(words) > 3 else None)


OVER_QUOTA = "OVERQUOTA"
"""First word of enqueue's error when new entries would take a tenant past its quota."""


@dataclass(frozen=True, slots=True)
class OverQuotaReply:
    """What an ``OVERQUOTA`` refusal says: the tenant, the pending tokens it holds, its cap,
    the tokens the call would add and its largest request's."""

    tenant: str
    held: int
    cap: int
    adding: int
    largest: int


def parse_over_quota(message: str) -> OverQuotaReply | None:
    """The refusal in a script error's ``message``, or None when it is another error."""
    words = message.split()
    if len(words) != 6 or words[0] != OVER_QUOTA or not all(w.isdigit() for w in words[2:]):
        return None
    held, cap, adding, largest = map(int, words[2:])
    return OverQuotaReply(words[1], held, cap, adding, largest)


def main(argv: Sequence[str] | None = None) -> int:
    """Refresh the fragment copies in the named script files (``--check``: only report)."""
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    stale = []
    for path in (Path(arg) for arg in args if arg != "--check"):
        refreshed, names = _expand(path.read_text("utf-8"), splice=False)
        if names:
            stale.append(path)
            if not check:
                path.write_text(refreshed, "utf-8")
    for path in stale:
        print(f"{'stale' if check else 'refreshed'}: {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
