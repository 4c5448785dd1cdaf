"""The Lua loader: fragments written once, spliced in, and enqueue.lua complete as a file.

Other languages run ``producer/lua/enqueue.lua`` as it is, so it carries a
copy of its fragment (between ``tokenq:include``/``tokenq:end`` lines) that
``tokenq.shared.lua_scripts`` refuses when stale; the other scripts name theirs on
an include line, spliced in at load. The rules a fragment holds appear in no
script outside it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from tests.conftest import REPO_ROOT
from tokenq.shared import keys, lua_scripts
from tokenq.shared.keys import QueueRef

SCRIPTS = {
    "tokenq.producer": ("enqueue.lua", "dlq_retry.lua"),
    "tokenq.worker": ("publish.lua", "drop_consumer.lua"),
}
PATHS = [REPO_ROOT / package.split(".")[1] / "lua" / name
         for package, names in SCRIPTS.items() for name in names]
REGION = re.compile(r"^-- tokenq:include .*?^-- tokenq:end \S+$", re.MULTILINE | re.DOTALL)


@pytest.mark.unit
def test_every_script_loads_with_its_fragments_in_place() -> None:
    for path in PATHS:
        package = f"tokenq.{path.parent.parent.name}"
        source = path.read_text()
        loaded = lua_scripts.load(package, path.name)
        for name in re.findall(r"^-- tokenq:include (\S+)", source, re.MULTILINE):
            assert lua_scripts.fragment(name) in loaded, (path.name, name)
    assert lua_scripts.load("tokenq.producer", "enqueue.lua") == PATHS[0].read_text()  # complete
    assert lua_scripts.main(["--check", *map(str, PATHS)]) == 0


@pytest.mark.unit
def test_a_stale_copy_is_refused_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = lua_scripts.fragment

    def edited(name: str) -> str:
        return real(name).replace('"QUEUEFULL "', '"QUEUEFULL  "')

    monkeypatch.setattr(lua_scripts, "fragment", edited)
    with pytest.raises(lua_scripts.StaleFragment, match=r"run python -m tokenq\.shared\.lua"):
        lua_scripts.load("tokenq.producer", "enqueue.lua")
    spliced = lua_scripts.load("tokenq.producer", "dlq_retry.lua")
    assert '"QUEUEFULL  "' in spliced  # spliced: current
    copy = tmp_path / "enqueue.lua"
    copy.write_text((REPO_ROOT / "producer" / "lua" / "enqueue.lua").read_text())
    assert lua_scripts.main(["--check", str(copy)]) == 1
    assert lua_scripts.main([str(copy)]) == 0 and '"QUEUEFULL  "' in copy.read_text()
    assert lua_scripts.main(["--check", str(copy)]) == 0


@pytest.mark.unit
def test_shared_rules_live_only_in_fragments() -> None:
    for path in PATHS:
        code = [line for line in REGION.sub("", path.read_text()).splitlines()
                if not line.lstrip().startswith("--")]
        text = "\n".join(code)
        assert "QUEUEFULL" not in text and '"dead_' not in text, path


@pytest.mark.unit
def test_queue_full_replies_parse_in_one_place() -> None:
    reply = lua_scripts.QueueFullReply
    assert lua_scripts.parse_queue_full("QUEUEFULL 9 10 2") == reply("9", "10", "2")
    assert lua_scripts.parse_queue_full("QUEUEFULL 9 10") == reply("9", "10", None)
    assert lua_scripts.parse_queue_full("QUEUEFULL") == reply("?", "?", None)
    assert lua_scripts.parse_queue_full("ERR QUEUEFULL 1 2") is None
    assert lua_scripts.parse_queue_full("") is None


def test_both_scripts_that_add_to_a_queue_refuse_alike(r: redis.Redis, queue_name: str) -> None:
    q = QueueRef(queue_name)
    r.xadd(keys.requests(q), {"v": "1", "id": "first", "text": "x"})
    letter = r.xadd(keys.dead(q), {"v": "1", "id": "dead", "text": "y",
                                   "dead_error_code": "dead_letter"}).decode()
    enqueue = r.register_script(lua_scripts.load("tokenq.producer", "enqueue.lua"))
    retry = r.register_script(lua_scripts.load("tokenq.producer", "dlq_retry.lua"))
    refusals = []
    for call in (
        lambda: enqueue(keys=[keys.requests(q)], args=[1, 1, 0, 2, "id", "second", "text", "z"]),
        lambda: retry(keys=[keys.dead(q), keys.requests(q)], args=[1, "0", letter]),
    ):
        with pytest.raises(redis.ResponseError) as caught:
            call()
        refusals.append(lua_scripts.parse_queue_full(str(caught.value)))
    assert refusals == [lua_scripts.QueueFullReply("1", "1", "1")] * 2
    assert r.xlen(keys.requests(q)) == 1 and r.xlen(keys.dead(q)) == 1


# ------------------------------------------------------ the functions library


@pytest.mark.unit
def test_every_script_file_is_a_function_of_the_library() -> None:
    """A script added to producer/lua or worker/lua and not to lua_scripts.SCRIPTS would run by
    EVALSHA, which the documented ACLs no longer grant: every file is in the library."""
    files = {(f"tokenq.{side}", path.name) for side in ("producer", "worker")
             for path in (REPO_ROOT / side / "lua").glob("*.lua")}
    assert {(s.package, s.file) for s in lua_scripts.SCRIPTS.values()} == files
    library = lua_scripts.library()
    assert library.code.startswith(f"#!lua name={library.name}\n")
    for short, script in lua_scripts.SCRIPTS.items():
        source = lua_scripts.load(script.package, script.file)
        assert library.scripts[short] == source and source.rstrip() in library.code
        assert library.functions[short] == f"{library.name}_{short}"


READ_COMMANDS = frozenset({
    "EXISTS", "GET", "HGET", "HGETALL", "HMGET", "HSTRLEN", "INFO", "LINDEX", "LLEN", "LRANGE",
    "PTTL", "SISMEMBER", "SMEMBERS", "TIME", "XINFO", "XLEN", "XPENDING", "XRANGE", "XREVRANGE",
    "ZCARD", "ZRANGE", "ZRANGEBYSCORE",
})
"""Commands that never write: a script that runs only these is a read."""


@pytest.mark.unit
def test_a_script_that_only_reads_runs_while_redis_refuses_writes() -> None:
    """Redis takes an ``FCALL`` of a function not flagged ``no-writes`` for a write, refused by a
    stale primary, a primary short of replicas, or one that cannot save: every script whose
    commands (its fragments' too) are all reads is flagged so, and ``FCALL_RO``, which Redis
    refuses for a function that may write, names only such functions."""
    for short, script in lua_scripts.SCRIPTS.items():
        source = lua_scripts.load(script.package, script.file)
        called = set(re.findall(r"redis\.p?call\(\s*(\"[A-Za-z|]+\"|[^\s,)]+)", source))
        reads_only = {name.strip('"').upper() for name in called} <= READ_COMMANDS
        if reads_only or script.command == "fcall_ro":
            assert "no-writes" in script.flags, f"{short} only reads: flag it no-writes"


@pytest.mark.unit
def test_the_library_is_named_by_its_code() -> None:
    """Another version (any script changed) has other names, so both can be loaded at once;
    the same scripts always give the same names."""
    library = lua_scripts.library()
    assert lua_scripts.build_library(dict(library.scripts)) == library
    edited = {**library.scripts, "enqueue": library.scripts["enqueue"] + "--"}
    changed = lua_scripts.build_library(edited)
    assert changed.name != library.name and changed.name.startswith(lua_scripts.LIBRARY_PREFIX)
    with pytest.raises(ValueError, match="unknown function flags"):
        lua_scripts.function_body("f", "return 1", ["allow-everything"])
