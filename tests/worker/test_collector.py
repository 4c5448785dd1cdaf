"""The worker's garbage collector settings (worker/process.py): startup frozen, the
youngest generation widened, cycles still freed; and a real worker draining a backlog
without collecting every few dozen requests."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.worker.test_metrics import scrape
from tokenq.producer import Client
from tokenq.worker.tooling.embedded import free_port

pytest_plugins = ("tests.cli_fixtures",)

BACKLOG = 4_000


def test_settling_freezes_startup_and_still_frees_cycles() -> None:
    code = textwrap.dedent("""
        import gc
        from tokenq.worker import process as collector
        collector.settle_after_startup()
        assert gc.isenabled()
        assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
        assert gc.get_threshold()[0] == collector.YOUNG_THRESHOLD
        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2, "a cycle made after startup is still found and freed"
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


def collections(port: int, generation: str) -> float:
    samples = scrape(port)["python_gc_collections_total"]
    return sum(value for labels, value in samples.items()
               if ("generation", generation) in labels)


def test_a_worker_draining_a_backlog_seldom_collects(sim_worker, redis_url, queue_name):
    """Every request read stays alive until answered, so at Python's default threshold
    (700) a backlog of 4,000 short requests set off dozens of young collections; at the
    worker's it sets off a handful, and no full one walks what startup made."""
    port = free_port()
    sim_worker("--metrics-port", str(port), "--metrics-host", "127.0.0.1",
               "--max-batch-tokens", "8192")
    young, full = collections(port, "0"), collections(port, "2")
    texts = [f"request {i} " + "word " * (i % 5) for i in range(BACKLOG)]
    with Client(redis_url=redis_url, queue=queue_name, max_queue_length=0) as client:
        ids = client.submit_many(texts)
        replies = client.results(ids, timeout_s=120)
    assert [reply.id for reply in replies] == ids and all(reply.embedding for reply in replies)
    assert collections(port, "0") - young <= 8
    assert collections(port, "2") - full == 0
