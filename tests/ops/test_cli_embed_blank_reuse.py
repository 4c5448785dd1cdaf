"""``tokenq embed``: blank inputs are skipped (or errors, by choice), and an interrupted
run's requests are reused by the next run instead of being computed twice."""

from __future__ import annotations

import json
import signal

import numpy as np

from tests.cli_support import interrupted_at, tokenq
from tests.ops.test_cli_embed import embed, expected, texts
from tests.support import DIM, wait_for
from tokenq.producer.ops.embed_io import Checkpoint, Row
from tokenq.shared import keys
from tokenq.shared.keys import QueueRef

pytest_plugins = ("tests.cli_fixtures",)


def test_blank_lines_are_skipped_and_listed_beside_an_npy(
    sim_worker, redis_url, queue_name, tmp_path, capsys
):
    sim_worker()
    lines = ["first", "", "   ", "second", "\t", "third"]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.npy"
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out))
    assert code == 0, err
    kept = [i for i, line in enumerate(lines) if line.strip()]
    blank = [i for i, line in enumerate(lines) if not line.strip()]
    matrix = np.load(out)
    assert matrix.shape == (len(kept), DIM)
    for row, index in enumerate(kept):
        np.testing.assert_allclose(matrix[row], expected(lines[index]), atol=1e-6)
    skipped = (tmp_path / "out.npy.skipped.txt").read_text().split()
    assert [int(index) for index in skipped] == blank
    assert f"skipped {len(blank)} blank inputs" in err and "FAILED" not in err
    assert not (tmp_path / "out.npy.errors.jsonl").exists()
    # Written again with nothing blank: no stale list of skipped lines is left beside it.
    source.write_text("only\n")
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out))
    assert code == 0, err
    assert not (tmp_path / "out.npy.skipped.txt").exists()


def test_a_blank_jsonl_text_field_is_skipped_like_a_blank_line(
    sim_worker, redis_url, queue_name, tmp_path, capsys
):
    """An empty or whitespace-only text field is blank; a missing field is still an error."""
    sim_worker()
    records = [{"id": "a", "text": "alpha"}, {"id": "b", "text": ""}, None,
               {"id": "c", "text": "  "}, {"id": "d", "text": "delta"}, {"id": "e"}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(("" if r is None else json.dumps(r)) + "\n" for r in records))
    out = tmp_path / "out.jsonl"
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out))
    assert code == 1 and "FAILED: 1 input" in err and "skipped 3 blank inputs" in err, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["index"], row["id"]) for row in rows] == [(0, "a"), (4, "d"), (5, "e")]
    np.testing.assert_allclose(rows[1]["embedding"], expected("delta"), atol=1e-6)
    assert rows[2]["error"]["code"] == "bad_input"
    # --blank error: every line has a row, the blank ones errors.
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out),
                      "--blank", "error")
    assert code == 1 and "FAILED: 4 inputs" in err, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(records)))
    assert [row["index"] for row in rows if "error" in row] == [1, 2, 3, 5]


def test_a_resume_under_another_blank_policy_is_refused(
    redis_url, queue_name, tmp_path, capsys
):
    """The manifest records the policy: the saved rows were numbered under it."""
    source = tmp_path / "in.txt"
    source.write_text("one\n\ntwo\n")
    out = tmp_path / "out.jsonl"
    checkpoint = Checkpoint(out, {"version": 1, **Checkpoint.describe_input(str(source)),
                                  "format": "text", "field": None, "chunk_size": 2048,
                                  "blank": "skip", "queue": queue_name, "prefix": "tokenq"})
    checkpoint.open(restart=False)
    checkpoint.write_partial(0, [Row(0, None, vector=[1.0] * DIM, tokens=1)])
    checkpoint.close()
    manifest = json.loads((tmp_path / "out.jsonl.partial" / "manifest.json").read_text())
    assert manifest["blank"] == "skip" and len(manifest["requests"]) == 16
    code, err = embed(capsys, redis_url, queue_name, str(source), "--output", str(out),
                      "--blank", "error")
    assert code == 2 and "blank changed" in err and "--restart" in err, err
    assert (tmp_path / "out.jsonl.partial" / "chunk-000000.part.jsonl").exists()


def _entries_added(r, queue: str) -> int:
    return int(r.xinfo_stream(keys.requests(QueueRef(queue)))["entries-added"])


def test_an_interrupted_runs_requests_are_reused_not_computed_again(
    sim_worker, r, queue_name, tmp_path, worker_env
):
    """SIGINT with requests still queued, then the same command: every non-blank line once,
    in order, and the workers computed each exactly once (no request was written twice)."""
    worker = sim_worker("--sim-batch-ms", "80", "--max-batch-size", "8")
    lines = texts(160, seed=7)
    for at in (5, 6, 70, 159):
        lines[at] = " " * (at % 3)
    kept = [i for i, line in enumerate(lines) if line.strip()]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["embed", str(source), "--output", str(out), "--batch-size", "8",
            "--max-in-flight", "64", "--chunk-size", "32", "--no-progress"]
    env = {**worker_env, "TOKENQ_QUEUE": queue_name}

    def rows_run() -> int:
        return sum(batch["rows"] for batch in worker.batches())

    code, err = interrupted_at(args, env, signal.SIGINT, lambda: wait_for(
        lambda: rows_run() >= 24, timeout=30, what="some rows computed"))
    assert code == 130, err
    sent = _entries_added(r, queue_name)
    assert sent > rows_run(), "the interruption left nothing queued: no reuse was tested"
    last = tokenq(*args, env=env, timeout=90)
    assert last.returncode == 0, last.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == kept
    for row in rows:
        np.testing.assert_allclose(row["embedding"], expected(lines[row["index"]]), atol=1e-6)
    # The bound: no request written or computed twice (rerun within dedupe_ttl_s).
    assert _entries_added(r, queue_name) == len(kept)
    wait_for(lambda: rows_run() >= len(kept), timeout=10, what="the worker's last batch")
    assert rows_run() == len(kept)
    # Replies are kept until their chunk is written, then deleted: none is left behind.
    assert list(r.scan_iter(keys.reply_prefix(QueueRef(queue_name)) + "*")) == []
