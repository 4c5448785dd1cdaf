"""Per-tenant figures: pending tokens, served tokens and p50 latency in the heartbeat, the
metrics and ``tokenq stats``, bounded whatever tenant names a hostile producer sends."""

from __future__ import annotations

import json
import time

import pytest

from tests.support import wait_for
from tests.worker.test_metrics import scrape, scraped
from tokenq.producer import Client
from tokenq.producer.ops.stats import main as stats_main
from tokenq.shared import keys
from tokenq.shared.heartbeat import OTHER_TENANTS, Heartbeat, decode_heartbeat, encode_heartbeat
from tokenq.shared.queue_depth import bounded
from tokenq.worker import metrics
from tokenq.worker.batch_stats import MAX_TENANT_LABELS, TenantTally
from tokenq.worker.pipeline.jobs import Answer
from tokenq.worker.tooling.embedded import free_port

pytest_plugins = ("tests.cli_fixtures",)

HOSTILE = 1000


def answers(n: int, enqueued_ms: int, counted: int = 10) -> list[Answer]:
    return [Answer(f"{enqueued_ms}-{i}".encode(), "r", b"", ok=True, counted=counted)
            for i in range(n)]


@pytest.mark.unit
def test_a_thousand_tenants_are_64_named_and_the_rest_one_label_in_heartbeat_and_metrics():
    tally, registry = TenantTally(), metrics.Metrics("q")
    for i, tenant in enumerate([f"t{i}" for i in range(HOSTILE)] + [keys.DEFAULT_TENANT]):
        label = tally.answered(tenant, answers(2, 1000), now_epoch_ms=1000 + i)
        registry.answered(answers(2, 1000), now_epoch_ms=1000 + i, tenant=label)
    figures = tally.snapshot()  # the default tenant keeps its name, answered last as it is
    assert figures is not None and len(figures) == MAX_TENANT_LABELS + 1
    assert figures["t0"] == [2, 20, 0] and figures["t62"][:2] == [2, 20] and "t63" not in figures
    assert figures[keys.DEFAULT_TENANT][:2] == [2, 20]
    assert figures[OTHER_TENANTS][:2] == [2 * (HOSTILE - 63), 20 * (HOSTILE - 63)]
    assert tally.label("t5") == "t5" and tally.label("new") == OTHER_TENANTS
    raw = encode_heartbeat(Heartbeat(tenants=figures))
    assert len(raw) < 4096  # 65 short labels; 64-character names: under 6 KB
    assert decode_heartbeat(raw).tenants == figures
    text = scraped(registry)
    labels = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("tokenq_tenant_tokens_total{")}
    assert len(labels) == MAX_TENANT_LABELS + 1 and OTHER_TENANTS in labels
    series = [line for line in text.splitlines() if line.startswith("tokenq_tenant_")]
    assert len(series) <= (MAX_TENANT_LABELS + 1) * (2 + len(metrics.WAIT_BUCKETS) + 3 + 1)


@pytest.mark.unit
def test_a_tenants_p50_is_of_its_recent_answers():
    tally = TenantTally()
    tally.answered("a", answers(3, 1000), now_epoch_ms=1100)
    tally.answered("a", answers(2, 1000), now_epoch_ms=1500)
    tally.answered("b", [Answer(b"1000-0", None, b"", ok=True)][:0], now_epoch_ms=2000)
    assert tally.snapshot() == {"a": [5, 50, 300]}  # one age a publish; b settled nothing


@pytest.mark.unit
def test_pending_tokens_by_tenant_read_the_hash_and_a_thousand_stay_bounded():
    raw = {b"tokens": b"100", b"tokens:a": b"30", b"tokens:b": b"5", b"tokens:a b": b"9",
           b"tokens:default": b"7", b"other": b"1", b"tokens:c": b"x"}
    assert keys.tenant_pending(raw) == {keys.DEFAULT_TENANT: 65, "a": 30, "b": 5}
    assert keys.tenant_pending({}) == {keys.DEFAULT_TENANT: 0}
    assert keys.tenant_pending({"tokens": "3", "tokens:a": "9"})[keys.DEFAULT_TENANT] == 0
    hostile = {f"t{i}": i for i in range(HOSTILE)}
    kept = bounded(hostile, MAX_TENANT_LABELS)
    assert len(kept) == MAX_TENANT_LABELS + 1 and "t999" in kept and "t0" not in kept
    assert sum(kept.values()) == sum(hostile.values())
    registry = metrics.Metrics("q")
    registry.tenant_pending(kept)
    registry.tenant_pending({"a": 1})  # labels gone from the top are removed, not left stale
    assert scraped(registry).count("tokenq_tenant_pending_tokens{") == 1  # a, not default


def test_stats_and_metrics_show_each_tenants_pending_served_and_p50(
        sim_worker, redis_url, r, queue_name, capsys):
    q = keys.QueueRef(queue_name)
    port = free_port()
    sim_worker("--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.infer_many([f"a's text {i}" for i in range(6)], tenant="a", timeout_s=30)
        client.infer_many([f"b's text {i}" for i in range(3)], tenant="b", timeout_s=30)
        client.infer("the default tenant's", timeout_s=30)
    r.hset(keys.pending(q), mapping={"tokens:a": 40})  # as enqueue writes a tenant's field

    def doc() -> dict:
        assert stats_main(["--redis-url", redis_url, "--json", "--queue", queue_name]) == 0
        return json.loads(capsys.readouterr().out)

    wait_for(lambda: sum(t["requests"] for t in doc()["queues"][0]["tenants"]) == 10,
             what="a heartbeat with every tenant's answers")
    rows = {t["tenant"]: t for t in doc()["queues"][0]["tenants"]}
    assert set(rows) == {keys.DEFAULT_TENANT, "a", "b"}
    assert rows["a"]["pending_tokens"] == 40 and rows["b"]["pending_tokens"] == 0
    assert [rows[t]["requests"] for t in ("a", "b", keys.DEFAULT_TENANT)] == [6, 3, 1]
    assert rows["a"]["tokens"] > rows["b"]["tokens"] > 0 and rows["a"]["tokens_per_s"] > 0
    assert all(0 <= rows[t]["p50_ms"] < 30_000 for t in rows)
    assert stats_main(["--redis-url", redis_url, "--queue", queue_name]) == 0
    text = capsys.readouterr().out
    assert "pending tokens" in text and "\n  a " in text
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(port)
        pending = samples.get("tokenq_tenant_pending_tokens", {})
        if pending.get((("queue", queue_name), ("tenant", "a"))) == 40 or \
                time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert pending[(("queue", queue_name), ("tenant", "a"))] == 40
    served = samples["tokenq_tenant_requests_total"]
    assert served[(("queue", queue_name), ("tenant", "a"))] == 6
    assert served[(("queue", queue_name), ("tenant", keys.DEFAULT_TENANT))] == 1
    assert samples["tokenq_tenant_request_duration_seconds_count"][
        (("queue", queue_name), ("tenant", "b"))] == 3
