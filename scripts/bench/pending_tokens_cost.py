"""What keeping the pending tokens costs Redis, paired on one redis-server: the enqueue and
publish functions of several commits (each its own library, loaded side by side) take turns,
round by round, on queues of their own. Redis-side time is INFO commandstats' ``fcall``
µs per call; bytes an entry are ``MEMORY USAGE`` of the stream and the pending hash over
the entries held (with no pending hash: the stream alone).

    .venv/bin/python scripts/bench/pending_tokens_cost.py --revs d9a4fd1 180c393 tree

``tree`` is the working tree. Entries are what ``Client`` writes (``wire.call_fields`` and
``own_fields``: ``v id text tokens reply_to``), with no dedupe; each publish answers one
enqueued batch with 512-byte replies to one reply key.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from tokenq.shared import keys, wire

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ((256, 400), (32, 100), (1, 100))
"""(entries a call, characters a text)."""


def library_of(rev: str, scratch: Path) -> dict[str, Any]:
    """The Functions library (code, function names) of ``rev``'s scripts."""
    if rev == "tree":
        tree = ROOT
    else:
        tree = scratch / rev
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "producer", "worker",
                                  "shared"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    package = scratch / f"pkg-{rev}" / "tokenq"
    package.mkdir(parents=True)
    for part in ("producer", "worker", "shared"):
        (package / part).symlink_to(tree / part)
    code = ("import json; from tokenq.shared import lua_scripts as s; lib = s.library(); "
            "print(json.dumps({'code': lib.code, 'functions': dict(lib.functions)}))")
    found = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, cwd=scratch,
                           env={**os.environ, "PYTHONPATH": str(package.parent)})
    lib = dict(json.loads(found.stdout))
    # Whether publish takes each answer's counted tokens from the worker (after its payload).
    lib["counted_arg"] = "counted (the entry's counted tokens" in (
        tree / "worker" / "lua" / "publish.lua").read_text()
    return lib


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fcall_usec(r: redis.Redis) -> tuple[int, int]:
    stats = r.info("commandstats").get("cmdstat_fcall", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def entries(n: int, chars: int, start: int) -> list[Any]:
    """enqueue.lua's ARGV after its first three: n entries as Client writes them."""
    shared = wire.call_fields({}, None, 0)
    args: list[Any] = []
    for i in range(start, start + n):
        fields = wire.own_fields(shared, f"r{i}", ("x" * chars)[:chars], chars // 4,
                                 "tokenq:{b}:reply:c", None)
        args += [len(fields), *(part for pair in fields.items() for part in pair)]
    return args


def one_round(r: redis.Redis, label: str, lib: dict[str, Any], n: int, chars: int,
              calls: int, start: int) -> dict[str, float]:
    q = keys.QueueRef(f"bench-{label}-{n}")
    stream, dead, reply = keys.requests(q), keys.dead(q), keys.reply(q, "c")
    enqueue, publish = lib["functions"]["enqueue"], lib["functions"]["publish"]
    r.delete(stream, dead, reply, keys.pending(q))
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    batches = [entries(n, chars, start + c * n) for c in range(calls)]
    r.config_resetstat()
    for args in batches:
        r.fcall(enqueue, 1, stream, 0, n, 0, *args)
    done, usec = fcall_usec(r)
    enqueue_us = usec / done
    held = r.xlen(stream)
    memory = (r.memory_usage(stream, samples=0) or 0) + (
        r.memory_usage(keys.pending(q), samples=0) or 0)
    read = [r.xreadgroup(keys.GROUP, "c", {stream: ">"}, count=n)[0][1] for _ in range(calls)]
    r.config_resetstat()
    for batch in read:
        args: list[Any] = [keys.GROUP, "c", 60_000, 1000, 4096, len(batch)]
        for entry_id, fields in batch:
            counted = [wire.counted_of(fields)] if lib["counted_arg"] else []
            args += [entry_id, 3, b"p" * 512, *counted, 0]
        r.fcall(publish, 3, stream, dead, reply, *args)
    done, usec = fcall_usec(r)
    assert r.xlen(stream) == 0, "publish left entries"
    r.delete(stream, dead, reply, keys.pending(q))
    return {"enqueue_us": enqueue_us, "publish_us": usec / done, "bytes": memory / held}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revs", nargs="+", default=["d9a4fd1", "180c393", "tree"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="enqueue calls a round")
    opts = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            libs = {rev: library_of(rev, Path(scratch)) for rev in opts.revs}
        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        print(r.info("server")["redis_version"], "redis-server")
        for lib in libs.values():
            r.function_load(lib["code"], replace=True)
        for n, chars in SHAPES:
            seen: dict[str, list[dict[str, float]]] = {rev: [] for rev in opts.revs}
            for k in range(opts.rounds):
                order = opts.revs[k % len(opts.revs):] + opts.revs[:k % len(opts.revs)]
                for rev in order:
                    seen[rev].append(one_round(r, rev, libs[rev], n, chars, opts.calls,
                                               k * opts.calls * n))
            base = opts.revs[0]
            print(f"\n{n} x {chars}-char entries, {opts.rounds} rounds x {opts.calls} calls: "
                  f"µs a call (median, min) and the median of each round's ratio to {base}")
            for rev in opts.revs:
                line = f"  {rev:10}"
                for m in ("enqueue_us", "publish_us"):
                    values = [x[m] for x in seen[rev]]
                    ratio = statistics.median(x[m] / b[m] for x, b in zip(seen[rev], seen[base],
                                                                          strict=True))
                    line += (f"  {m[:-3]} {statistics.median(values):7.1f} {min(values):7.1f} "
                             f"({ratio:.2f}x)")
                held = statistics.median(x["bytes"] for x in seen[rev])
                line += f"  {held:6.1f} B/entry"
                print(line)
        r.close()
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
