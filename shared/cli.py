"""The ``tokenq`` dispatcher, importing a side only when needed (no torch for ``tokenq stats``);
every failure is one line ``tokenq <cmd>: <message>`` and an exit status (``exit_codes.py``)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tokenq.shared.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from tokenq.shared.failures import failure_message
from tokenq.shared.flags import UsageError, parse_settings
from tokenq.shared.interrupts import InterruptRecord, unwrapped


@dataclass(frozen=True)
class Subcommand:
    """One ``tokenq`` subcommand: where its ``main`` lives, what it does, the pip extra it needs
    to run (its ``--help`` never does)."""

    module: str
    summary: str
    extra: str | None = None


SUBCOMMANDS: dict[str, Subcommand] = {
    "worker": Subcommand("tokenq.worker.cli",
                         "run one worker process on a queue (--devices: one per GPU)", "worker"),
    "up": Subcommand("tokenq.worker.tooling.up",
                     "start a local Redis and N workers (development, demos)", "worker"),
    "embed": Subcommand("tokenq.producer.ops.embed",
                        "embed a file of texts through a queue, resumably", "cli"),
    "stats": Subcommand("tokenq.producer.ops.stats",
                        "queue lengths, pending, lag, workers, dead letters"),
    "top": Subcommand("tokenq.producer.ops.top", "tokenq stats, refreshed live", "cli"),
    "dlq": Subcommand("tokenq.producer.ops.dlq", "list, retry or purge a queue's dead letters"),
    "quotas": Subcommand("tokenq.producer.ops.quotas",
                         "show, set or clear tenants' quotas of pending tokens"),
    "functions": Subcommand("tokenq.producer.ops.functions",
                            "load tokenq's Lua functions (Redis 7+)"),
    "serve": Subcommand("tokenq.producer.serve.cli",
                        "an HTTP gateway: OpenAI and TEI APIs over queues", "serve"),
}

S = TypeVar("S")


def usage() -> str:
    lines = ["usage: tokenq SUBCOMMAND [options]   (tokenq SUBCOMMAND --help)",
             "       tokenq --version", "", "subcommands:"]
    lines += [f"  {name:<10} {command.summary}" for name, command in SUBCOMMANDS.items()]
    return "\n".join(lines)


def version() -> str:
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
    # The last defence for subcommands without run_command (``tokenq worker``).
    module = SUBCOMMANDS[name].module
    return _guarded(f"tokenq {name}", None, lambda: importlib.import_module(module).main(rest))


def run_command(
    settings_cls: type[S], argv: Sequence[str], prog: str, body: object,
    actions: Mapping[str, str] | None = None,
) -> int:
    """Parse settings and run ``body(settings)``: usage errors exit 2, an operational failure is
    ``<prog>: <message>`` and exit 1. ``actions`` describes each ACTION value for ``--help``."""
    try:
        settings = parse_settings(settings_cls, argv, prog, actions)
    except UsageError as exc:
        _print_usage_error(prog, exc)
        return EXIT_USAGE
    return _guarded(prog, settings, lambda: body(settings))  # type: ignore[operator]


def _guarded(prog: str, settings: object, call: object) -> int:
    record = InterruptRecord()
    try:
        with record.recording(), unwrapped(lambda: record.seen):
            return int(call() or 0)  # type: ignore[operator]
    except UsageError as exc:
        _print_usage_error(prog, exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ModuleNotFoundError as exc:
        return report_missing_extra(prog, exc)
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


def report_missing_extra(prog: str, exc: ModuleNotFoundError) -> int:
    """Say in one line which pip extra ``prog`` needs (:data:`EXIT_USAGE`); re-raise a missing
    module of tokenq's own or of a command with no extra."""
    command = SUBCOMMANDS.get(prog.removeprefix("tokenq "))
    missing = (exc.name or "").partition(".")[0]
    if command is None or command.extra is None or missing in ("", "tokenq"):
        raise exc
    print(f"{prog} needs the {command.extra} extra (no module named {missing!r}): "
          f"pip install 'tokenq[{command.extra}]'", file=sys.stderr)
    return EXIT_USAGE


def _print_usage_error(prog: str, exc: UsageError) -> None:
    text = str(exc)
    print(text if text.startswith(prog) else f"{prog}: {text}", file=sys.stderr)


def silence_stdout() -> None:
    """Point stdout at /dev/null: its reader went away, and the interpreter's last flush must
    not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
