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

import argparse
import importlib
import inspect
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from tokenq.shared.redis_url import redact

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("tokenq.worker.cli", "run one worker process on a queue (--devices: one per GPU)"),
    "up": ("tokenq.worker.tooling.up", "start a local Redis and N workers (development, demos)"),
    "embed": ("tokenq.producer.ops.embed", "embed a file of texts through a queue, resumably"),
    "stats": ("tokenq.producer.ops.stats", "queue lengths, pending, lag, workers, dead letters"),
    "top": ("tokenq.producer.ops.top", "tokenq stats, refreshed live"),
    "dlq": ("tokenq.producer.ops.dlq", "list, retry or purge a queue's dead letters"),
    "functions": ("tokenq.producer.ops.functions", "load tokenq's Lua functions (Redis 7+)"),
    "serve": ("tokenq.producer.serve.cli", "an HTTP gateway: OpenAI and TEI APIs over queues"),
}

EXIT_OK = 0
EXIT_FAILED = 1
"""An operational failure: Redis unreachable or refusing, ids not found, inputs failed."""
EXIT_USAGE = 2
"""Bad flags, environment or arguments: nothing was done."""
EXIT_INTERRUPTED = 130

S = TypeVar("S")


def usage() -> str:
    lines = ["usage: tokenq SUBCOMMAND [options]   (tokenq SUBCOMMAND --help)",
             "       tokenq --version", "", "subcommands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def version() -> str:
    """The installed tokenq's version, from the package metadata."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("tokenq")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(usage())
        return EXIT_OK
    if args[0] in {"-V", "--version"}:
        print(f"tokenq {version()}")
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


def parse_settings(
    settings_cls: type[S], argv: Sequence[str], prog: str,
    actions: Mapping[str, str] | None = None,
) -> S:
    """Flags over ``TOKENQ_*`` over defaults; :class:`UsageError` naming each bad setting.

    ``--help`` prints the settings with their defaults, the ``actions`` (what
    each value of the command's ACTION does) and every environment variable
    the command reads, then exits (argparse's SystemExit), as does a flag
    that does not exist (status 2).
    """
    from pydantic import ValidationError
    from pydantic_settings import CliApp, CliSettingsSource, SettingsError

    from tokenq.shared.settings import describe_errors

    try:
        source: CliSettingsSource[Any] = CliSettingsSource(
            settings_cls,  # type: ignore[arg-type]
            root_parser=_root_parser(settings_cls, prog, actions),
            add_argument_method=_argument_adder(settings_cls),
        )
        return CliApp.run(settings_cls, cli_args=list(argv), cli_settings_source=source)
    except ValidationError as exc:
        problems = describe_errors(exc, settings_cls)  # type: ignore[arg-type]
        lines = "\n".join(f"  {line}" for line in problems)
        raise UsageError(f"{prog}: invalid settings:\n{lines}") from None
    except SettingsError as exc:
        raise UsageError(f"{prog}: {exc}") from None


def _root_parser(
    settings_cls: Any, prog: str, actions: Mapping[str, str] | None
) -> argparse.ArgumentParser:
    """The parser ``--help`` describes: the docstring, the actions, then the variables."""
    description = inspect.cleandoc(settings_cls.__doc__ or "")
    if actions:
        width = max(len(name) for name in actions) + 4
        description += "\n\nactions:\n" + "\n".join(
            textwrap.fill(what, 79, initial_indent=f"  {name:<{width - 2}}",
                          subsequent_indent=" " * width)
            for name, what in actions.items())
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=environment_help(settings_cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )


def environment_help(settings_cls: Any) -> str:
    """The ``--help`` paragraph listing every ``TOKENQ_*`` variable the command reads.

    Generated from the settings class (a positional argument has no
    variable), so a new setting is listed without anyone writing it down;
    a variable whose flag is spelt apart names its flag.
    """
    from tokenq.shared.settings import env_var, flag, is_positional

    names = []
    for name in settings_cls.model_fields:
        if is_positional(settings_cls, name):
            continue
        spelt = flag(settings_cls, name)
        apart = spelt != "--" + name.replace("_", "-")
        names.append(f"{env_var(name)} ({spelt})" if apart else env_var(name))
    head = ("environment: every option is also a variable (flags win over the environment, "
            "the environment over the defaults; a switch takes true or false):")
    lines = [""]
    for at, name in enumerate(names):
        word = name + ("," if at < len(names) - 1 else "")
        if lines[-1] and len(lines[-1]) + 1 + len(word) > 77:  # a name is never cut in two
            lines.append("")
        lines[-1] += (" " if lines[-1] else "") + word
    return "\n".join(textwrap.wrap(head, 79) + ["  " + line for line in lines])


def _argument_adder(settings_cls: Any) -> Callable[..., Any]:
    """pydantic-settings' ``add_argument`` with tokenq's flag names, metavars and help.

    Each option's help is its field's description and its default when it
    has one worth saying (never ``(default: null)``); a boolean is one
    switch away from its default; the settings of one backend go under that
    backend's heading.
    """
    from tokenq.shared.settings import flag, help_group

    fields = settings_cls.model_fields
    groups: dict[str, Any] = {}

    def add_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> Any:
        name = str(kwargs.get("dest", names[0]))
        info = fields.get(name)
        if info is None:
            return parser.add_argument(*names, **kwargs)
        kwargs["help"] = _help_text(info)
        if isinstance(kwargs.get("metavar"), str) and str(kwargs["metavar"]).startswith("list["):
            kwargs["metavar"] = name.upper()
        choices = _literal_choices(info.annotation)
        if not names[0].startswith("-") and choices:
            # A positional's values are its actions: usage and help name them.
            kwargs["metavar"] = "{" + ",".join(choices) + "}"
        if names[0].startswith("-"):
            names = (flag(settings_cls, name),)
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            # One switch, away from the default: --json, --no-progress.
            on = info.get_default() is not True
            kwargs["action"] = "store_true" if on else "store_false"
            if not on:
                names = ("--no-" + names[0].removeprefix("--"),)
                kwargs["help"] = off_help(info)
        title = help_group(settings_cls, name)
        if title is not None:
            if title not in groups:
                groups[title] = parser.add_argument_group(title)
            return groups[title].add_argument(*names, **kwargs)
        return parser.add_argument(*names, **kwargs)

    return add_argument


def off_help(info: Any) -> str:
    """What a default-on switch's ``--no-X`` does, for ``--help``.

    A field's description says what the setting *is* ("show a progress bar
    on stderr"), which read as the help of ``--no-progress`` says the
    opposite of what the flag does; so such a field names its off state in
    ``json_schema_extra={"off_help": ...}`` (tests/test_first_day.py holds
    every default-on switch to it).
    """
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    said = extra.get("off_help")
    return str(said) if said else f"turn off (on by default): {info.description}"


def _literal_choices(annotation: Any) -> list[str]:
    """The values of a ``Literal[...]`` annotation (through ``Annotated``), else []."""
    from typing import Literal, get_args, get_origin

    while get_origin(annotation) is not None and get_origin(annotation) is not Literal:
        args = get_args(annotation)
        if not args:
            return []
        annotation = args[0]
    if get_origin(annotation) is Literal:
        return [str(value) for value in get_args(annotation)]
    return []


def _help_text(info: Any) -> str:
    """A field's description, then its default unless that is "unset" or "off"."""
    text = str(info.description or "")
    if info.is_required():
        return text
    default = info.get_default(call_default_factory=True)
    if default is None or default is False or default in ("", []):
        return text
    shown = "on" if default is True else f"{default:g}" if isinstance(default, float) else default
    return f"{text} (default: {shown})"


def run_command(
    settings_cls: type[S], argv: Sequence[str], prog: str, body: object,
    actions: Mapping[str, str] | None = None,
) -> int:
    """Parse settings and run ``body(settings)``; every failure becomes one line and a status.

    Usage errors exit 2; a ``TokenqError``, ``redis.RedisError`` or ``OSError``
    that escapes ``body`` is printed as ``<prog>: <message>`` (naming the
    password-masked Redis URL for Redis failures) and exits 1. ``actions``
    describes each value of the command's ACTION for ``--help``.
    """
    try:
        settings = parse_settings(settings_cls, argv, prog, actions)
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
        silence_stdout()
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


def silence_stdout() -> None:
    """Point stdout at /dev/null: its reader went away (``tokenq dlq list | head``), and
    the interpreter's last flush must not fail again."""
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

    from tokenq.shared import redis_refusal

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
    if isinstance(exc, redis.ResponseError) and redis_refusal.is_out_of_memory(exc):
        return (f"{where} is out of memory (maxmemory) and refused the write: {text} "
                "(nothing was written; free memory or raise maxmemory, then try again)")
    if isinstance(exc, redis.RedisError):
        return f"{where} answered an error: {text}"
    from tokenq.shared.errors import TokenqError

    if isinstance(exc, TokenqError):
        return text
    if isinstance(exc, OSError):
        return text
    return None


_SCRIPT_NOISE = re.compile(
    r"\s*script: (?:[0-9a-f]{40}|tokenq_\w+), on @user_(?:script|function):\d+\.?$")
"""What Redis appends to an error raised inside a Lua script: the sha and the line."""


def is_wrong_type(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis's WRONGTYPE (also when a pipeline wrapped it)."""
    from redis import exceptions as redis

    from tokenq.shared import redis_refusal

    return isinstance(exc, redis.ResponseError) and redis_refusal.error_code(exc) == "WRONGTYPE"


def plural(n: int, word: str, words: str | None = None) -> str:
    """``n`` and the noun that agrees with it: "1 dead letter", "2 dead letters", "1,204 batches".

    ``words`` is the plural when adding "s" (or "es" after s, x, ch, sh) is wrong.
    """
    if n == 1:
        return f"{n} {word}"
    if words is None:
        words = word + ("es" if word.endswith(("s", "x", "ch", "sh")) else "s")
    return f"{n:,} {words}"


def one_line(text: str) -> str:
    """``text`` with its lines joined, for one-line reports."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def redact_url(url: str) -> str:
    """``url`` with its password masked (in the user part and a ``password=`` query)."""
    return redact(url)


if __name__ == "__main__":
    sys.exit(main())
