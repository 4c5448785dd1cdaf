"""A Ctrl-C that a library turns into its own error is still an interruption (exit 130).

The class: pydantic's serializer catches a ``KeyboardInterrupt`` raised inside
one of its callbacks and raises ``PydanticSerializationError`` instead (CI
caught ``tokenq embed`` exiting 1 with a traceback when the signal landed in
``model_dump``). These tests make the signal land exactly there, in a real
pydantic serializer, at both layers that answer an interrupt: every
command's guard (``shared/cli.py``) and ``tokenq embed``'s own handler.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pydantic
import pytest
from pydantic_core import PydanticSerializationError

from tests.cli_support import tokenq
from tests.support import DIM
from tokenq.shared.cli import run_command
from tokenq.shared.exit_codes import EXIT_INTERRUPTED
from tokenq.shared.interrupts import InterruptRecord, unwrapped
from tokenq.shared.settings import StatsSettings

pytest_plugins = ("tests.cli_fixtures",)


class Signalled(pydantic.BaseModel):
    """A model whose serializer delivers SIGINT to this process, as a Ctrl-C landing there."""

    value: int = 0

    @pydantic.field_serializer("value")
    def _signal(self, value: int) -> int:
        os.kill(os.getpid(), signal.SIGINT)
        return value


class Failing(pydantic.BaseModel):
    """A model whose serializer fails on its own: no interrupt anywhere."""

    value: int = 0

    @pydantic.field_serializer("value")
    def _fail(self, value: int) -> int:
        raise RuntimeError("a serializer bug")


@pytest.mark.unit
def test_pydantic_really_wraps_the_interrupt():
    """The premise: without the record, the Ctrl-C comes out as pydantic's own error."""
    with pytest.raises(PydanticSerializationError, match="KeyboardInterrupt"):
        Signalled().model_dump()


@pytest.mark.unit
def test_a_wrapped_interrupt_exits_130_from_any_command(capsys):
    code = run_command(StatsSettings, [], "tokenq stats", lambda settings: Signalled().model_dump())
    assert code == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "tokenq stats: interrupted" in err and "Traceback" not in err
    # The handler is back to Python's own once the command is done.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.unit
def test_an_error_with_no_interrupt_behind_it_is_not_mistaken_for_one():
    with pytest.raises(PydanticSerializationError, match="a serializer bug"):
        run_command(StatsSettings, [], "tokenq stats", lambda settings: Failing().model_dump())


@pytest.mark.unit
def test_the_record_leaves_a_handler_someone_else_installed_alone():
    def own(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, own)
    try:
        record = InterruptRecord()
        with record.recording():
            assert signal.getsignal(signal.SIGINT) is own
        with pytest.raises(PydanticSerializationError), unwrapped(lambda: record.seen):
            Signalled().model_dump()  # ``own`` raised it; the record saw nothing
        assert not record.seen
    finally:
        signal.signal(signal.SIGINT, previous)


def test_embed_interrupted_inside_pydantic_keeps_its_resume_hint(
    sim_worker, queue_name, tmp_path, worker_env
):
    """The exact CI failure: the signal lands while the client dumps its settings."""
    source = tmp_path / "in.txt"
    source.write_text("one\ntwo\n")
    out = tmp_path / "out.jsonl"
    script = textwrap.dedent("""
        import os, signal, sys
        import pydantic
        from tokenq.producer.ops import embed

        class Signalled(pydantic.BaseModel):
            value: int = 0

            @pydantic.field_serializer("value")
            def _signal(self, value):
                os.kill(os.getpid(), signal.SIGINT)
                return value

        real = embed.Client

        def interrupted_client(**kwargs):
            Signalled().model_dump()
            return real(**kwargs)

        embed.Client = interrupted_client
        sys.exit(embed.main(sys.argv[1:]))
    """)
    process = subprocess.run(
        [sys.executable, "-c", script, str(source), "--output", str(out), "--no-progress"],
        env={**worker_env, "TOKENQ_QUEUE": queue_name}, capture_output=True, text=True,
        timeout=60)
    assert process.returncode == EXIT_INTERRUPTED, process.stderr
    assert "run the same command again to resume" in process.stderr
    assert "Traceback" not in process.stderr
    assert not out.exists()
    # And it resumes: the same command, uninterrupted, answers every line once, in order.
    sim_worker()
    again = tokenq("embed", str(source), "--output", str(out), "--no-progress",
                   env={**worker_env, "TOKENQ_QUEUE": queue_name}, timeout=60)
    assert again.returncode == 0, again.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == [0, 1]
    assert all(len(row["embedding"]) == DIM for row in rows)
