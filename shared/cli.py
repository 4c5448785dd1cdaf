"""The ``tokenq`` command: a thin dispatcher that imports a side only when needed.

``tokenq worker`` and ``tokenq up`` load the worker (and, for real models,
torch); every other subcommand stays on the light producer side, so
``tokenq stats`` on an operator's laptop never imports torch. Subcommands are
looked up by module path so this module imports neither side (``shared``
never does).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import TypeVar

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("tokenq.worker.cli", "run one worker process on a queue (--devices: one per GPU)"),
    "up": ("tokenq.worker.cli_up", "start a local Redis and N workers (development, demos)"),
    "embed": ("tokenq.producer.cli_embed", "embed a file of texts through a queue, resumably"),
    "stats": ("tokenq.producer.cli_stats", "queue lengths, pending, lag, workers, dead letters"),
    "top": ("tokenq.producer.cli_top", "tokenq stats, refreshed live"),
    "dlq": ("tokenq.producer.cli_dlq", "list, retry or purge a queue's dead letters"),
}

S = TypeVar("S")


def usage() -> str:
    lines = ["usage: tokenq SUBCOMMAND [options]   (tokenq SUBCOMMAND --help)", "", "subcommands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"tokenq: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


class UsageError(Exception):
    """Bad flags or environment for a subcommand; the message says which and why."""


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
    """Parse settings, run ``body(settings)``, turn usage errors into exit status 2."""
    try:
        settings = parse_settings(settings_cls, argv, prog)
        return int(body(settings) or 0)  # type: ignore[operator]
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
