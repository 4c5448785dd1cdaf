"""``tokenq embed``: a file through a real queue and sim workers, in order, resumably."""

from __future__ import annotations

import array
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tests.cli_support import interrupted_at, tokenq
from tests.faults.test_acl import documented_rules
from tests.support import DIM, MAX_INPUT, wait_for
from tokenq.producer import Result
from tokenq.producer.ops import embed_io
from tokenq.producer.ops.embed import Tally, _settled_counters, pump
from tokenq.producer.ops.embed import main as embed_main
from tokenq.producer.ops.embed_io import Checkpoint, Row
from tokenq.shared import keys
from tokenq.shared.keys import QueueRef
from tokenq.shared.settings import EmbedSettings
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
    code, _ = embed(capsys, redis_url, queue_name, str(source), "--output", str(out),
                    "--blank", "error")
    assert code == 1
    matrix = np.load(out)
    assert matrix.shape == (4, DIM)
    assert np.isnan(matrix[1]).all() and np.isnan(matrix[2]).all()
    np.testing.assert_allclose(matrix[3], expected("last line"), atol=1e-6)
    errors = [json.loads(line) for line in (tmp_path / "out.npy.errors.jsonl").read_text()
              .splitlines()]
    assert [e["index"] for e in errors] == [1, 2]
    assert errors[0]["error"]["code"] == "bad_input"


def _saved(stderr: str) -> int:
    """How many inputs a resumed run found done (finished chunks and saved rows)."""
    match = re.search(r"resuming: (\d+) chunks? of (\d+) and (\d+) more inputs? already done",
                      stderr)
    if match is None:
        return 0
    return int(match[1]) * int(match[2]) + int(match[3])


def test_interruptions_at_any_point_lose_nothing_and_double_nothing(
    sim_worker, queue_name, tmp_path, worker_env
):
    """Defaults: the file is smaller than one chunk, the case where a Ctrl-C saved nothing.

    Interrupted before anything came back, twice after some did (SIGINT, then
    SIGTERM), then run to the end: every line is in the output exactly once,
    in order, and every interruption kept what had come back."""
    # A slow device so each run is still going when it is interrupted.
    worker = sim_worker("--sim-batch-ms", "60", "--max-batch-size", "8")
    records = [{"id": f"doc-{i}", "text": text} for i, text in enumerate(texts(240, seed=2))]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    args = ["embed", str(source), "--output", str(out), "--batch-size", "8",
            "--max-in-flight", "32", "--no-progress"]
    env = {**worker_env, "TOKENQ_QUEUE": queue_name}

    def rows_run() -> int:
        return sum(batch["rows"] for batch in worker.batches())

    def interrupted(sig: signal.Signals, ready: object, settle_s: float = 0.0) -> str:
        started = rows_run()

        def when() -> None:
            # ``ready`` sees how many rows the worker ran since this run started.
            wait_for(lambda: partial.exists() and ready(rows_run() - started), timeout=30,
                     what="the point to interrupt at")
            # Rows the worker ran are published at once, but the client takes them a
            # moment later: on a loaded machine, give it that moment (about two batches).
            time.sleep(settle_s)

        code, err = interrupted_at(args, env, sig, when)
        assert code == 130, err
        assert "run the same command again to resume" in err and "Traceback" not in err
        assert not out.exists()
        return err

    interrupted(signal.SIGINT, lambda ran: True)  # as soon as it has started
    saved = [_saved(interrupted(signal.SIGINT, lambda ran: ran >= 64, settle_s=0.15))]
    # The run above had at most 32 inputs out and 32 abandoned ahead of them: with 64
    # rows run, some of its own results were back, and the interruption kept them.
    saved.append(_saved(interrupted(signal.SIGTERM, lambda ran: ran >= 64, settle_s=0.15)))
    last = tokenq(*args, env=env, timeout=60)
    assert last.returncode == 0, last.stderr
    saved.append(_saved(last.stderr))
    assert saved[1] > saved[0] and saved[2] > saved[1], saved
    assert f"{saved[2]} from an earlier run" in last.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(records)))
    assert [row["id"] for row in rows] == [record["id"] for record in records]
    for row, record in zip(rows, records, strict=True):
        np.testing.assert_allclose(row["embedding"], expected(record["text"]), atol=1e-6)
    assert not partial.exists()


def test_a_resume_sends_only_what_no_earlier_run_saved(
    sim_worker, redis_url, queue_name, tmp_path, capsys
):
    """Chunks finished and rows saved of an unfinished chunk, in .npy: only the rest goes out."""
    worker = sim_worker()
    lines = texts(50, seed=3)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.npy"
    args = [str(source), "--output", str(out), "--chunk-size", "20"]
    code, err = embed(capsys, redis_url, queue_name, *args)
    assert code == 0, err
    whole = np.load(out)
    ran = sum(batch["rows"] for batch in worker.batches())
    # What an interrupted run leaves: chunk 0 finished, and rows 20-24 of chunk 1.
    checkpoint = Checkpoint(out, {"version": 1, **Checkpoint.describe_input(str(source)),
                                  "format": "text", "field": None, "chunk_size": 20,
                                  "blank": "skip", "queue": queue_name, "prefix": "tokenq"})
    checkpoint.open(restart=False)
    checkpoint.set_dim(DIM)
    checkpoint.write_chunk(0, [Row(i, None, vector=whole[i].tolist(), tokens=1) for i in range(20)])
    checkpoint.write_partial(1, [Row(i, None, vector=whole[i].tolist(), tokens=1)
                                 for i in range(20, 25)])
    checkpoint.close()
    out.unlink()
    code, err = embed(capsys, redis_url, queue_name, *args)
    assert code == 0, err
    assert "resuming: 1 chunk of 20 and 5 more inputs already done" in err
    assert "25 inputs this run, 25 from an earlier run" in err
    assert sum(batch["rows"] for batch in worker.batches()) - ran == 25
    np.testing.assert_array_equal(np.load(out), whole)


def test_requests_carry_deadlines_so_workers_drop_abandoned_ones(
    sim_worker, redis_url, queue_name, tmp_path, r, worker_env
):
    """Nobody waits for a reply after --timeout-s: no worker spends device time on it."""
    q = QueueRef(queue_name)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(texts(12, seed=4)) + "\n")
    env = {**worker_env, "TOKENQ_QUEUE": queue_name}
    gave_up = tokenq("embed", str(source), "--output", str(tmp_path / "o.jsonl"),
                     "--timeout-s", "1", "--no-progress", env=env)
    assert gave_up.returncode == 1 and "timeout 12" in gave_up.stderr, gave_up.stderr
    entries = r.xrange(keys.requests(q))
    assert len(entries) == 12
    assert all(0 < int(fields[b"timeout_ms"]) <= 1000 for _, fields in entries)
    worker = sim_worker()  # starts after every deadline passed
    wait_for(lambda: r.xlen(keys.requests(q)) == 0, timeout=20, what="the stream to drain")
    assert worker.batches() == []


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
        if ":worker" not in rule  # the selector of the workers' keys
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


# ------------------------------------------------------------ what a new user hit


def test_progress_goes_to_stderr(sim_worker, queue_name, tmp_path, worker_env):
    sim_worker()
    source = tmp_path / "in.txt"
    source.write_text("\n".join(texts(10, seed=5)) + "\n")
    done = tokenq("embed", str(source), "--output", str(tmp_path / "o.jsonl"),
                  env={**worker_env, "TOKENQ_QUEUE": queue_name})
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "embed" in done.stderr and "10/10" in done.stderr


class _Gated:
    """A client whose ``results`` answers a group only once the test opens its gate."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.texts: dict[str, str] = {}
        self.lock = threading.Lock()

    def gate(self, first_text: str) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(first_text, threading.Event())

    def submit_many(self, texts: list[str], *, unique: list[str], **_: object) -> list[str]:
        with self.lock:
            self.texts.update(zip(unique, texts, strict=True))
        return unique

    def results(self, ids: list[str], *_: object, **__: object) -> list[Result]:
        assert self.gate(self.texts[ids[0]]).wait(30), "the test never opened this group's gate"
        return [Result(i, array.array("f", [1.0, 0.0]), 2, None, 1) for i in ids]

    def forget(self, ids: list[str]) -> None:
        pass


class _Seen:
    """A progress bar that only counts."""

    def __init__(self) -> None:
        self.n = 0

    def advance(self, n: int) -> None:
        self.n += n

    def close(self) -> None:
        pass


@pytest.mark.unit
def test_progress_moves_as_groups_finish_in_any_order(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("a\nb\nc\nd\n")
    out = tmp_path / "out.jsonl"
    settings = EmbedSettings(file=str(source), output=out, batch_size=2, max_in_flight=4)
    checkpoint = Checkpoint(out, {"version": 1, "chunk_size": settings.chunk_size})
    checkpoint.open(restart=False)
    client, seen, failed = _Gated(), _Seen(), []

    def run() -> None:
        try:
            pump(settings, client, checkpoint, Tally(), seen,  # type: ignore[arg-type]
                 contextlib.nullcontext)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        client.gate("c").set()  # the second group is answered first
        wait_for(lambda: seen.n == 2, timeout=10, what="progress for the second group")
    finally:
        client.gate("a").set()
        thread.join(30)
    assert not failed and seen.n == 4
    checkpoint.assemble()
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1, 2, 3]


def test_an_empty_input_is_a_matrix_of_the_queues_width(
    sim_worker, redis_url, queue_name, tmp_path, capsys
):
    source = tmp_path / "empty.txt"
    source.write_text("")
    out = tmp_path / "out.npy"
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out))
    assert code == 1 and not out.exists()
    assert "no input gave a vector" in err and "no config hash" in err, err
    sim_worker()  # publishes the queue's config, dim included
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out))
    assert code == 0, err
    assert np.load(out).shape == (0, DIM)


def test_most_of_the_first_chunk_failing_alike_stops_before_sending_the_rest(
    sim_worker, redis_url, queue_name, tmp_path, r, capsys
):
    worker = sim_worker()
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"body": text}) + "\n" for text in texts(50, seed=6)))
    out = tmp_path / "out.npy"
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out),
                      "--chunk-size", "10")  # the text is in "body": --field was forgotten
    assert code == 1
    assert ("stopped early: 10 of the 10 inputs on lines 1-10 failed the same way, e.g. line 1: "
            "bad_input: no non-empty string field 'text'") in err, err
    assert "--field" in err and "requests/s" not in err
    assert r.xlen(keys.requests(QueueRef(queue_name))) == 0 and worker.batches() == []
    assert not out.exists() and not (tmp_path / "out.npy.partial").exists()


def test_a_first_chunk_the_workers_refuse_stops_the_run(sim_worker, queue_name, tmp_path,
                                                        worker_env):
    worker = sim_worker("--policy", "reject", "--sim-max-input-tokens", "64")
    lines = ["word " * 200] * 8 + ["short"] * 42  # the first chunk: 8 of 10 too long
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    done = tokenq("embed", str(source), "--output", str(tmp_path / "o.jsonl"), "--no-progress",
                  "--chunk-size", "10", "--batch-size", "5", "--max-in-flight", "10",
                  env={**worker_env, "TOKENQ_QUEUE": queue_name})
    assert done.returncode == 1, done.stderr
    assert "stopped early: 8 of the 10 inputs on lines 1-10 failed the same way" in done.stderr
    assert "e.g. line 1: too_long" in done.stderr
    assert sum(batch["rows"] for batch in worker.batches()) < 42  # the rest never all ran


def test_throughput_counts_only_what_succeeded(sim_worker, redis_url, queue_name, tmp_path,
                                               capsys):
    sim_worker()
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"body": text}) + "\n" for text in texts(5, seed=7)))
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output",
                      str(tmp_path / "o.jsonl"))  # no --field body: every line fails
    assert code == 1
    assert " 0.0 requests/s " in err and "(0 inputs embedded)" in err, err
    assert "FAILED: 5 inputs in total (bad_input 5)" in err
    assert "e.g. line 1: bad_input: no non-empty string field 'text'" in err


@pytest.mark.unit
def test_a_result_prints_short():
    vector = Result("r1", array.array("f", [0.5, -0.25, 0.125] * 128), 384, None, 7)
    assert repr(vector) == (
        "Result(id='r1', dim=384, embedding=[0.5, -0.25, 0.125, … 384 values], tokens=7)")
    labelled = Result("r2", None, None, (0.9, 0.1), 5, ("pos", "neg"))
    assert repr(labelled) == "Result(id='r2', scores={'pos': 0.9, 'neg': 0.1}, tokens=5)"
    many = Result("r3", None, None, tuple(float(i) for i in range(10)), None)
    assert repr(many) == "Result(id='r3', scores=[0, 1, 2, … 10 values], tokens=None)"


@pytest.mark.unit
def test_an_interruption_keeps_what_finished_among_cancelled_and_failed_groups():
    """What an interruption saves: groups that finished with rows, whatever else the pool
    holds; a group cancelled before it was sent (``cancel_futures``) must not raise."""
    from concurrent.futures import Future

    from tokenq.producer import ReplyTimeout
    from tokenq.producer.ops.embed import answered

    done, failed, cancelled, running = Future(), Future(), Future(), Future()
    done.set_result(["row"])
    failed.set_exception(ReplyTimeout(["r1"], 1.0))
    cancelled.cancel()
    running.set_running_or_notify_cancel()
    assert answered([done, failed, cancelled, running]) == [done]


INTERRUPT_WHILE_OPENING = """
import os, signal, sys
from tokenq.producer.ops import embed_io
from tokenq.shared.cli import main

opened = embed_io.Checkpoint.open

def open_then_ctrl_c(self, *args, **kwargs):
    done = opened(self, *args, **kwargs)  # the directory exists now
    os.kill(os.getpid(), signal.SIGINT)
    return done

embed_io.Checkpoint.open = open_then_ctrl_c
sys.exit(main(sys.argv[1:]))
"""


def test_a_ctrl_c_while_the_checkpoint_opens_still_says_how_to_resume(
    redis_url, queue_name, tmp_path, worker_env
):
    """The checkpoint directory appears before the run's own Ctrl-C handling starts; a
    signal landing in between got the dispatcher's bare "interrupted", with no word of the
    saved progress (seen in CI). It is held until the checkpoint is open, then answered."""
    source = tmp_path / "in.txt"
    source.write_text("one\ntwo\n")
    out = tmp_path / "out.jsonl"
    process = subprocess.run(
        [sys.executable, "-c", INTERRUPT_WHILE_OPENING, "embed", str(source), "--output",
         str(out), "--no-progress"],
        env={**worker_env, "TOKENQ_QUEUE": queue_name}, stderr=subprocess.PIPE, text=True,
        timeout=60,
    )
    assert process.returncode == 130, process.stderr
    assert "run the same command again to resume" in process.stderr, process.stderr
    assert "Traceback" not in process.stderr
    assert (tmp_path / "out.jsonl.partial").is_dir() and not out.exists()


def test_no_progress_help_says_what_the_flag_does():
    """It read "--no-progress  turn off: show a progress bar on stderr"."""
    done = tokenq("embed", "--help")
    assert done.returncode == 0
    [line] = [line for line in done.stdout.splitlines() if line.strip().startswith("--no-progress")]
    assert "no progress bar" in line and "turn off: show" not in line


class Crash(BaseException):
    """A crash injected between two file steps (nothing in the command catches it)."""


class CrashingOs:
    """``embed_io``'s ``os``: once armed, every file step (replace, unlink, rmdir) from the
    ``at``-th on raises :class:`Crash`, as if the process had died before it."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.steps = 0
        self.armed = False

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def _step(self) -> None:
        if self.armed:
            if self.steps >= self.at:
                raise Crash(f"crashed before file step {self.at}")
            self.steps += 1

    def replace(self, *args: object) -> None:
        self._step()
        os.replace(*args)  # type: ignore[arg-type]

    def unlink(self, *args: object) -> None:
        self._step()
        os.unlink(*args)  # type: ignore[arg-type]

    def rmdir(self, *args: object) -> None:
        self._step()
        os.rmdir(*args)  # type: ignore[arg-type]


def test_a_crash_at_any_step_of_completion_leaves_what_a_rerun_finishes(
    sim_worker, redis_url, queue_name, tmp_path, capsys, monkeypatch
):
    """Joining the chunks and removing the checkpoint, crashed before each file step in
    turn: the rerun finishes the output or says it is complete, with the same exit
    status (one input failed), and leaves nothing behind."""
    sim_worker()
    lines = texts(10, seed=9)
    lines[1] = ""  # one bad_input row (--blank error): the errors file is part of the output
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    assemble = embed_io.Checkpoint.assemble

    def crashing_run(at: int, out: Path) -> CrashingOs:
        fake = CrashingOs(at)

        def armed(checkpoint: Checkpoint, *args: object) -> int:
            fake.armed = True  # only the completion's steps count
            return assemble(checkpoint, *args)

        with monkeypatch.context() as patch:
            patch.setattr(embed_io, "os", fake)
            patch.setattr(embed_io.Checkpoint, "assemble", armed)
            try:
                code, err = embed(capsys, redis_url, queue_name, str(source), "--output",
                                  str(out), "--chunk-size", "4", "--blank", "error")
            except Crash:
                capsys.readouterr()
            else:
                assert code == 1, err
        return fake

    steps = crashing_run(10_000, tmp_path / "whole.npy").steps  # how many there are
    assert steps >= 10  # two joins, the rename, the files, the directory
    said: list[str] = []
    for at in range(steps):
        folder = tmp_path / f"crash-{at}"
        folder.mkdir()
        out = folder / "out.npy"
        assert crashing_run(at, out).armed
        code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out),
                          "--chunk-size", "4", "--blank", "error")
        assert code == 1, (at, err)
        assert ("already complete" in err and "1 input failed" in err) or "wrote" in err, err
        said.append("complete" if "already complete" in err else "wrote")
        matrix = np.load(out)
        assert np.isnan(matrix[1]).all()
        for i in (0, 2, 9):
            np.testing.assert_allclose(matrix[i], expected(lines[i]), atol=1e-6)
        errors = (folder / "out.npy.errors.jsonl").read_text().splitlines()
        assert [json.loads(line)["index"] for line in errors] == [1]
        assert sorted(p.name for p in folder.iterdir()) == ["out.npy", "out.npy.errors.jsonl"]
    # Crashed before the rename, the rerun joins again; after it, the output is complete
    # (until the last step, when only the empty directory is left: a fresh run).
    assert said[:3] == ["wrote"] * 3 and said[3:-1] == ["complete"] * (steps - 4), said


@pytest.mark.parametrize("changed", [{"model": "another-model"}, {"dim": "16"}],
                         ids=["same-width", "another-width"])
def test_a_resume_under_another_model_is_refused_naming_both(
    sim_worker, redis_url, queue_name, r, tmp_path, capsys, monkeypatch, changed
):
    sim_worker()
    source = tmp_path / "in.txt"
    source.write_text("\n".join(texts(6, seed=4)) + "\n")
    out = tmp_path / "out.npy"
    args = (str(source), "--output", str(out), "--chunk-size", "4")

    def crash(checkpoint: Checkpoint, *args: object) -> int:
        raise Crash("stopped before joining")

    with monkeypatch.context() as patch:  # every chunk saved, the output not yet written
        patch.setattr(embed_io.Checkpoint, "assemble", crash)
        with pytest.raises(Crash):
            embed(capsys, redis_url, queue_name, *args)
    capsys.readouterr()
    r.hset(keys.config(QueueRef(queue_name)), mapping=changed)  # the queue now serves another
    code, err = embed(capsys, redis_url, queue_name, *args)
    assert code == 2 and not out.exists(), err
    [line] = err.strip().splitlines()
    new = f"model {changed.get('model', 'sim')} (sim, embed, dim {changed.get('dim', DIM)})"
    assert f"model sim (sim, embed, dim {DIM})" in line and new in line, line
    assert "--restart" in line
    r.hset(keys.config(QueueRef(queue_name)), mapping={"model": "sim", "dim": str(DIM)})
    code, err = embed(capsys, redis_url, queue_name, *args)  # the same model again: resumes
    assert code == 0 and "resuming: 2 chunks" in err, err
    assert np.load(out).shape == (6, DIM)


@pytest.mark.unit
def test_vectors_of_another_width_in_one_checkpoint_are_refused(tmp_path):
    """When no config could be compared, a chunk of another width is still refused."""
    checkpoint = Checkpoint(tmp_path / "out.npy", {"version": 1, "chunk_size": 2, "queue": "q"})
    checkpoint.open(restart=False)
    checkpoint.set_dim(4)
    rows = [Row(0, None, vector=[0.5] * 4), Row(1, None, vector=[0.5] * 3)]
    with pytest.raises(embed_io.ResumeMismatch, match=r"3 values where .* have 4.*--restart"):
        checkpoint.write_chunk(0, rows)
    checkpoint.close()
    assert not list(checkpoint.directory.glob("chunk-*"))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], None]]:
    """A tmpfs of ``size`` at ``tmp_path/disk`` (the test resizes it); skipped without root."""
    disk = tmp_path / "disk"
    disk.mkdir()

    def size(value: str, *, first: bool = False) -> None:
        options = f"size={value}" if first else f"remount,size={value}"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            if first:
                pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
            raise AssertionError(done.stderr)

    size("400k", first=True)
    try:
        yield size
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.parametrize(("disk_size", "failing"), [
    ("400k", "out.npy"),  # the chunks fit, the joined output does not
    ("100k", "out.npy.partial/chunk-"),  # a chunk does not fit
])
def test_a_full_disk_fails_naming_the_file_and_leaves_no_temporary_file(
    sim_worker, queue_name, tmp_path, worker_env, small_disk, disk_size, failing
):
    sim_worker()
    small_disk(disk_size)
    lines = texts(2000, seed=6)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    disk = tmp_path / "disk"
    out = disk / "out.npy"
    args = ["embed", str(source), "--output", str(out), "--chunk-size", "500", "--no-progress"]
    env = {**worker_env, "TOKENQ_QUEUE": queue_name}
    done = tokenq(*args, env=env, timeout=120)
    assert done.returncode == 1, (done.returncode, done.stderr)  # not a SIGBUS (-7, 135)
    [line] = done.stderr.strip().splitlines()
    assert f"cannot write {disk / failing}" in line and "No space left on device" in line
    assert "run the same command again to resume" in line and "Traceback" not in line
    assert not out.exists()
    leftovers = [p.name for p in disk.rglob("*") if ".tmp" in p.name]
    assert leftovers == []
    small_disk("4m")  # room again: the same command finishes from its checkpoint
    done = tokenq(*args, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    matrix = np.load(out)
    assert matrix.shape == (2000, DIM)
    for i in (0, 999, 1999):
        np.testing.assert_allclose(matrix[i], expected(lines[i]), atol=1e-6)
    assert sorted(p.name for p in disk.iterdir()) == ["out.npy"]
