"""Operator commands fail with one line and a documented status, never a traceback.

The class-level test runs the real ``tokenq`` command (a subprocess, the
console script's entry point) for every producer-side subcommand against
every way Redis can be unusable: nothing listening, a listener that never
answers, a wrong password, an ACL user without the rights, and tokenq keys of
the wrong type. Each must exit 1 with a last stderr line
``tokenq <cmd>: <message>`` that names the problem and the URL with its
password masked. The rest are the operator's own mistakes (ids that are not
there, a URL redis-py cannot parse) and the message helpers.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from tests.cli_support import tokenq
from tests.redis_server import free_port
from tokenq.shared import keys
from tokenq.shared.errors import BrokerUnavailable, QueueFull
from tokenq.shared.exit_codes import EXIT_FAILED
from tokenq.shared.failures import CommandFailed, failure_message
from tokenq.shared.keys import QueueRef
from tokenq.shared.redis_url import redact as redact_url
from tokenq.shared.settings import (
    DlqSettings,
    EmbedSettings,
    FunctionsSettings,
    StatsSettings,
    TopSettings,
    UpSettings,
    env_var,
    is_positional,
)
from tokenq.shared.text import one_line
from tokenq.worker.settings import WorkerSettings

SECRET = "s3cret-Pw"


def commands(queue: str, tmp_path: Path) -> dict[str, list[str]]:
    """Every producer-side subcommand that touches Redis (the URL is added after)."""
    source = tmp_path / "in.txt"
    source.write_text("one line\nanother line\n")
    return {
        "stats": ["stats", "--queue", queue],
        "stats --json": ["stats", "--json", "--queue", queue],
        "top --once": ["top", "--once", "--queue", queue],
        "dlq list": ["dlq", "list", "--queue", queue],
        "dlq retry --all": ["dlq", "retry", "--all", "--queue", queue],
        "dlq retry --id": ["dlq", "retry", "--id", "1-0", "--queue", queue],
        "dlq purge --all": ["dlq", "purge", "--all", "--queue", queue],
        "dlq purge --id": ["dlq", "purge", "--id", "1-0", "--queue", queue],
        "embed": ["embed", str(source), "--output", str(tmp_path / "out.jsonl"),
                  "--no-progress", "--queue", queue, "--timeout-s", "5"],
    }


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield listener.getsockname()[1]
    listener.close()


@pytest.fixture
def acl_user(r: redis.Redis) -> Iterator[str]:
    """An ACL user with the password SECRET who may only connect (every read is NOPERM)."""
    name = f"tq-{uuid.uuid4().hex[:8]}"
    r.acl_setuser(name, enabled=True, passwords=[f"+{SECRET}"], keys=["*"],
                  commands=["+@connection"])
    yield name
    r.acl_deluser(name)


def _with_user(redis_url: str, user: str, password: str) -> str:
    parts = urlsplit(redis_url)
    return parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}").geturl()


# kind -> (how to get the URL, what the message must say)
FAILURES: dict[str, str] = {
    "refused": "cannot reach Redis at",
    "silent": "no answer within --socket-timeout-s",
    "bad password": "refused the login",
    "no permission": "refused a command to this ACL user",
    "wrong type": "is a string, not a",
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_every_subcommand_reports_an_unusable_redis_in_one_line(
    kind, redis_url, r, queue_name, tmp_path, silent_port, acl_user
):
    q = QueueRef(queue_name)
    host = urlsplit(redis_url).hostname
    urls: dict[str, Callable[[], str]] = {
        "refused": lambda: f"redis://tq:{SECRET}@{host}:{free_port()}/0",
        "silent": lambda: f"redis://tq:{SECRET}@127.0.0.1:{silent_port}/0",
        "bad password": lambda: _with_user(redis_url, acl_user, SECRET + "-wrong"),
        "no permission": lambda: _with_user(redis_url, acl_user, SECRET),
        "wrong type": lambda: redis_url,
    }
    if kind == "wrong type":
        for key in (keys.requests(q), keys.dead(q), keys.workers(q), keys.config(q)):
            r.set(key, "not tokenq's")
    url = urls[kind]()
    shown = redact_url(url)
    table = commands(queue_name, tmp_path)
    # All at once: the silent listener costs each one its socket timeout.
    running = {
        name: subprocess.Popen(
            [sys.executable, "-m", "tokenq.shared.cli", *argv, "--redis-url", url,
             "--socket-timeout-s", "0.5"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, argv in table.items()
    }
    failures = []
    for name, process in running.items():
        out, err = process.communicate(timeout=120)
        lines = err.strip().splitlines()
        last = lines[-1] if lines else ""
        prog = "tokenq " + table[name][0]
        problems = []
        if process.returncode != EXIT_FAILED:
            problems.append(f"exit {process.returncode}")
        if "Traceback" in err:
            problems.append("a traceback")
        if not last.startswith(f"{prog}: "):
            problems.append(f"last line not '{prog}: …'")
        if FAILURES[kind] not in last:
            problems.append(f"no {FAILURES[kind]!r}")
        if kind == "wrong type":
            if f"tokenq:{{{queue_name}}}:" not in last:
                problems.append("the key is not named")
        elif shown not in last:
            problems.append(f"the URL {shown} is not named")
        if SECRET in err + out:
            problems.append("the password is shown")
        if problems:
            failures.append(f"{name}: {', '.join(problems)}\n    stderr: {err.strip()!r}")
    assert not failures, "\n".join(failures)
    if kind == "wrong type":  # nothing was deleted or overwritten either
        assert r.get(keys.dead(q)) == b"not tokenq's" == r.get(keys.requests(q))
    if kind != "no permission":  # unusable before the run: nothing was written
        assert not (tmp_path / "out.jsonl.partial").exists()


def _letter(r: redis.Redis, q: QueueRef, request_id: str) -> str:
    fields = {"v": "1", "id": request_id, "text": "t", "dead_error_code": "dead_letter"}
    return r.xadd(keys.dead(q), fields).decode()


@pytest.mark.parametrize(("argv", "reported"), [
    (["retry", "--id", "nonexist-0"], "not in the dead stream: nonexist-0 (not a stream entry id)"),
    (["purge", "--id", "1-0"], "not in the dead stream: 1-0"),
    (["list", "--id", "99-0"], "not in the dead stream: 99-0"),
    (["retry", "--id", "2", "--id", "x"], "not in the dead stream: x (not a stream entry id), 2-0"),
    (["purge", "--id", "18446744073709551616-0"],
     "not in the dead stream: 18446744073709551616-0 (not a stream entry id)"),
])
def test_ids_that_are_not_there_are_named_and_exit_1(argv, reported, redis_url, queue_name, r):
    kept = _letter(r, QueueRef(queue_name), "stays")
    done = tokenq("dlq", *argv, "--redis-url", redis_url, "--queue", queue_name)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"tokenq dlq: {reported}"
    assert [i.decode() for i, _ in r.xrange(keys.dead(QueueRef(queue_name)))] == [kept]


def test_a_bare_millisecond_id_is_its_seq_0_entry_never_a_range(redis_url, queue_name, r):
    """``XRANGE 5 5`` would match 5-1 while ``XDEL 5`` deletes 5-0: the letter was doubled."""
    q = QueueRef(queue_name)
    r.xadd(keys.dead(q), {"v": "1", "id": "five", "text": "t"}, id="5-1")
    done = tokenq("dlq", "retry", "--id", "5", "--redis-url", redis_url, "--queue", queue_name)
    assert done.returncode == 1 and "not in the dead stream: 5-0" in done.stderr
    assert r.xlen(keys.dead(q)) == 1 and r.xlen(keys.requests(q)) == 0
    done = tokenq("dlq", "retry", "--id", "5-1", "--redis-url", redis_url, "--queue", queue_name)
    assert done.returncode == 0, done.stderr
    assert r.xlen(keys.dead(q)) == 0 and r.xlen(keys.requests(q)) == 1


@pytest.mark.parametrize("url", ["redis://127.0.0.1:99999/0", "redis://127.0.0.1:port/0"])
def test_a_url_redis_py_cannot_parse_is_a_usage_error(url, queue_name):
    for argv in (["stats"], ["dlq", "list"]):
        done = tokenq(*argv, "--redis-url", url, "--queue", queue_name)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert "--redis-url" in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.unit
def test_failure_messages_by_kind():
    url = f"redis://ops:{SECRET}@h:6379/0"
    cases: list[tuple[BaseException, str | None]] = [
        (redis.ConnectionError("Error 111 connecting"), "cannot reach Redis at redis://ops:***@h"),
        (redis.TimeoutError("Timeout reading"), "no answer within --socket-timeout-s 0.5"),
        (redis.AuthenticationError("invalid username-password pair"), "refused the login"),
        (redis.exceptions.NoPermissionError("no permissions to run 'xlen'"), "ACL user"),
        (redis.ResponseError("Command # 1 (XDEL k 1-0) of pipeline caused error: WRONGTYPE x"),
         "wrong type"),
        (redis.ResponseError("ERR boom\nscript: " + "a" * 40 + ", on @user_script:3."),
         "answered an error: ERR boom"),
        (QueueFull("queue 'q' holds 2 of at most 2"), "holds 2 of at most 2"),
        (BrokerUnavailable("Redis at redis://x is unreachable"), "unreachable"),
        (CommandFailed("said it all"), "said it all"),
        (PermissionError(13, "Permission denied", "/out.npy.partial"), "Permission denied"),
        (ValueError("a bug"), None),  # not an operational failure: its traceback is the report
    ]
    for exc, expected in cases:
        message = failure_message(exc, url, 0.5)
        if expected is None:
            assert message is None
            continue
        assert message is not None and expected in message, (exc, message)
        assert "\n" not in message and SECRET not in message and "user_script" not in message


@pytest.mark.unit
def test_redact_url_masks_every_password():
    assert redact_url(f"redis://u:{SECRET}@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url(f"redis://:{SECRET}@h:1/0") == "redis://:***@h:1/0"
    assert SECRET not in redact_url(f"rediss://h:1/0?password={SECRET}&ssl_cert_reqs=none")
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert one_line("a\n  b\n\nc") == "a b c"


# ----------------------------------------------------------------- flags, help and version

SUBCOMMAND_MAINS = {
    "worker": "tokenq.worker.cli",
    "up": "tokenq.worker.tooling.up",
    "embed": "tokenq.producer.ops.embed",
    "stats": "tokenq.producer.ops.stats",
    "top": "tokenq.producer.ops.top",
    "dlq": "tokenq.producer.ops.dlq",
    "functions": "tokenq.producer.ops.functions",
}


def _main(name: str) -> Callable[[list[str]], int]:
    return importlib.import_module(SUBCOMMAND_MAINS[name]).main


@pytest.mark.unit
@pytest.mark.parametrize(("name", "argv", "named"), [
    ("worker", ["--socket-timeout-s", "0"], "--socket-timeout-s / TOKENQ_SOCKET_TIMEOUT_S: "),
    ("up", ["--queue", "bad q"], "--queue / TOKENQ_QUEUE: queue name 'bad q' is invalid"),
    ("embed", ["in.txt", "--output", "o.jsonl", "--batch-size", "0"],
     "--batch-size / TOKENQ_BATCH_SIZE: "),
    ("stats", ["--socket-timeout-s", "0"], "--socket-timeout-s / TOKENQ_SOCKET_TIMEOUT_S: "),
    ("top", ["--interval-s", "0"], "--interval-s / TOKENQ_INTERVAL_S: "),
    ("dlq", ["list", "--count", "0"], "--count / TOKENQ_COUNT: "),
])
def test_every_subcommand_names_the_flag_and_variable_of_a_bad_setting(name, argv, named, capsys):
    assert _main(name)(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokenq {name}: invalid settings:\n"), err
    assert named in err and "Traceback" not in err


def test_the_worker_blames_the_setting_at_fault_not_a_made_up_flag():
    done = tokenq("worker", "--block-ms", "20000", "--socket-timeout-s", "5")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "tokenq worker: invalid settings:",
        "  --block-ms / TOKENQ_BLOCK_MS: block_ms (20000) must be shorter than socket_timeout_s "
        "(5.0s), or blocking reads would time out",
    ]


@pytest.mark.unit
def test_the_worker_refuses_a_bad_hf_option_before_loading_anything(capsys):
    assert _main("worker")(["--backend", "hf", "--dtype", "int8"]) == 2
    assert "--dtype / TOKENQ_DTYPE: " in capsys.readouterr().err


LEFTOVERS = ("null", "{str", "--as-json", "--no-json", "--no-once", "--no-all", "--progress ",
             "(default: )", "(default: False)", "``", "list[")


@pytest.mark.unit
@pytest.mark.parametrize("name", list(SUBCOMMAND_MAINS))
def test_help_of_every_subcommand_is_clean(name, capsys):
    with pytest.raises(SystemExit) as done:
        _main(name)(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: tokenq {name} ")
    assert "--redis-url" in text and "TOKENQ_REDIS_URL" in text
    assert [word for word in LEFTOVERS if word in text] == []
    if name == "worker":
        assert "--backend hf (Hugging Face transformers):" in text and "--no-log-json" not in text
    if name in ("stats", "dlq", "top"):
        assert "--json " in text and "TOKENQ_AS_JSON (--json)" in text
    if name == "embed":
        assert "--no-progress" in text and "--format {auto,text,jsonl}" in text


SETTINGS_OF = {
    "worker": WorkerSettings, "up": UpSettings, "embed": EmbedSettings, "stats": StatsSettings,
    "top": TopSettings, "dlq": DlqSettings, "functions": FunctionsSettings,
}


@pytest.mark.unit
@pytest.mark.parametrize("name", list(SUBCOMMAND_MAINS))
def test_help_lists_every_variable_the_subcommand_reads(name, capsys, monkeypatch):
    settings_cls = SETTINGS_OF[name]
    with pytest.raises(SystemExit):
        _main(name)(["--help"])
    text = capsys.readouterr().out
    listed = re.findall(r"TOKENQ_[A-Z0-9_]+", text.split("environment:", 1)[1])
    expected = [env_var(field) for field in settings_cls.model_fields
                if not is_positional(settings_cls, field)]
    assert listed == expected
    # And each is read: a bad value in any numeric one is refused, naming the variable.
    numeric = [field for field, info in settings_cls.model_fields.items()
               if info.annotation in (int, float)]
    for field in numeric:
        monkeypatch.setenv(env_var(field), "not-a-number")
    if numeric:
        argv = {"dlq": ["list"], "functions": ["load"], "embed": ["f", "--output", "o.jsonl"]}
        assert _main(name)(argv.get(name, [])) == 2
        err = capsys.readouterr().err
        assert all(env_var(field) in err for field in numeric), err


@pytest.mark.unit
def test_a_flag_that_does_not_exist_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as done:
        _main("stats")(["--as-json"])
    assert done.value.code == 2
    assert "unrecognized arguments: --as-json" in capsys.readouterr().err


def test_version():
    expected = f"tokenq {importlib.metadata.version('tokenq')}"
    for spelling in ("--version", "-V"):
        done = tokenq(spelling)
        assert (done.returncode, done.stdout.strip(), done.stderr) == (0, expected, "")
    assert "tokenq --version" in tokenq("--help").stdout
