"""Suite ``producer``: what enqueueing costs the web process, on the seed mix.

The producer runs inside a web backend, so its CPU is the caller's. Two
figures: the token estimate alone (microseconds per text, by kind of text:
the estimate is the producer's only per-text work that grows with the text),
and ``submit_many`` end to end against a private redis-server with no
worker (requests per second, in the chunks the other suites use). Run it
with ``--baseline REV`` to see what a change did.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import harness
from texts import seed_mix

from tokenq.producer import Client, estimate_tokens

SIZES = {"tiny": 500, "small": 2000, "full": 5000}
ROUNDS = 5
COLUMNS = ["setting", "texts", "mean_chars", "us_per_text", "requests_per_s"]


def kind_of(text: str) -> str:
    """English (ASCII), or mixed: the seed mix interleaves English and Chinese tokens."""
    return "ascii" if text.isascii() else "mixed scripts"


def estimate_rows(texts: list[str]) -> list[dict[str, Any]]:
    """Microseconds per text for the estimate, per kind of text (best of a few rounds)."""
    rows = []
    groups: dict[str, list[str]] = {"all": texts}
    for text in texts:
        groups.setdefault(kind_of(text), []).append(text)
    for name, group in groups.items():
        best = min(_time_estimates(group) for _ in range(ROUNDS))
        rows.append({
            "setting": f"estimate, {name}",
            "texts": len(group),
            "mean_chars": round(statistics.fmean(len(text) for text in group)),
            "us_per_text": round(best / len(group) * 1e6, 1),
        })
    return rows


def _time_estimates(texts: list[str]) -> float:
    started = time.perf_counter()
    for text in texts:
        estimate_tokens(text)
    return time.perf_counter() - started


def submit_row(url: str, texts: list[str]) -> dict[str, Any]:
    """``submit_many`` of the whole mix in chunks, no worker reading: the producer's rate."""
    rates = []
    for _ in range(3):
        queue = f"producer-{uuid.uuid4().hex[:8]}"
        with Client(redis_url=url, queue=queue, max_queue_length=0) as client:
            client.submit("warm up")  # connection and config read out of the timing
            started = time.perf_counter()
            harness.submit_in_chunks(client, texts)
            rates.append(len(texts) / (time.perf_counter() - started))
    return {
        "setting": f"submit_many, chunks of {harness.SUBMIT_CHUNK}",
        "texts": len(texts),
        "mean_chars": round(statistics.fmean(len(text) for text in texts)),
        "requests_per_s": round(max(rates), 1),
    }


def run(size: str) -> dict[str, Any]:
    texts = seed_mix(SIZES[size]).texts
    rows = estimate_rows(texts)
    with harness.private_redis() as server:
        rows.append(submit_row(server.url, texts))
    submit = rows[-1]["requests_per_s"]
    return {
        "columns": COLUMNS,
        "rows": rows,
        "config": {"mix": "seed (passages and queries, English and Chinese)", "rounds": ROUNDS},
        "notes": [f"submit_many enqueues the seed mix at {submit:,.0f} requests/s"],
    }
