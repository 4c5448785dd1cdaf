"""``tokenq embed``: a file through a real queue and sim workers, in order, resumably."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest

from tests.cli_support import DIM, MAX_INPUT, tokenq, wait_for
from tests.test_acl import documented_rules
from tokenq.producer.ops.embed import _settled_counters
from tokenq.producer.ops.embed import main as embed_main
from tokenq.shared import keys
from tokenq.shared.keys import QueueRef
from tokenq.worker.backends.sim import expected_vector

pytest_plugins = ("tests.cli_fixtures",)

VOCABULARY = ["alpha", "beta", "gamma", "token", "budget", "queue", "redis", "batch"]


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(1, 120)))
            for _ in range(n)]


def expected(text: str) -> np.ndarray:
    return expected_vector(text, DIM, MAX_INPUT)


def embed(capsys: pytest.CaptureFixture[str], redis_url: str, queue: str, *args: str) -> tuple:
    code = embed_main([*args, "--redis-url", redis_url, "--queue", queue, "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.err


def test_text_file_to_npy_in_input_order(sim_worker, redis_url, queue_name, tmp_path, capsys):
    sim_worker(name="a")
    sim_worker(name="b")
    lines = texts(300)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.npy"
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out),
                      "--chunk-size", "64", "--batch-size", "16", "--max-in-flight", "64")
    assert code == 0, err
    matrix = np.load(out)
    assert matrix.shape == (300, DIM) and matrix.dtype == np.float32
    for i, text in enumerate(lines):
        np.testing.assert_allclose(matrix[i], expected(text), atol=1e-6)
    assert not (tmp_path / "out.npy.partial").exists()
    assert not (tmp_path / "out.npy.errors.jsonl").exists()
    assert "300 inputs this run" in err and "requests/s" in err and "tokens/s" in err
    assert "batches" in err and "padding efficiency" in err and "FAILED" not in err


def test_jsonl_in_and_out_keeps_ids_and_reports_bad_rows(
    sim_worker, redis_url, queue_name, tmp_path, capsys
):
    sim_worker()
    records = [{"id": f"doc-{i}", "body": text} for i, text in enumerate(texts(20, seed=1))]
    lines = [json.dumps(record) for record in records]
    lines[3] = json.dumps({"id": "doc-3"})  # no text field
    lines[7] = "{not json"
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "vectors.jsonl"
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out),
                      "--field", "body", "--chunk-size", "8")
    assert code == 1 and "FAILED: 2 inputs" in err and "bad_input 2" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(20))
    for i, row in enumerate(rows):
        if i in (3, 7):
            assert row["error"]["code"] == "bad_input" and "embedding" not in row
            continue
        assert row["id"] == f"doc-{i}" and row["tokens"] > 0
        np.testing.assert_allclose(row["embedding"], expected(records[i]["body"]), atol=1e-6)
    assert rows[3]["id"] == "doc-3"


def test_failed_rows_are_nan_in_npy_with_an_errors_file(
    sim_worker, redis_url, queue_name, tmp_path, capsys
):
    sim_worker()
    source = tmp_path / "in.txt"
    source.write_text("first line\n\n   \nlast line\n")
    out = tmp_path / "out.npy"
    code, _ = embed(capsys, redis_url, queue_name, str(source), "--output", str(out))
    assert code == 1
    matrix = np.load(out)
    assert matrix.shape == (4, DIM)
    assert np.isnan(matrix[1]).all() and np.isnan(matrix[2]).all()
    np.testing.assert_allclose(matrix[3], expected("last line"), atol=1e-6)
    errors = [json.loads(line) for line in (tmp_path / "out.npy.errors.jsonl").read_text()
              .splitlines()]
    assert [e["index"] for e in errors] == [1, 2]
    assert errors[0]["error"]["code"] == "bad_input"


def test_interrupted_run_resumes_where_it_stopped(
    sim_worker, redis_url, queue_name, tmp_path, worker_env
):
    # A slow device so the run is still going when it is interrupted.
    sim_worker("--sim-batch-ms", "40", "--max-batch-size", "8")
    lines = texts(400, seed=2)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.npy"
    args = [str(source), "--output", str(out), "--chunk-size", "40", "--batch-size", "8",
            "--max-in-flight", "16", "--no-progress"]
    env = {k: v for k, v in worker_env.items() if k != "TOKENQ_QUEUE"}
    env.update(TOKENQ_QUEUE=queue_name)
    first = subprocess.Popen([sys.executable, "-m", "tokenq.shared.cli", "embed", *args],
                             env=env, stderr=subprocess.PIPE, text=True)
    partial = tmp_path / "out.npy.partial"
    wait_for(lambda: len(list(partial.glob("*.done"))) >= 2, timeout=30,
             what="two finished chunks")
    first.send_signal(signal.SIGINT)
    _, first_err = first.communicate(timeout=20)
    assert first.returncode == 130, first_err
    assert "run the same command again to resume" in first_err
    assert not out.exists()
    done_before = len(list(partial.glob("*.done")))
    assert 2 <= done_before < 10

    # Same command again: skips the finished chunks, finishes the rest.
    second = tokenq("embed", *args, env=env, timeout=60)
    assert second.returncode == 0, second.stderr
    assert f"resuming: {done_before} chunks" in second.stderr
    assert f"{done_before * 40} from an earlier run" in second.stderr
    matrix = np.load(out)
    assert matrix.shape == (400, DIM)
    for i, text in enumerate(lines):
        np.testing.assert_allclose(matrix[i], expected(text), atol=1e-6)
    assert not partial.exists()


def test_resume_refuses_a_changed_run_until_restart(
    sim_worker, redis_url, queue_name, tmp_path, capsys
):
    source = tmp_path / "in.txt"
    source.write_text("one\ntwo\n")
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    partial.mkdir()
    (partial / "manifest.json").write_text(json.dumps({"version": 1, "input": "elsewhere"}))
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out))
    assert code == 2 and "--restart" in err and "input" in err
    sim_worker()
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out),
                      "--restart")
    assert code == 0, err
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1]


def test_stdin_input_and_bad_output_suffix(sim_worker, redis_url, queue_name, tmp_path,
                                           worker_env):
    sim_worker()
    env = {**worker_env, "TOKENQ_QUEUE": queue_name}
    out = tmp_path / "s.jsonl"
    done = tokenq("embed", "-", "--output", str(out), "--no-progress", env=env,
                  stdin=b"from stdin\nsecond\n")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    np.testing.assert_allclose(rows[1]["embedding"], expected("second"), atol=1e-6)
    bad = tokenq("embed", "-", "--output", str(tmp_path / "x.csv"), env=env, stdin=b"")
    assert bad.returncode == 2 and b".npy or .jsonl" in bad.stderr


def test_inputs_a_reject_queue_refuses_fail_alone(sim_worker, redis_url, queue_name, tmp_path,
                                                   capsys):
    sim_worker("--policy", "reject", "--sim-max-input-tokens", "64")
    lines = ["short one", "word " * 200, "short two"]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out))
    assert code == 1 and "too_long 1" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[1]["error"]["code"] == "too_long"
    for i in (0, 2):
        np.testing.assert_allclose(rows[i]["embedding"], expected_vector(lines[i], DIM, 64),
                                   atol=1e-6)


@pytest.mark.parametrize("skew_s", [-3600.0, 3600.0])
def test_the_summary_waits_for_one_more_heartbeat_of_each_live_worker_on_no_clock(
    skew_s, r, queue_name, monkeypatch
):
    """Heartbeat ``at`` is the worker's clock: never compared with the operator's."""
    q = QueueRef(queue_name)
    r.hset(keys.workers(q), "live", msgpack.packb({"at": 1000.0, "batches": 1}))
    r.set(keys.worker_alive(q, "live"), "1", ex=30)
    r.hset(keys.workers(q), "gone", msgpack.packb({"at": 10.0, "batches": 5}))  # no liveness
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)
    beat = threading.Timer(0.6, lambda: r.hset(keys.workers(q), "live",
                                               msgpack.packb({"at": 1001.0, "batches": 7})))
    beat.start()
    started = time.monotonic()
    try:
        after = _settled_counters(r, q)
    finally:
        beat.cancel()
    waited = time.monotonic() - started
    assert after["live"]["batches"] == 7 and after["gone"]["batches"] == 5
    assert 0.5 <= waited < 2.5, waited  # waited for the beat, not for the gone row


def test_a_producer_acl_user_embeds_without_the_workers_summary(
    sim_worker, redis_url, r, queue_name, tmp_path, capsys
):
    """docs/SECURITY.md's producer without its optional reads of the workers' keys: a note,
    not a crash."""
    rules = [
        rule for rule in documented_rules(queue_name, "producer-pw")["producer"]
        if not rule.endswith((":workers", ":worker:*"))
    ]
    r.execute_command(*rules)
    try:
        sim_worker()
        source = tmp_path / "in.txt"
        source.write_text("one\ntwo\n")
        out = tmp_path / "out.jsonl"
        host_port = redis_url.split("://", 1)[1]
        url = f"redis://{rules[2]}:producer-pw@{host_port}"
        code, err = embed(capsys, url, queue_name, str(source), "--output", str(out))
        assert code == 0, err
        assert "may not read" in err and "summary leaves out" in err and "Traceback" not in err
        assert "producer-pw" not in err
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        np.testing.assert_allclose(rows[1]["embedding"], expected("two"), atol=1e-6)
    finally:
        r.acl_deluser(rules[2])
