"""Producers that are not Python: Node.js (node-redis + @msgpack/msgpack) and redis-cli.

Both follow docs/PROTOCOL.md only: a plain XADD (or the enqueue script),
a bounded BLPOP on the reply key, one msgpack map. The Node test installs
its two packages into a temporary directory and is skipped when node/npm are
missing or the install fails (no network).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tests.conftest import REPO_ROOT
from tests.support import DIM, MAX_INPUT
from tokenq.shared import keys, lua_scripts
from tokenq.shared.keys import QueueRef
from tokenq.worker.backends.sim import expected_vector

ENQUEUE_SCRIPT = lua_scripts.load("tokenq.producer", "enqueue.lua")

pytest_plugins = ("tests.cli_fixtures",)

NODE_PRODUCER = r"""
const { createClient, commandOptions } = require("redis");
const { decode } = require("@msgpack/msgpack");

async function main() {
  const [url, stream, replyKey, id, text] = process.argv.slice(2);
  const client = createClient({ url });
  await client.connect();
  const entry = await client.xAdd(stream, "*", {
    v: "1", id, text, tokens: "4", reply_to: replyKey,
  });
  // Read the reply as bytes: the embedding is msgpack bin (little-endian float32).
  const popped = await client.blPop(commandOptions({ returnBuffers: true }), replyKey, 30);
  if (popped === null) throw new Error("no reply in 30 s");
  const reply = decode(popped.element);
  const out = { entry, id: reply.id, ok: reply.ok, dim: reply.dim, embedding: [] };
  if (reply.ok) {
    const b = reply.embedding;
    const view = new DataView(b.buffer, b.byteOffset, b.byteLength);
    for (let i = 0; i < reply.dim; i++) out.embedding.push(view.getFloat32(4 * i, true));
  } else {
    out.error = reply.error;
  }
  console.log(JSON.stringify(out));
  await client.quit();
}

main().catch((error) => { console.error(error); process.exit(1); });
"""


@pytest.fixture(scope="module")
def node_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with node-redis 4 and @msgpack/msgpack installed, or skip."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed")
    project = tmp_path_factory.mktemp("node")
    try:
        subprocess.run(
            [npm, "install", "--prefix", str(project), "--no-audit", "--no-fund", "--silent",
             "redis@4", "@msgpack/msgpack@3"],
            check=True, capture_output=True, timeout=180,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"npm install failed (offline?): {exc}")
    (project / "producer.js").write_text(NODE_PRODUCER)
    return project


def assert_vector(values: list[float] | bytes, text: str) -> None:
    got = np.frombuffer(values, "<f4") if isinstance(values, bytes) else np.asarray(values)
    np.testing.assert_allclose(got, expected_vector(text, DIM, MAX_INPUT), atol=1e-6)


def test_node_producer_gets_its_embedding(node_project, sim_worker, redis_url, queue_name):
    sim_worker()
    q = QueueRef(queue_name)
    request_id = f"node-{uuid.uuid4().hex[:8]}"
    text = "hello from node.js"
    done = subprocess.run(
        ["node", str(node_project / "producer.js"), redis_url, keys.requests(q),
         keys.reply(q, request_id), request_id, text],
        capture_output=True, text=True, timeout=60, cwd=node_project,
    )
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["ok"] is True and reply["id"] == request_id and reply["dim"] == DIM
    assert_vector(reply["embedding"], text)


def redis_cli(port: int, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True,
                          timeout=30)


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_redis_cli_producer_with_the_enqueue_script(sim_worker, redis_server, queue_name):
    sim_worker()
    q = QueueRef(queue_name)
    request_id = f"cli-{uuid.uuid4().hex[:8]}"
    text = "what is a token budget?"
    # docs/PROTOCOL.md section 4, verbatim but for the queue: backpressure via the script.
    enqueued = redis_cli(
        redis_server.port, "--eval", str(REPO_ROOT / "producer" / "lua" / "enqueue.lua"),
        keys.requests(q), ",", "100000", "1", "0", "5", "v", "1", "id", request_id,
        "text", text, "tokens", "9", "reply_to", keys.reply(q, request_id),
    )
    assert enqueued.returncode == 0 and b"-" in enqueued.stdout, enqueued
    # Raw bytes out of redis-cli (--no-raw would escape them): decode the map in Python.
    popped = redis_cli(redis_server.port, "--raw", "BLPOP", keys.reply(q, request_id), "20")
    lines = popped.stdout.split(b"\n", 1)
    assert lines[0].decode() == keys.reply(q, request_id), popped
    body = msgpack.unpackb(lines[1].removesuffix(b"\n"), raw=False)
    assert body["ok"] is True and body["id"] == request_id and body["dim"] == DIM
    assert_vector(body["embedding"], text)


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_redis_cli_enqueue_script_refuses_a_full_queue(redis_server, queue_name, r):
    q = QueueRef(queue_name)
    r.xadd(keys.requests(q), {"v": "1", "id": "first", "text": "x"})
    refused = redis_cli(
        redis_server.port, "--eval", str(REPO_ROOT / "producer" / "lua" / "enqueue.lua"),
        keys.requests(q), ",", "1", "1", "0", "3", "v", "1", "id", "second", "text", "y",
    )
    assert b"QUEUEFULL 1 1" in refused.stdout + refused.stderr
    assert r.xlen(keys.requests(q)) == 1


@pytest.mark.unit
def test_the_documented_script_file_is_what_the_python_client_runs():
    """Other languages run producer/lua/enqueue.lua as it is: it is complete, fragments and all."""
    source = (REPO_ROOT / "producer" / "lua" / "enqueue.lua").read_text(encoding="utf-8")
    assert source == ENQUEUE_SCRIPT == lua_scripts.assemble(source)
    assert "local function queue_full(" in source
