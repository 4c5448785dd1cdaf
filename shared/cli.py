"""The ``tokenq`` command: a thin dispatcher that imports a side only when needed.

``tokenq worker`` and ``tokenq up`` load the worker (and, for real models,
torch); every other subcommand stays on the light producer side, so
``tokenq stats`` on an operator's laptop never imports torch. Subcommands are
looked up by module path so this module imports neither side (``shared``
never does).

Exit status, for every subcommand (docs/OPERATIONS.md, "Exit status"):
``0`` done; ``1`` (:data:`EXIT_FAILED`) an operational failure: Redis
unreachable, refusing the login or a command, a key of the wrong type, ids
not found, letters skipped, inputs that failed; ``2`` (:data:`EXIT_USAGE`)
bad flags, environment or arguments; ``130`` interrupted. A failure is
reported as one line, ``tokenq <cmd>: <message>``, never a traceback:
:func:`run_command` turns every ``TokenqError``, ``redis.RedisError`` and
``OSError`` a subcommand lets escape into that line, naming the Redis URL
with its password masked.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("tokenq.worker.cli", "run one worker process on a queue (--devices: one per GPU)"),
    "up": ("tokenq.worker.tooling.up", "start a local Redis and N workers (development, demos)"),
    "embed": ("tokenq.producer.ops.embed", "embed a file of texts through a queue, resumably"),
    "stats": ("tokenq.producer.ops.stats", "queue lengths, pending, lag, workers, dead letters"),
    "top": ("tokenq.producer.ops.top", "tokenq stats, refreshed live"),
    "dlq": ("tokenq.producer.ops.dlq", "list, retry or purge a queue's dead letters"),
}

EXIT_OK = 0
EXIT_FAILED = 1
"""An operational failure: Redis unreachable or refusing, ids not found, inputs failed."""
EXIT_USAGE = 2
"""Bad flags, environment or arguments: nothing was done."""
EXIT_INTERRUPTED = 130

S = TypeVar("S")


def usage() -> str:
    lines = ["usage: tokenq SUBCOMMAND [options]   (tokenq SUBCOMMAND --help)", "", "subcommands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(usage())
        return EXIT_OK
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"tokenq: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return EXIT_USAGE
    prog = f"tokenq {name}"
    # The last line of defence for subcommands that do not go through
    # run_command (``tokenq worker``): same one-line report, without the URL.
    return _guarded(prog, None, lambda: importlib.import_module(SUBCOMMANDS[name][0]).main(rest))


class UsageError(Exception):
    """Bad flags or environment for a subcommand; the message says which and why."""


class CommandFailed(Exception):
    """An operational failure whose message says everything the operator needs (exit 1)."""


def parse_settings(settings_cls: type[S], argv: Sequence[str], prog: str) -> S:
    """Flags over ``TOKENQ_*`` over defaults; :class:`UsageError` with a readable message.

    ``--help`` prints the settings with their defaults and exits (argparse's
    SystemExit), as every subcommand promises.
    """
    from pydantic import ValidationError
    from pydantic_settings import CliApp, SettingsError

    try:
        return CliApp.run(settings_cls, cli_args=list(argv))  # type: ignore[type-var]
    except ValidationError as exc:
        raise UsageError(f"{prog}: invalid settings:\n{describe(exc)}") from None
    except SettingsError as exc:
        raise UsageError(f"{prog}: {exc}") from None


def describe(exc: object) -> str:
    """One line per validation error, naming the flag and the environment variable."""
    lines = []
    for error in exc.errors():  # type: ignore[attr-defined]
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        if where == "settings" or where.startswith("__"):
            lines.append(f"  {error['msg']}")
            continue
        flag = "--" + where.replace("_", "-")
        lines.append(f"  {flag} (TOKENQ_{where.upper()}): {error['msg']}")
    return "\n".join(lines)


def run_command(
    settings_cls: type[S], argv: Sequence[str], prog: str, body: object
) -> int:
    """Parse settings and run ``body(settings)``; every failure becomes one line and a status.

    Usage errors exit 2; a ``TokenqError``, ``redis.RedisError`` or ``OSError``
    that escapes ``body`` is printed as ``<prog>: <message>`` (naming the
    password-masked Redis URL for Redis failures) and exits 1.
    """
    try:
        settings = parse_settings(settings_cls, argv, prog)
    except UsageError as exc:
        _print_usage_error(prog, exc)
        return EXIT_USAGE
    return _guarded(prog, settings, lambda: body(settings))  # type: ignore[operator]


def _guarded(prog: str, settings: object, call: object) -> int:
    try:
        return int(call() or 0)  # type: ignore[operator]
    except UsageError as exc:
        _print_usage_error(prog, exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # stdout went away (``tokenq dlq list | head``): nothing left to tell anyone.
        _silence_stdout()
        return EXIT_FAILED
    except Exception as exc:
        message = failure_message(exc, getattr(settings, "redis_url", None),
                                  getattr(settings, "socket_timeout_s", None))
        if message is None:
            raise  # a bug: its traceback is the report
        print(f"{prog}: {message}", file=sys.stderr)
        return EXIT_FAILED


def _print_usage_error(prog: str, exc: UsageError) -> None:
    text = str(exc)
    print(text if text.startswith(prog) else f"{prog}: {text}", file=sys.stderr)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def failure_message(
    exc: BaseException, redis_url: str | None = None, socket_timeout_s: float | None = None
) -> str | None:
    """The one-line report of an operational failure, or None when ``exc`` is not one.

    Redis failures name ``redis_url`` with its password masked.
    """
    from redis import exceptions as redis

    where = f"Redis at {redact_url(redis_url)}" if redis_url else "Redis"
    timeout = socket_timeout_s
    text = _SCRIPT_NOISE.sub("", one_line(str(exc))) or type(exc).__name__
    if isinstance(exc, CommandFailed):
        return text
    if isinstance(exc, redis.AuthenticationError):
        return (f"{where} refused the login: {text} (check the user name and password in "
                "--redis-url / TOKENQ_REDIS_URL)")
    if isinstance(exc, redis.TimeoutError) or (
        isinstance(exc, redis.ConnectionError) and "timeout" in text.lower()
    ):
        within = f" within --socket-timeout-s {timeout:g}" if timeout else ""
        return f"cannot reach {where}: no answer{within} ({text})"
    if isinstance(exc, redis.ConnectionError):
        return f"cannot reach {where}: {text}"
    if isinstance(exc, redis.NoPermissionError):
        return (f"{where} refused a command to this ACL user: {text} (docs/SECURITY.md "
                "lists the rights each command needs)")
    if is_wrong_type(exc):
        return f"{where}: a tokenq key holds the wrong type of value: {text}"
    if isinstance(exc, redis.RedisError):
        return f"{where} answered an error: {text}"
    from tokenq.shared.errors import TokenqError

    if isinstance(exc, TokenqError):
        return text
    if isinstance(exc, OSError):
        return text
    return None


_SCRIPT_NOISE = re.compile(r"\s*script: [0-9a-f]{40}, on @user_script:\d+\.?$")
"""What Redis appends to an error raised inside a Lua script: the sha and the line."""


def is_wrong_type(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis's WRONGTYPE (also when a pipeline wrapped it)."""
    from redis import exceptions as redis

    return isinstance(exc, redis.ResponseError) and "WRONGTYPE" in str(exc)


def one_line(text: str) -> str:
    """``text`` with its lines joined, for one-line reports."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def redact_url(url: str) -> str:
    """``url`` with its password masked (in the user part and a ``password=`` query)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            host = netloc.rsplit("@", 1)[1]
            netloc = f"{parts.username or ''}:***@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(name.lower() == "password" for name, _ in pairs):
                query = urlencode([(name, "***" if name.lower() == "password" else value)
                                   for name, value in pairs], safe="*")
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:  # not even parseable: show nothing that might be a secret
        scheme = url.split("://", 1)[0]
        return f"{scheme}://***"


if __name__ == "__main__":
    sys.exit(main())
